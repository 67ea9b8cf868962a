"""`jaxinfer trace`: watch prefill and decode happen, with the engine's own numbers.

    jaxinfer trace --config configs/toy-two-layer.yaml --prompt 你好 --steps 2 [--plot DIR]

Runs real `engine.prefill(..., collect=True)` on the prompt and then one
`engine.decode_step(..., collect=True)` per step (greedy), and prints per
phase and per layer the Q/K/V, the raw scores, the mask added, the softmax
weights ([T, T] in prefill, [1, t] in decode), what was written into the KV
cache and what each layer's cache holds, and the last-position logits.

Every decode step is checked against a full recompute: `prefill` of the
whole sequence so far on a fresh cache must give a [t, t] matrix whose last
row equals the decode row and whose first t-1 rows equal the previous step's
recompute (within `Tolerance`: atol 1e-6 for the toy model; float32 noise
of real models, which grows with depth and score size, also gets a relative
term). Also checked: masked weights are exactly 0, and
each layer's cache buffer holds exactly the K/V written at positions below
its length and zeros beyond (read from the KVCache buffers).

The config may be a toy config (`kind: toy`, see `jaxinfer.tools.toy`; the model
is trained first if its folder is missing) or a GenerationConfig YAML for a
real model; real models print shapes, norms and top tokens instead of full
matrices. The prompt is raw text (no chat template).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import engine
from jaxinfer.cache import init_cache
from jaxinfer.config import FULL_ATTENTION, ModelConfig

ATOL = 1e-6                 # decode row vs full recompute, scores and weights
LOGITS_ATOL = 1e-4          # decode logits vs full recompute (float32 through every layer)
DETAIL_MAX_HIDDEN = 16      # models this small print full matrices and vectors


# --- data ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """|a - b| <= atol + rtol * max|b| over a compared block.

    `for_model` picks atol 1e-6, rtol 0 for tiny float32 models (the toy);
    rtol 1e-5 for larger float32 models, where prefills of different lengths
    round differently and the difference grows through the layers (SmolLM2
    135M: ~2e-5 on scores of ~15); rtol 2e-2 for 16-bit params.
    """

    atol: float = ATOL
    rtol: float = 0.0

    @classmethod
    def for_model(cls, config: ModelConfig, dtype) -> "Tolerance":
        if jnp.dtype(dtype) != jnp.float32:
            return cls(ATOL, 2e-2)
        return cls(ATOL, 0.0 if config.hidden_size <= DETAIL_MAX_HIDDEN else 1e-5)

    def bound(self, ref: np.ndarray) -> float:
        return self.atol + self.rtol * float(np.abs(ref).max(initial=0.0))

    def __str__(self) -> str:
        return f"atol {self.atol:g}" + (f" + {self.rtol:g} x max|ref|" if self.rtol else "")


@dataclasses.dataclass
class Check:
    """One verified statement; `max_diff` is the largest |difference| found
    (0.0 when exact), None for checks that are not a numeric comparison."""

    what: str
    ok: bool
    max_diff: Optional[float] = None
    tolerance: str = ""


@dataclasses.dataclass
class LayerTrace:
    """One layer in one phase, batch row 0, float32 numpy.

    Attributes:
      layer: global layer index; kind: FULL_ATTENTION or SLIDING_ATTENTION.
      q: [T, N, H] new queries (RoPE applied, scaled by `config.query_scale`).
      k, v: [T, K, H] new keys (RoPE applied) and values.
      key_pos: [S'] positions of the key columns below, ascending: the T
        prompt positions in prefill, the cached positions 0..t-1 in decode
        (for sliding layers, the positions the ring buffer holds).
      scores: [N, T, S'] raw q.k (before the mask); mask: bool [T, S'] (True =
        visible); weights: [N, T, S'] softmax(scores + where(mask, 0, -inf)).
      masked_weight_max: largest |weight| over every masked entry of the
        engine's full score buffer (must be exactly 0).
      cache_k, cache_v: [slots, K, H] this layer's cache buffer after the phase;
      cache_pos: [slots] position held by each slot, -1 when empty.
      changed_slots: slots whose K or V buffer content changed in this phase.
      checks: this layer's checks (cache contents, recompute agreement).
    """

    layer: int
    kind: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    key_pos: np.ndarray
    scores: np.ndarray
    mask: np.ndarray
    weights: np.ndarray
    masked_weight_max: float
    cache_k: Optional[np.ndarray] = None
    cache_v: Optional[np.ndarray] = None
    cache_pos: Optional[np.ndarray] = None
    changed_slots: tuple[int, ...] = ()
    checks: list[Check] = dataclasses.field(default_factory=list)
    recompute: Optional["LayerTrace"] = None


@dataclasses.dataclass
class Phase:
    """Prefill (step 0) or decode step k >= 1.

    Attributes:
      token_ids / positions: the tokens fed in this call and their positions.
      embeddings: [T, D] their embedding rows (the input x of layer 0).
      length_before / length_after: cache.lengths[0] around the call.
      layers: one LayerTrace per layer.
      logits: float32 [V] at the last fed position; chosen: the greedy id.
      recompute_logits: [V] last-position logits of the full recompute (decode only).
      phase_checks: checks about the whole call (not per layer).
    """

    step: int
    token_ids: list[int]
    positions: list[int]
    embeddings: np.ndarray
    length_before: int
    length_after: int
    layers: list[LayerTrace]
    logits: np.ndarray
    chosen: int
    recompute_logits: Optional[np.ndarray] = None
    phase_checks: list[Check] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return "prefill" if self.step == 0 else f"decode step {self.step}"

    @property
    def checks(self) -> list[Check]:
        return [c for layer in self.layers for c in layer.checks] + self.phase_checks


@dataclasses.dataclass
class Trace:
    """A traced generation: the prompt ids, one Phase per engine call, the
    generated ids (greedy, ending at a stop id if one came), the cache size."""

    config: ModelConfig
    prompt_ids: list[int]
    phases: list[Phase]
    generated: list[int]
    max_seq_len: int
    stopped: bool = False

    @property
    def ok(self) -> bool:
        return all(c.ok for p in self.phases for c in p.checks)


# --- running the engine --------------------------------------------------------------------


def _snapshot(cache) -> dict:
    """Host copies of the cache buffers (taken before a call donates them),
    each type's per-layer buffers stacked to [L, B, K, S, H]."""
    return {name: np.array(getattr(cache, name)) for name in
            ("k_full", "v_full", "k_window", "v_window", "window_pos", "lengths")}


def _stack_index(config: ModelConfig, layer: int) -> int:
    """Index of `layer` within its attention type's K/V stack."""
    kind = config.attention_types[layer]
    return sum(1 for t in config.attention_types[:layer] if t == kind)


# Layout knowledge lives in these helpers only: cache snapshots are
# K [L, B, K, H, S] and V [L, B, K, S, H] (see jaxinfer.cache) and the engine's k/v
# internals are [L, B, K, T or S, H]; the trace works in [S, K, H].


def _positions_major(kv: np.ndarray) -> np.ndarray:
    """One layer's, one row's heads-major [K, S, H] -> [S, K, H]."""
    return np.swapaxes(kv, 0, 1)


def _cache_view(config: ModelConfig, snap: dict, layer: int):
    """(k [slots, K, H], v, slot positions [slots]) of one layer, batch row 0."""
    i = _stack_index(config, layer)
    if config.attention_types[layer] == FULL_ATTENTION:
        k, v = snap["k_full"][i, 0].swapaxes(1, 2), snap["v_full"][i, 0]
        slots = np.arange(k.shape[1])
        pos = np.where(slots < snap["lengths"][0], slots, -1)
    else:
        k, v = snap["k_window"][i, 0].swapaxes(1, 2), snap["v_window"][i, 0]
        pos = snap["window_pos"][0].copy()
    return _positions_major(k), _positions_major(v), pos


def _slot_of(config: ModelConfig, layer: int, position: int, snap: dict) -> int:
    if config.attention_types[layer] == FULL_ATTENTION:
        return position
    return position % snap["window_pos"].shape[1]


def _layer_traces(config: ModelConfig, internals, after: dict, positions: Sequence[int],
                  decode: bool) -> list[LayerTrace]:
    """LayerTraces (batch row 0) from the per-segment internals of one call."""
    out = []
    for seg, aux in zip(engine.layer_segments(config), jax.device_get(internals)):
        for j in range(seg.stop - seg.start):
            layer = seg.start + j
            a = {name: np.asarray(x[j, 0], np.float32) if name != "mask" else np.asarray(x[j, 0])
                 for name, x in aux.items()}
            scores = a["scores"].reshape(-1, *a["scores"].shape[-2:])     # [N, T, S]
            weights = a["weights"].reshape(-1, *a["weights"].shape[-2:])
            mask = a["mask"]                                              # [T, S]
            masked = np.abs(weights[:, ~mask]) if (~mask).any() else np.zeros(1)
            a["k"], a["v"] = _positions_major(a["k"]), _positions_major(a["v"])
            if decode:
                _, _, slot_pos = _cache_view(config, after, layer)
                slot = _slot_of(config, layer, positions[0], after)
                k, v = a["k"][slot][None], a["v"][slot][None]
                cols = [s for s in np.argsort(slot_pos, kind="stable") if slot_pos[s] >= 0]
                key_pos = slot_pos[cols]
            else:
                k, v = a["k"], a["v"]
                cols = list(range(scores.shape[-1]))
                key_pos = np.asarray(positions)
            out.append(LayerTrace(
                layer=layer, kind=seg.kind, q=a["q"], k=k, v=v, key_pos=np.asarray(key_pos),
                scores=scores[:, :, cols], mask=mask[:, cols], weights=weights[:, :, cols],
                masked_weight_max=float(masked.max())))
    return out


def _cache_checks(config: ModelConfig, layers: list[LayerTrace], before: dict, after: dict,
                  expected: dict, positions: Sequence[int]) -> None:
    """Attach cache contents to each LayerTrace and check them: the buffer
    equals the K/V written so far (bitwise, at their slots) and zeros elsewhere;
    the slots that changed are among the slots written in this phase."""
    for lt in layers:
        k_after, v_after, pos_after = _cache_view(config, after, lt.layer)
        k_before, v_before, _ = _cache_view(config, before, lt.layer)
        if lt.layer not in expected:
            expected[lt.layer] = (np.zeros_like(k_after), np.zeros_like(v_after))
        exp_k, exp_v = expected[lt.layer]
        written = []
        for i, p in enumerate(positions):
            slot = _slot_of(config, lt.layer, p, after)
            exp_k[slot], exp_v[slot] = lt.k[i], lt.v[i]
            written.append(slot)
        changed = np.flatnonzero((k_after != k_before).any(axis=(1, 2)) |
                                 (v_after != v_before).any(axis=(1, 2)))
        lt.cache_k, lt.cache_v, lt.cache_pos = k_after, v_after, pos_after
        lt.changed_slots = tuple(int(s) for s in changed)
        diff = max(float(np.abs(k_after - exp_k).max()), float(np.abs(v_after - exp_v).max()))
        length = int(after["lengths"][0])
        what = (f"cache holds the K/V written at positions < {length}, zeros beyond"
                if lt.kind == FULL_ATTENTION else
                "ring buffer holds the K/V of the last positions written, zeros in unused slots")
        lt.checks.append(Check(what, diff == 0.0, diff))
        lt.checks.append(Check("buffer slots changed by this call were all written by it",
                               set(lt.changed_slots) <= set(written)))
        lt.checks.append(Check("masked weights are exactly 0", lt.masked_weight_max == 0.0,
                               lt.masked_weight_max))


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max(initial=0.0))


def _close(what: str, a: np.ndarray, b: np.ndarray, tol: Tolerance) -> Check:
    diff = _max_abs(a, b)
    return Check(what, diff <= tol.bound(b), diff, str(tol))


def _recompute_checks(step: LayerTrace, full: LayerTrace, previous: LayerTrace,
                      tol: Tolerance) -> None:
    """Decode row vs the last row of the full [t, t] recompute, and the
    recompute's first t-1 rows vs the previous step's recompute."""
    t = full.scores.shape[-1]
    pos = step.key_pos
    row = np.zeros((step.weights.shape[0], t), np.float32)
    row[:, pos] = step.weights[:, 0, :]
    n = t - 1
    step.checks += [
        _close(f"decode scores row == last row of full [{t}, {t}] recompute",
               step.scores[:, 0, :], full.scores[:, -1, pos], tol),
        _close(f"decode weights row == last row of full [{t}, {t}] recompute",
               row, full.weights[:, -1, :], tol),
        _close(f"earlier score rows [{n}, {n}] unchanged vs previous step's recompute",
               full.scores[:, :n, :n], previous.scores[:, :n, :n], tol),
        _close(f"earlier weight rows [{n}, {n}] unchanged vs previous step's recompute",
               full.weights[:, :n, :n], previous.weights[:, :n, :n], tol)]
    step.recompute = full


def _prefill(config, params, ids: Sequence[int], max_seq_len: int):
    """engine.prefill with collect=True on a fresh cache: (logits [V], before, after, internals)."""
    cache = init_cache(config, 1, max_seq_len, jax.tree_util.tree_leaves(params)[0].dtype)
    before = _snapshot(cache)
    tokens = jnp.asarray([list(ids)], jnp.int32)
    lengths = jnp.array([len(ids)], jnp.int32)
    logits, cache, internals = engine.prefill(params, cache, tokens, lengths, config=config,
                                              collect=True)
    return np.asarray(logits[0], np.float32), before, cache, internals


def run_trace(config: ModelConfig, params: dict, prompt_ids: Sequence[int], steps: int,
              stop_ids: Sequence[int] = (), tolerance: Optional[Tolerance] = None) -> Trace:
    """Prefill `prompt_ids` and run up to `steps` greedy decode steps, collecting
    internals, cache contents and checks (see the module docstring).

    Args:
      config: ModelConfig; params: its params pytree (jax arrays).
      prompt_ids: the prompt, >= 1 ids in [0, V).
      steps: decode steps (>= 0); tracing stops early after a stop id is
        chosen (the stop id is not fed back).
      stop_ids: ids that end the generation (EOS).
      tolerance: for the recompute checks; default `Tolerance.for_model`.
    Returns:
      Trace with one Phase for prefill and one per decode step. The cache
      holds exactly len(prompt_ids) + steps positions.
    Raises:
      ValueError: empty prompt, negative steps, or more positions than the
        model's max_position_embeddings.
    """
    prompt_ids = [int(i) for i in prompt_ids]
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    tol = tolerance or Tolerance.for_model(config, dtype)
    if not prompt_ids or steps < 0:
        raise ValueError(f"need a non-empty prompt and steps >= 0, got {len(prompt_ids)} ids, "
                         f"steps {steps}")
    size = len(prompt_ids) + steps
    if size > config.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + steps ({steps}) exceeds the "
                         f"model's max_position_embeddings {config.max_position_embeddings}")
    embed = np.asarray(params["embed_tokens"], np.float32)
    expected: dict = {}
    positions = list(range(len(prompt_ids)))
    logits, before, cache, internals = _prefill(config, params, prompt_ids, size)
    after = _snapshot(cache)
    layers = _layer_traces(config, internals, after, positions, decode=False)
    _cache_checks(config, layers, before, after, expected, positions)
    chosen = int(np.argmax(logits))
    phases = [Phase(0, prompt_ids, positions, embed[prompt_ids], 0, int(after["lengths"][0]),
                    layers, logits, chosen)]
    previous = layers                     # the [T, T] matrices the next recompute extends
    seq, generated = list(prompt_ids), [chosen]
    for step in range(1, steps + 1):
        if chosen in stop_ids:
            break
        seq.append(chosen)
        pos = len(seq) - 1
        before = after
        logits, cache, internals = engine.decode_step(
            params, cache, jnp.array([chosen], jnp.int32), config=config, collect=True)
        after = _snapshot(cache)
        layers = _layer_traces(config, internals, after, [pos], decode=True)
        _cache_checks(config, layers, before, after, expected, [pos])
        full_logits, _, _, full_internals = _prefill(config, params, seq, len(seq))
        full = _layer_traces(config, full_internals, None, list(range(len(seq))), decode=False)
        for lt, ft, pt in zip(layers, full, previous):
            _recompute_checks(lt, ft, pt, tol)
        logits = np.asarray(logits[0], np.float32)
        logits_check = _close("decode logits == full recompute's last-position logits",
                              logits, full_logits, Tolerance(LOGITS_ATOL, tol.rtol))
        previous = full
        fed = seq[-1]
        chosen = int(np.argmax(logits))
        generated.append(chosen)
        phases.append(Phase(step, [fed], [pos], embed[[fed]], int(before["lengths"][0]),
                            int(after["lengths"][0]), layers, logits, chosen, full_logits,
                            [logits_check]))
    return Trace(config, prompt_ids, phases, generated, size, stopped=chosen in stop_ids)


