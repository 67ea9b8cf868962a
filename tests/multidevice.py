"""Run a test case in a fresh Python process with N forced CPU devices.

JAX fixes its device count when it starts, so a test that needs several
devices runs `module.function(**kwargs)` in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`, and reads back the
JSON the function returns (the last stdout line starting with `MARKER`).
On a GPU or TPU backend the flag changes nothing and the case sees the
accelerators; a case returns {"skip": reason} when there are too few.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = "@@multidevice-result@@ "

_CHILD = """
import json, sys
from {module} import {function}
result = {function}(**json.loads(sys.argv[1]))
print({marker!r} + json.dumps(result), flush=True)
"""


def run_case(devices: int, module: str, function: str, timeout_s: float = 900.0,
             env: dict | None = None, xla_flags: str | None = None, **kwargs) -> dict:
    """`module.function(**kwargs)` (JSON in, JSON out) in a subprocess with
    `devices` forced CPU devices, killed after `timeout_s` seconds. Its
    XLA_FLAGS are `xla_flags` (default: this process's) and the device count.

    Skips the calling test when the case returns {"skip": reason}.
    Raises AssertionError (with the child's stderr tail) when it fails."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    child_env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
                     PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                 os.environ.get("PYTHONPATH", "")]))
    child_env.update(env or {})
    code = _CHILD.format(module=module, function=function, marker=MARKER)
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], env=child_env,
                              capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{module}.{function} did not finish within {timeout_s:.0f} s; "
                             f"stderr tail:\n{(e.stderr or b'')[-3000:]!r}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{module}.{function} exited with {proc.returncode}; stderr tail:\n"
                             f"{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(MARKER):])
    if isinstance(result, dict) and "skip" in result:
        pytest.skip(result["skip"])
    return result
