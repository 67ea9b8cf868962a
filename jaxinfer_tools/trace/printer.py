"""Print a `Trace`: per call and per layer the Q/K/V, scores, mask, weights,
the cache contents and the checks (full matrices for tiny models, one line
per layer for real ones)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from jaxinfer.testing import FULL_ATTENTION
from jaxinfer_tools.trace.tracer import DETAIL_MAX_HIDDEN, Check, LayerTrace, Phase, Trace


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
        self.seq = list(trace.prompt_ids) + [p.token_ids[0] for p in trace.phases if p.kind == "decode"]
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
        self.seq = self.t.tokens_at(ph)
        t_new, d = len(ph.token_ids), self.t.config.hidden_size
        self.out()
        if ph.kind == "prefill":
            self.out(f"=== PREFILL: {t_new} tokens in parallel at positions {_span(ph.positions)} "
                     f"({ph.engine_call}) ===")
        elif ph.kind == "verify":
            drafts = " ".join(self.label(d) for d in ph.verify.drafts)
            self.out(f"=== VERIFY step {ph.index}: feed {self.label(ph.token_ids[0])} and the drafts "
                     f"{drafts} at positions {_span(ph.positions)} in one call ({ph.engine_call}, "
                     "causal mask inside the block), then accept and roll back ===")
        elif ph.kind == "chunk":
            self.out(f"=== PREFILL CHUNK {ph.index}: {t_new} token(s) at position(s) "
                     f"{_span(ph.positions)}, after {ph.length_before} cached ({ph.engine_call}) ===")
        else:
            self.out(f"=== DECODE step {ph.index}: feed {self.label(ph.token_ids[0])} "
                     f"(id {ph.token_ids[0]}) at position {ph.positions[0]} ({ph.engine_call}) ===")
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
            what = {"prefill": "causal", "decode": "against the cached keys",
                    "chunk": "against the cached keys and, causally, the chunk's own",
                    "verify": "against the cached keys and, causally, the block's own: each draft "
                              "sees the drafts before it, never after"}[ph.kind]
            self.out(f"  scores = q.k {kind}{head}, {what} (k<pos>: {legend})")
            self.lines += _matrix(lt.scores[h], rows, cols, "    ")
            if h == 0:
                hidden = self.t.max_seq_len - len(cols) if ph.kind != "prefill" else 0
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
                     f"[{n}, {n}] (rows {_span(ph.positions)} = the rows above)")
            self.lines += _matrix(full.weights[0], range(n), range(n), "    ")
        self._cache_detail(ph, lt)

    def _cache_detail(self, ph: Phase, lt: LayerTrace) -> None:
        verb = "write" if ph.kind == "prefill" else "append"
        written = ph.verify.length_written if ph.verify else ph.length_after
        self.out(f"  cache {verb}: K/V at position(s) {_span(ph.positions)} (cache.lengths "
                 f"{ph.length_before} -> {written}); buffer slots changed: "
                 f"{_span(lt.changed_slots)}")
        slots = len(lt.cache_pos)
        where = f"cache.layers[{lt.layer}], positions 0..{written - 1} of {slots} slots"
        after = (f"; after the rollback positions >= {ph.length_after} are never read"
                 if ph.verify else "")
        self.out(f"  layer {lt.layer} cache after the write ({where}{after}):")
        empty = [s for s, p in enumerate(lt.cache_pos) if p < 0]
        for s in np.argsort(np.where(lt.cache_pos < 0, 1 << 30, lt.cache_pos), kind="stable"):
            p = int(lt.cache_pos[s])
            if p >= 0:
                self.out(f"    pos {self.pos_label(p)}: K {_vec(lt.cache_k[s])}  V "
                         f"{_vec(lt.cache_v[s])}")
        nonzero = [s for s in empty if lt.cache_k[s].any() or lt.cache_v[s].any()]
        zeros = [s for s in empty if s not in nonzero]
        if zeros:
            self.out(f"    slot(s) {_span(zeros)}: empty (all zeros)")
        if nonzero:
            rolled = any(p.verify is not None for p in self.t.phases if p.step_order <= ph.step_order)
            state = ("past the length: stale K/V of rejected drafts, never read" if rolled
                     else "NOT ZERO")
            self.out(f"    slot(s) {_span(nonzero)}: empty ({state})")

    def _layer_line(self, ph: Phase, lt: LayerTrace) -> None:
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
        p = ph.positions[ph.verify.accepted if ph.verify else -1]
        order = np.argsort(-ph.logits, kind="stable")
        shown = order if self.detail else order[:5]
        what = "all, by value" if self.detail else "top 5"
        where = "after the last accepted position" if ph.verify else "at the last position"
        self.out(f"logits {where} ({self.pos_label(p)}) [{len(ph.logits)}], {what}:")
        self.out("  " + ", ".join(f"{self.label(int(i))} {ph.logits[i]:.3f}" for i in shown))
        if ph.chosen is None:
            self.out("  (a chunk before the prompt's end: its prediction is not used)")
        elif ph.verify is not None:
            self._acceptance(ph)
        else:
            self.out(f"  -> greedy next token: {self.label(ph.chosen)} (id {ph.chosen})")

    def _acceptance(self, ph: Phase) -> None:
        v = ph.verify
        for i, (d, t) in enumerate(zip(v.drafts, v.targets)):
            if i > v.accepted:
                break
            verdict = "accepted" if i < v.accepted else "rejected"
            self.out(f"  draft {i + 1} {self.label(d)} vs the target's argmax after position "
                     f"{ph.positions[i]}: {self.label(t)} -> {verdict}")
        if v.accepted == len(v.drafts):
            self.out(f"  all {len(v.drafts)} drafts accepted; bonus token {self.label(v.targets[-1])}")
        self.out(f"  emitted: {' '.join(self.label(t) for t in v.emitted)}; cache.lengths "
                 f"{v.length_written} -> rolled back to {v.length_kept} (the last token and the "
                 f"accepted drafts; the rejected positions stay in the buffers, never read)")

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


