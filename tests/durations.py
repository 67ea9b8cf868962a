"""Test durations, for ordering the test files (tests/conftest.py).

`python tests/durations.py [--scale S] LOG...` reads the `--durations`
lines of pytest's output (`<seconds>s <phase> <nodeid>`; `.ci/run` prints
the slowest 30 of each run) and writes tests/durations.json: seconds per test
node id (setup, call and teardown together, times S), rounded to 0.1 s,
tests under 0.5 s left out. A test named in several logs keeps the figure of
the last one. Where a module's tests are missing from the file, the module
counts as costing nothing and runs after the costly ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re

FILE = pathlib.Path(__file__).with_name("durations.json")
LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
SMALLEST_S = 0.5


def parse(text: str) -> dict[str, float]:
    """{nodeid: seconds} summed over the phases of the `--durations` lines in `text`."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def load(path: pathlib.Path = FILE) -> dict[str, float]:
    """{nodeid: seconds} of tests/durations.json ({} when it is missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def module_costs(nodeids, durations: dict[str, float]) -> dict[str, float]:
    """{test file: summed seconds of its tests among `nodeids`}."""
    out: dict[str, float] = collections.defaultdict(float)
    for nodeid in nodeids:
        out[nodeid.split("::")[0]] += durations.get(nodeid, 0.0)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=pathlib.Path)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every figure (another machine's pace)")
    args = ap.parse_args()
    merged = load()
    for log in args.logs:
        merged.update({k: v * args.scale for k, v in parse(log.read_text()).items()})
    kept = {k: round(v, 1) for k, v in sorted(merged.items()) if v >= SMALLEST_S}
    FILE.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
    print(f"{FILE}: {len(kept)} tests, {sum(kept.values()):.0f} s")


if __name__ == "__main__":
    main()
