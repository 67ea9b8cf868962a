"""The package's shape, checked on its source with `ast` (the import
contract itself is `lint-imports`, run by .ci/run; pyproject.toml lists the
layers): no module over 500 lines, in jaxinfer and in the tools beside it
(jaxinfer_tools), and every jaxinfer import at module top, so the import
graph seen by the contract is the whole graph."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxinfer"
MODULES = sorted(PACKAGE.rglob("*.py"))
TOOLS = ROOT / "jaxinfer_tools"
TOOL_MODULES = sorted(TOOLS.rglob("*.py"))
MAX_LINES = 500


def test_the_package_has_modules():
    assert len(MODULES) > 50


def test_the_tools_stand_beside_the_package():
    assert len(TOOL_MODULES) > 30
    assert not (PACKAGE / "tools").exists()


@pytest.mark.parametrize("path", MODULES + TOOL_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def _local_jaxinfer_imports(tree: ast.Module) -> list[str]:
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxinfer"):
                found.append(f"line {node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"line {node.lineno}: import {a.name}" for a in node.names
                          if a.name.startswith("jaxinfer")]
    return found


# The one place a jaxinfer import waits for its call: `jaxinfer serve` needs
# the optional serve extra (FastAPI), which jaxinfer.server imports.
LOCAL_IMPORT_ALLOWED = {"cli/serve.py"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_jaxinfer_imports_at_module_top(path):
    if str(path.relative_to(PACKAGE)) in LOCAL_IMPORT_ALLOWED:
        return
    assert _local_jaxinfer_imports(ast.parse(path.read_text())) == []