# --- printing ------------------------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:9.4f}" if np.isfinite(x) else f"{'-inf' if x < 0 else 'inf':>9}"


def _vec(x: np.ndarray) -> str:
    return "[" + " ".join(_num(float(v)) for v in np.ravel(x)) + " ]"


def _matrix(rows: np.ndarray, row_pos: Sequence[int], col_pos: Sequence[int],
            indent: str, mask: bool = False) -> list[str]:
    """Rows labelled q<pos>, columns k<pos>; mask=True prints 0 / -inf."""
    cell = (lambda v: f"{'0' if v == 0 else '-inf':>9}") if mask else _num
    head = indent + " " * 6 + "".join(f"{'k' + str(p):>9}" for p in col_pos)
    lines = [head]
    for r, p in zip(rows, row_pos):
        lines.append(indent + f"{'q' + str(p):<6}" + "".join(cell(float(v)) for v in r))
    return lines


def _span(positions: Sequence[int]) -> str:
    positions = list(positions)
    if not positions:
        return "none"
    if positions == list(range(positions[0], positions[-1] + 1)) and len(positions) > 2:
        return f"{positions[0]}..{positions[-1]}"
    return ", ".join(map(str, positions))


class _Printer:
    """Formats a Trace; `label(id)` gives a token's text as a quoted repr."""

    def __init__(self, trace: Trace, label: Callable[[int], str], detail: bool):
        self.t, self.label, self.detail = trace, label, detail
        self.seq = list(trace.prompt_ids) + [p.token_ids[0] for p in trace.phases[1:]]
        self.lines: list[str] = []

    def out(self, line: str = "") -> None:
        self.lines.append(line)

    def pos_label(self, p: int) -> str:
        return f"{p} {self.label(self.seq[p])}"

    def header(self, title: str) -> None:
        c = self.t.config
        self.out(f"model: {title}")
        self.out(f"  {c.arch}, {c.num_layers} layers, hidden D={c.hidden_size}, N={c.num_heads} "
                 f"query head(s), K={c.num_kv_heads} kv head(s), head_dim H={c.head_dim}, "
                 f"vocab V={c.vocab_size}")
        ids = self.t.prompt_ids
        self.out(f"prompt: {' '.join(self.label(i) for i in ids)} -> ids {ids}")
        self.out(f"KV cache: 1 row x S={self.t.max_seq_len} positions per layer "
                 f"(prompt {len(ids)} + {self.t.max_seq_len - len(ids)} decode steps)")
        self.out(f"q is RoPE-rotated and scaled by 1/sqrt(H) = {c.query_scale:.4f}; k is "
                 "RoPE-rotated; scores = q.k; weights = softmax(scores + mask)")

    def phase(self, ph: Phase) -> None:
        t_new, d = len(ph.token_ids), self.t.config.hidden_size
        self.out()
        if ph.step == 0:
            self.out(f"=== PREFILL: {t_new} tokens in parallel at positions {_span(ph.positions)} "
                     f"(engine.prefill, collect=True) ===")
        else:
            self.out(f"=== DECODE step {ph.step}: feed {self.label(ph.token_ids[0])} "
                     f"(id {ph.token_ids[0]}) at position {ph.positions[0]} "
                     f"(engine.decode_step, collect=True) ===")
        self.out(f"input: tokens [1, {t_new}] -> embeddings x [1, {t_new}, {d}]")
        if self.detail:
            for p, e in zip(ph.positions, ph.embeddings):
                self.out(f"  x[{self.pos_label(p)}] = {_vec(e)}")
        for lt in ph.layers:
            (self._layer_detail if self.detail else self._layer_line)(ph, lt)
        self._logits(ph)
        self._checks(ph)

    def _layer_detail(self, ph: Phase, lt: LayerTrace) -> None:
        t_new, c = len(ph.token_ids), self.t.config
        self.out(f"--- layer {lt.layer} ({lt.kind}): input x [1, {t_new}, {c.hidden_size}]")
        for name, arr, heads in (("Q", lt.q, c.num_heads), ("K", lt.k, c.num_kv_heads),
                                 ("V", lt.v, c.num_kv_heads)):
            self.out(f"  {name} [1, {t_new}, {heads}, {c.head_dim}]  (B, T, "
                     f"{'N' if name == 'Q' else 'K'}, H)")
            for p, row in zip(ph.positions, arr):
                self.out(f"    {name.lower()}[{self.pos_label(p)}] = {_vec(row)}")
        rows, cols = ph.positions, list(lt.key_pos)
        kind = f"[{len(rows)}, {len(cols)}]"
        legend = ", ".join(self.pos_label(p) for p in cols)
        for h in range(lt.scores.shape[0]):
            head = f" head {h}" if lt.scores.shape[0] > 1 else ""
            what = "against the cached keys" if ph.step else "causal"
            self.out(f"  scores = q.k {kind}{head}, {what} (k<pos>: {legend})")
            self.lines += _matrix(lt.scores[h], rows, cols, "    ")
            if h == 0:
                hidden = self.t.max_seq_len - len(cols) if ph.step else 0
                note = "0 = visible, -inf = future" + (
                    f"; the {hidden} empty buffer slot(s) beyond are -inf too, not shown"
                    if hidden else "")
                self.out(f"  mask added {kind} ({note})")
                self.lines += _matrix(np.where(lt.mask, 0.0, -np.inf), rows, cols, "    ",
                                      mask=True)
            self.out(f"  weights = softmax(scores + mask) {kind}{head}")
            self.lines += _matrix(lt.weights[h], rows, cols, "    ")
        if lt.recompute is not None:
            full, n = lt.recompute, lt.recompute.weights.shape[-1]
            self.out(f"  full recompute: prefill of all {n} tokens on a fresh cache, weights "
                     f"[{n}, {n}] (last row = the decode row above)")
            self.lines += _matrix(full.weights[0], range(n), range(n), "    ")
        self._cache_detail(ph, lt)

    def _cache_detail(self, ph: Phase, lt: LayerTrace) -> None:
        verb = "append" if ph.step else "write"
        self.out(f"  cache {verb}: K/V at position(s) {_span(ph.positions)} (cache.lengths "
                 f"{ph.length_before} -> {ph.length_after}); buffer slots changed: "
                 f"{_span(lt.changed_slots)}")
        full = lt.kind == FULL_ATTENTION
        i = _stack_index(self.t.config, lt.layer)
        n = ph.length_after
        where = (f"k_full[{i}][0, :, :, :{n}] and v_full[{i}][0, :, :{n}]" if full
                 else f"ring k_window[{i}][0] and v_window[{i}][0]")
        self.out(f"  layer {lt.layer} cache now ({where}):")
        empty = [s for s, p in enumerate(lt.cache_pos) if p < 0]
        for s in np.argsort(np.where(lt.cache_pos < 0, 1 << 30, lt.cache_pos), kind="stable"):
            p = int(lt.cache_pos[s])
            if p >= 0:
                self.out(f"    pos {self.pos_label(p)}: K {_vec(lt.cache_k[s])}  V "
                         f"{_vec(lt.cache_v[s])}")
        if empty:
            zeros = not lt.cache_k[empty].any() and not lt.cache_v[empty].any()
            self.out(f"    slot(s) {_span(empty)}: empty ({'all zeros' if zeros else 'NOT ZERO'})")

    def _layer_line(self, ph: Phase, lt: LayerTrace) -> None:
        t_new = len(ph.token_ids)
        norm = lambda a: float(np.linalg.norm(a))
        last = lt.weights[:, -1, :].mean(axis=0)
        top = int(np.argmax(last))
        held = [int(p) for p in lt.cache_pos if p >= 0]
        self.out(f"  layer {lt.layer:2d} {'full' if lt.kind == FULL_ATTENTION else 'slide'}: "
                 f"q{list(lt.q.shape)} |q| {norm(lt.q):.3g}, k{list(lt.k.shape)} |k| "
                 f"{norm(lt.k):.3g}, |v| {norm(lt.v):.3g}; scores [{len(ph.positions)}, "
                 f"{len(lt.key_pos)}] x {lt.scores.shape[0]} heads, range "
                 f"[{lt.scores.min():.3g}, {lt.scores.max():.3g}]; last row attends most to pos "
                 f"{int(lt.key_pos[top])} ({last[top]:.2f}, head mean); cache holds "
                 f"{_span(sorted(held))} of {len(lt.cache_pos)} slots")

    def _logits(self, ph: Phase) -> None:
        p = ph.positions[-1]
        order = np.argsort(-ph.logits, kind="stable")
        shown = order if self.detail else order[:5]
        what = "all, by value" if self.detail else "top 5"
        self.out(f"logits at the last position ({self.pos_label(p)}) [{len(ph.logits)}], {what}:")
        self.out("  " + ", ".join(f"{self.label(int(i))} {ph.logits[i]:.3f}" for i in shown))
        self.out(f"  -> greedy next token: {self.label(ph.chosen)} (id {ph.chosen})")

    def _checks(self, ph: Phase) -> None:
        grouped: dict[str, list] = {}
        for lt in ph.layers:
            for c in lt.checks:
                grouped.setdefault(c.what, []).append((lt.layer, c))
        self.out("checks:")
        for what, items in grouped.items():
            layers = _span([layer for layer, _ in items])
            self.out(_check_line(what, [c for _, c in items], f"layers {layers}"))
        for c in ph.phase_checks:
            self.out(_check_line(c.what, [c], ""))


