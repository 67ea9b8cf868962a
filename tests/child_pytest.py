"""Run pytest in a child process and read back what each test did.

A child pytest that exits 0 may have skipped every test it ran (a model that
could not be fetched, a CPU feature the build lacks), so its exit status alone
cannot say "passed". `run` has the child write a JUnit XML report and returns
each test's outcome; `check` passes only when the child ran at least one test
and every test passed: a skipped one (or an xfail) fails the calling test,
unless the caller allows skipping, in which case a child that skipped
everything skips the calling test with the child's reason.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """cmd: the child's command line; returncode: its exit status; output:
    its stdout then stderr; outcomes: "classname::name" -> (outcome, message)
    per test case of its JUnit report, outcome one of "passed", "failed",
    "error", "skipped" (pytest.skip and xfail), message the reason or
    the failure's first line ("" for passed)."""

    cmd: list
    returncode: int
    output: str
    outcomes: dict

    def describe(self, tail: int = 6000) -> str:
        return f"{' '.join(self.cmd)} exited {self.returncode}:\n{self.output[-tail:]}"


def _outcome(case: ET.Element) -> tuple[str, str]:
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            outcome = {"failure": "failed"}.get(tag, tag)
            return outcome, found.get("message", "")
    return "passed", ""


def read_junit(path: pathlib.Path) -> dict:
    """{"classname::name": (outcome, message)} of a pytest JUnit XML report."""
    cases = ET.parse(path).getroot().iter("testcase")
    return {f"{c.get('classname')}::{c.get('name')}": _outcome(c) for c in cases}


def run(args: list, *, env: dict | None = None, cwd: pathlib.Path = ROOT,
        timeout_s: float = 1800) -> ChildRun:
    """`python -m pytest -q -p no:cacheprovider --junitxml=... *args` in `cwd`
    with `env` (default: this process's); fails the calling test when it runs
    past `timeout_s` seconds."""
    with tempfile.TemporaryDirectory(prefix="child-pytest-") as tmp:
        report = pathlib.Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *map(str, args)]
        try:
            done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(cmd)} ran past {timeout_s:.0f} s", pytrace=False)
        outcomes = read_junit(report) if report.is_file() else {}
    return ChildRun(cmd, done.returncode, done.stdout + done.stderr, outcomes)


def check(child: ChildRun, *, skip_allowed: bool = False, what: str = "") -> None:
    """Return when the child ran tests and every one passed; otherwise fail
    the calling test (`pytest.fail`, with the child's output or its skip
    reasons). With `skip_allowed` (a test that skips only where its inputs
    cannot be had) skipped tests are no failure: a child whose every test
    skipped skips the calling test with the first skip's reason, and one
    that passed the others passes. `what` is added to the messages."""
    label = f"child pytest{f' ({what})' if what else ''}"
    if child.returncode != 0 or not child.outcomes:
        ran = "ran no tests: " if child.returncode == 0 else ""
        pytest.fail(f"{label} {ran}{child.describe()}", pytrace=False)
    skipped = {k: m for k, (o, m) in child.outcomes.items() if o == "skipped"}
    if not skipped:
        return
    reasons = "\n".join(f"  {k}: {m}" for k, m in skipped.items())
    if not skip_allowed:
        pytest.fail(f"{label} skipped {len(skipped)} of {len(child.outcomes)} tests, and this "
                    f"test does not allow skipping:\n{reasons}", pytrace=False)
    if len(skipped) == len(child.outcomes):
        pytest.skip(f"{label} skipped: {next(iter(skipped.values()))}")
