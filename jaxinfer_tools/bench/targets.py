"""The bench's targets, held as data: each is a name, a measure (a path into
the results dict), a comparison and a goal. `compute_targets` reads them off a
results dict; nothing here times anything.

A measure is `section[key=value,...].field.field...`: the row of a list whose
keys match, then nested fields, e.g. `decode[batch=1].peers.hf.speedup`; two
such paths joined by ` / ` are a ratio. A path that is not in the results (a
cell or peer not measured) gives None, reported as "not measured".

`verdict` is the one rule every bench sweep judges a figure by: PASS or
FAIL for a figure, "not measured" (never a PASS) for a figure it could not
compute.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import sys
from typing import Optional, Sequence


NOT_MEASURED = "not measured"
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def verdict(value: Optional[float], op: str, goal: float) -> str:
    """"PASS" when `value op goal` holds, "FAIL" when it does not, and
    NOT_MEASURED when value is None or NaN: a figure that could not be
    computed (a run that failed or did not run, a peer that met the SLO at
    no rate, a ratio missing either side) is never judged met.

    Raises:
      ValueError: op is not one of OPS (">=", ">", "<=", "<").
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, got {op!r}")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_MEASURED
    return "PASS" if OPS[op](value, goal) else "FAIL"


@dataclasses.dataclass(frozen=True)
class Target:
    """One goal: `measure` `op` `goal`, op being ">=" or "<"."""

    name: str
    measure: str
    op: str
    goal: float


def _prefill_targets() -> tuple[Target, ...]:
    """Prefill at B=1 and B=8: >= 1.2x HF transformers at T = 128, 512, 2048, and
    >= 0.7 of the best measured FLOP/s at T >= 512."""
    speed = tuple(Target(f"prefill T={t} B={b}: x HF transformers (tokens/s)",
                         f"prefill[batch={b},prompt_len={t}].peers.hf.speedup", ">=", 1.2)
                  for b in (1, 8) for t in (128, 512, 2048))
    compute = tuple(Target(f"prefill T={t} B={b}: fraction of best matmul FLOP/s",
                           f"prefill[batch={b},prompt_len={t}].compute_fraction", ">=", 0.70)
                    for b in (1, 8) for t in (512, 2048))
    return compute + speed


TARGETS: tuple[Target, ...] = (
    Target("decode B=1: fraction of best memory bandwidth (bytes/step / bandwidth / TPOT)",
           "decode[batch=1].memory_fraction", ">=", 0.70),
    Target("decode B=1: x HF transformers (tokens/s)", "decode[batch=1].peers.hf.speedup",
           ">=", 2.0),
    Target("decode B=32: fraction of best matmul FLOP/s (achieved / peak)",
           "decode[batch=32].compute_fraction", ">=", 0.50),
    Target("decode B=32 aggregate tokens/s / llama.cpp B=1 tokens/s",
           "decode[batch=32].tokens_per_s / decode[batch=1].peers.llamacpp.tokens_per_s",
           ">=", 3.0),
    *_prefill_targets(),
    Target("compile prefill+decode, first start (s)", "compile.first_start_compile_s", "<", 20.0),
    Target("compile prefill+decode, second start (s)", "compile.second_start_compile_s", "<", 3.0),
    Target("warm start: load + prefill compile, second start (s)", "compile.second_start_ready_s",
           "<", 2.0),
)

_STEP = re.compile(r"^(\w+)(?:\[([^\]]*)\])?$")


def _lookup(results: dict, path: str):
    """The value at one `section[key=value].field` path, or None."""
    node = results
    for step in path.strip().split("."):
        m = _STEP.match(step)
        if m is None:
            raise ValueError(f"bad measure path step {step!r} in {path!r}")
        node = node.get(m.group(1)) if isinstance(node, dict) else None
        if m.group(2) is not None:
            keys = dict(kv.split("=") for kv in m.group(2).split(","))
            node = next((row for row in node or [] if all(
                str(row.get(k)) == v for k, v in keys.items())), None)
        if node is None:
            return None
    return node


def measure_value(results: dict, measure: str) -> Optional[float]:
    """The value of a measure (a path, or `path / path`) in results, or None."""
    parts = [_lookup(results, p) for p in measure.split(" / ")]
    if any(p is None for p in parts):
        return None
    value = parts[0]
    for p in parts[1:]:
        value = value / p
    return value


def compute_targets(results: dict, targets: Sequence[Target] = TARGETS) -> list[dict]:
    """Each target judged on a results dict: {"name", "measure", "value" (None
    when not measured), "op", "goal", "result" (`verdict`), "passed" (None
    when not measured)}."""
    out = []
    for t in targets:
        value = measure_value(results, t.measure)
        result = verdict(value, t.op, t.goal)
        out.append({"name": t.name, "measure": t.measure, "value": value, "op": t.op,
                    "goal": t.goal, "result": result,
                    "passed": None if result == NOT_MEASURED else result == "PASS"})
    return out


def print_targets(targets: Sequence[dict], file=None) -> None:
    """One explicit line per target: its verdict (PASS / FAIL / not
    measured), value and goal."""
    file = file or sys.stdout
    for t in targets:
        result = verdict(t["value"], t["op"], t["goal"])
        value = "-" if result == NOT_MEASURED else f"{t['value']:.4g}"
        print(f"[target] {result} {t['name']}: {value} (goal {t['op']} {t['goal']:g})", file=file)