def _check_line(what: str, checks: Sequence[Check], where: str) -> str:
    ok = all(c.ok for c in checks)
    diffs = [c.max_diff for c in checks if c.max_diff is not None]
    notes = [where] if where else []
    if diffs:
        notes.append(f"max |diff| {max(diffs):.1e}")
    tolerances = sorted({c.tolerance for c in checks if c.tolerance})
    if tolerances:
        notes.append("allowed " + " / ".join(tolerances))
    note = f" ({'; '.join(notes)})" if notes else ""
    return f"  [{'OK' if ok else 'FAIL'}] {what}{note}"


def format_trace(trace: Trace, label: Callable[[int], str], title: str,
                 detail: Optional[bool] = None, text: Optional[Callable] = None) -> str:
    """The printed walkthrough. `detail` (default: hidden size <= DETAIL_MAX_HIDDEN)
    prints full vectors and matrices; otherwise one line per layer.
    `text(ids) -> str` decodes the continuation."""
    if detail is None:
        detail = trace.config.hidden_size <= DETAIL_MAX_HIDDEN
    pr = _Printer(trace, label, detail)
    pr.header(title)
    for ph in trace.phases:
        pr.phase(ph)
    pr.out()
    gen = trace.generated
    body = gen[:-1] if trace.stopped else gen
    shown = text(body) if text else " ".join(label(i) for i in body)
    end = f", then {label(gen[-1])} (stop)" if trace.stopped else ""
    pr.out(f"continuation: {shown!r}{end}   (generated ids {gen})")
    n_checks = sum(len(p.checks) for p in trace.phases)
    pr.out(f"all {n_checks} checks passed" if trace.ok else "SOME CHECKS FAILED (see [FAIL] above)")
    return "\n".join(pr.lines)


# --- plots -----------------------------------------------------------------------------------


def _pick_font(texts: Sequence[str]) -> Optional[str]:
    """A font family covering every character of `texts`, or None. Looks at
    matplotlib's font list, then at system fonts it has not cached yet."""
    from matplotlib import font_manager, ft2font

    needed = {ord(ch) for s in texts for ch in s if not ch.isascii()}
    if not needed:
        return None

    def covers(path: str) -> bool:
        try:
            return needed <= set(ft2font.FT2Font(path).get_charmap())
        except (OSError, RuntimeError, ValueError):
            return False

    for entry in font_manager.fontManager.ttflist:
        # "Last Resort" has a placeholder glyph for every code point: skip it.
        if "last resort" not in entry.name.lower() and covers(entry.fname):
            return entry.name
    known = {entry.fname for entry in font_manager.fontManager.ttflist}
    for path in font_manager.findSystemFonts():
        if path not in known and covers(path):
            font_manager.fontManager.addfont(path)
            return font_manager.FontProperties(fname=path).get_name()
    return None


def plot_trace(trace: Trace, out_dir: str | os.PathLike,
               token_text: Callable[[int], str]) -> list[pathlib.Path]:
    """Write PNGs: per phase, each layer's attention weights (masked cells grey
    and hatched); and the cache filling up (layer x position, colored by the
    step that wrote each slot). Returns the written paths.

    Tick labels use the token text when an installed font covers it, else "#id".
    """
    import matplotlib

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seq = list(trace.prompt_ids) + [p.token_ids[0] for p in trace.phases[1:]]
    texts = [token_text(i) for i in set(seq)]
    family = _pick_font(texts)
    covered = family is not None or all(s.isascii() for s in texts)
    label = lambda i: repr(token_text(i)) if covered else f"#{i}"  # no font for the text: ids
    style = {"font.family": ["DejaVu Sans"] + ([family] if family else [])}
    paths = []
    with matplotlib.rc_context(style):   # Figure + Agg canvas: no pyplot, no global backend
        for ph in trace.phases:
            paths.append(_plot_phase(trace, ph, seq, label, out))
        paths.append(_plot_cache(trace, seq, label, out))
    return paths


def _heatmap(ax, weights: np.ndarray, mask: np.ndarray, annotate: bool,
             faded_rows: int = 0) -> object:
    """weights [R, C] with masked cells drawn grey and hatched; the first
    `faded_rows` rows get dark annotations (they are drawn faded)."""
    shown = np.ma.masked_array(weights, ~mask)
    cmap = _weights_cmap()
    im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal")
    for r, c in zip(*np.nonzero(~mask)):
        ax.add_patch(_hatched_cell(c, r))
    if annotate:
        for r in range(weights.shape[0]):
            for c in range(weights.shape[1]):
                txt = f"{weights[r, c]:.2f}" if mask[r, c] else "-inf"
                dark_cell = mask[r, c] and weights[r, c] < 0.6 and r >= faded_rows
                color = "white" if dark_cell else "black"
                ax.text(c, r, txt, ha="center", va="center", fontsize=8, color=color)
    return im


def _weights_cmap():
    """viridis with masked cells grey."""
    import matplotlib

    return matplotlib.colormaps["viridis"].with_extremes(bad="#d0d0d0")


def _hatched_cell(c: int, r: int):
    from matplotlib.patches import Rectangle

    return Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#808080",
                     linewidth=0)


def _phase_grid(ph: Phase, lt: LayerTrace):
    """What one heatmap shows: (weights [R, C] head mean, mask [R, C], row
    positions, column positions, index of the decode row or None). A decode
    step shows its [1, t] row as the last row of the full [t, t] recompute."""
    if ph.step == 0:
        return lt.weights.mean(axis=0), lt.mask, list(ph.positions), list(lt.key_pos), None
    full = lt.recompute
    t = full.weights.shape[-1]
    weights, mask = full.weights.mean(axis=0).copy(), full.mask.copy()
    weights[-1] = 0.0
    weights[-1, lt.key_pos] = lt.weights.mean(axis=0)[0]
    mask[-1] = False
    mask[-1, lt.key_pos] = lt.mask[0]
    return weights, mask, list(range(t)), list(range(t)), t - 1


def _figure(rows: int, cols: int, figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def _plot_phase(trace: Trace, ph: Phase, seq, label, out: pathlib.Path) -> pathlib.Path:
    from matplotlib.patches import Rectangle

    n = len(ph.layers)
    cols = min(n, 6)
    rows = -(-n // cols)
    grids = [_phase_grid(ph, lt) for lt in ph.layers]
    size = max(len(g[3]) for g in grids)
    cell = 0.6 if size <= 8 else max(0.12, 4.8 / size)
    fig, axes = _figure(rows, cols, (cols * (cell * size + 1.4) + 1.2,
                                     rows * (cell * len(grids[0][2]) + 1.3) + 0.9))
    annotate, small = size <= 10 and n <= 12, size <= 16
    im = None
    for ax, lt, (weights, mask, row_pos, col_pos, decode_row) in zip(axes.flat, ph.layers, grids):
        im = _heatmap(ax, weights, mask, annotate, decode_row or 0)
        if decode_row is not None:
            ax.add_patch(Rectangle((-0.5, -0.5), len(col_pos), decode_row, color="white",
                                   alpha=0.6, linewidth=0))
            ax.add_patch(Rectangle((-0.5, decode_row - 0.5), len(col_pos), 1, fill=False,
                                   edgecolor="red", linewidth=2))
        heads = "" if lt.weights.shape[0] == 1 else f", mean of {lt.weights.shape[0]} heads"
        ax.set_title(f"layer {lt.layer}{heads}", fontsize=9)
        ax.set_xticks(range(len(col_pos)))
        ax.set_yticks(range(len(row_pos)))
        ax.set_xticklabels([f"{p}\n{label(seq[p])}" if small else str(p) for p in col_pos],
                           fontsize=7)
        ax.set_yticklabels([f"{label(seq[p])} {p}" if small else str(p) for p in row_pos],
                           fontsize=7)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if ph.step == 0:
        title = (f"prefill: attention weights [{len(ph.positions)}, {size}] per layer, all rows "
                 "computed in parallel\n(grey hatched = masked future: -inf added, "
                 "weight exactly 0)")
    else:
        title = (f"decode step {ph.step}: the new query's row [1, {len(ph.layers[0].key_pos)}] "
                 f"(red), computed against the cached keys\nfaded rows: the full [{size}, {size}] "
                 "recompute, for reference (the decode step does not compute them)")
    fig.suptitle(title, fontsize=9)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="weight")
    path = out / f"attention_{'prefill' if ph.step == 0 else f'decode_{ph.step}'}.png"
    fig.savefig(path, dpi=120)
    return path


def _plot_cache(trace: Trace, seq, label, out: pathlib.Path) -> pathlib.Path:
    """One panel per phase: layers x cache positions, colored by writing step."""
    from matplotlib.colors import ListedColormap

    n_layers, size = trace.config.num_layers, trace.max_seq_len
    phases = trace.phases
    colors = ListedColormap(_weights_cmap()(np.linspace(0.15, 0.9, max(len(phases), 2))))
    colors = colors.with_extremes(bad="#f0f0f0")
    writer = np.full((n_layers, size), -1)
    fig, axes = _figure(len(phases), 1, (max(4.0, min(0.7 * size, 14.0) + 2.5),
                                         (min(0.35 * n_layers, 6.0) + 1.0) * len(phases) + 0.6))
    annotate = size <= 16 and n_layers <= 8
    for ax, ph in zip(axes[:, 0], phases):
        for lt in ph.layers:
            for p in ph.positions:
                writer[lt.layer, p] = ph.step
        shown = np.ma.masked_array(writer, writer < 0)
        ax.imshow(shown, cmap=colors, vmin=-0.5, vmax=len(phases) - 0.5, aspect="auto")
        for r, c in zip(*np.nonzero(writer < 0)):
            ax.add_patch(_hatched_cell(c, r))
        if annotate:
            for r, c in zip(*np.nonzero(writer >= 0)):
                tag = "prefill" if writer[r, c] == 0 else f"step {writer[r, c]}"
                ax.text(c, r, f"{label(seq[c])}\n{tag}", ha="center", va="center", fontsize=7,
                        color="white" if writer[r, c] == 0 else "black")
        ax.set_yticks(range(n_layers))
        ax.set_yticklabels([f"layer {i}" for i in range(n_layers)], fontsize=7)
        ax.set_xticks(range(size))
        ax.set_xticklabels([f"{i}\n{label(seq[i])}" if i < ph.length_after and size <= 16
                            else str(i) for i in range(size)], fontsize=7)
        ax.set_title(f"after {ph.name}: cache.lengths = {ph.length_after} of {size}", fontsize=9)
    axes[-1, 0].set_xlabel("cache position (hatched = empty, zeros)", fontsize=8)
    fig.suptitle("KV cache filling up (color = the call that wrote the slot)", fontsize=10)
    path = out / "cache.png"
    fig.savefig(path, dpi=120)
    return path


# --- config and CLI ------------------------------------------------------------------------------


def load_trace_config(path: str | os.PathLike):
    """("toy", ToyConfig) for a YAML with `kind: toy`, else ("generation",
    GenerationConfig). Raises ValueError for unknown keys or an unknown kind."""
    from jaxinfer.config import GenerationConfig, read_yaml_mapping
    from jaxinfer.tools.toy import ToyConfig

    values = read_yaml_mapping(path)
    kind = values.get("kind")
    if kind == "toy":
        return "toy", ToyConfig.from_dict(values)
    if kind is not None:
        raise ValueError(f"{path}: unknown kind {kind!r} (only 'toy'; GenerationConfig YAMLs "
                         "have no kind)")
    return "generation", GenerationConfig.from_dict(values)


def load_for_trace(config_path: str | os.PathLike, model: Optional[str] = None,
                   log: Callable[[str], None] = print):
    """(ModelConfig, params, Tokenizer, title) for a toy or generation YAML;
    `model` overrides the YAML's model (a folder for toy configs)."""
    kind, cfg = load_trace_config(config_path)
    if kind == "toy":
        from jaxinfer.tools import toy

        folder = toy.ensure_model(cfg, model, log=log)
        config, params, tokenizer = toy.load_folder(folder)
        return config, params, tokenizer, str(folder)
    from jaxinfer.loading import load_model

    source = model or cfg.model
    config, params, tokenizer = load_model(source, dtype=jnp.dtype(cfg.dtype))
    return config, params, tokenizer, str(source)


def trace_main(config_path: str, prompt: str = "你好", steps: int = 2,
               plot: Optional[str] = None, model: Optional[str] = None,
               detail: Optional[bool] = None) -> int:
    """Load, trace, print (and plot). Returns 0 when every check passed, else 1."""
    config, params, tokenizer, title = load_for_trace(config_path, model)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    trace = run_trace(config, params, ids, steps, stop_ids=tuple(tokenizer.eos_token_ids))
    token_text = lambda i: tokenizer.decode([i], skip_special_tokens=False)
    label = lambda i: repr(token_text(i))
    print(format_trace(trace, label, title, detail, text=tokenizer.decode))
    if plot:
        for path in plot_trace(trace, plot, token_text):
            print(f"wrote {path}")
    return 0 if trace.ok else 1


def add_trace_parser(subparsers) -> None:
    """Register `jaxinfer trace` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "trace", help="print prefill and decode step by step (Q/K/V, scores, mask, cache)")
    p.add_argument("--config", required=True,
                   help="toy YAML (kind: toy) or a generation YAML for a real model")
    p.add_argument("--prompt", default="你好", help="raw prompt text (no chat template)")
    p.add_argument("--steps", type=int, default=2, help="greedy decode steps (default 2)")
    p.add_argument("--plot", metavar="DIR", help="also write PNG heatmaps and a cache diagram")
    p.add_argument("--model", help="override the config's model (folder, .gguf or name)")
    detail = p.add_mutually_exclusive_group()
    detail.add_argument("--full", dest="detail", action="store_true", default=None,
                        help="print full vectors and matrices (default for tiny models)")
    detail.add_argument("--brief", dest="detail", action="store_false",
                        help="one line per layer (default for real models)")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    return trace_main(args.config, args.prompt, args.steps, args.plot, args.model, args.detail)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jaxinfer.tools.trace --config ...`: the same as `jaxinfer trace`."""
    import argparse

    parser = argparse.ArgumentParser(prog="jaxinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_trace_parser(sub)
    parsed = parser.parse_args(["trace"] + list(sys.argv[1:] if argv is None else argv))
    return parsed.func(parsed)
