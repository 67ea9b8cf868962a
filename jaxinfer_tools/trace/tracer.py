"""Run the engine phase by phase and record every number, with checks.

The tracer drives the model through `engine.run_layers` with an attention of
its own (`RecordingAttention`): dense masked attention over [the keys the
cache holds | the call's own keys], written plainly, that records per layer
the Q/K/V, the raw scores, the mask and the softmax weights. Next to every
traced call the engine's compiled phase (`prefill`, `extend` or
`decode_step`) runs on the same cache, and the trace checks that the two
agree: the same logits, the same K/V in the engine's cache. So the printed
numbers are the ones the engine computes, and the engine never carries a
tracing mode.

Checks per call: the engine's cache holds the K/V written so far (zeros in
unused slots), only written slots changed, masked weights are exactly 0;
the rows of a chunk or a decode step equal the matching rows of a full
recompute (the whole sequence on a fresh cache), whose earlier rows equal
the previous recompute's; the traced logits equal the engine's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ModelConfig, init_cache
from jaxinfer.testing import (LayerKV, attention_output, attention_scores,
                              group_heads, kv_cache, masked_softmax, models, paged,
                              phases as engine, prepare_params, ungroup_heads)

ATOL = 1e-6                 # traced rows vs full recompute, scores and weights
ULPS_RTOL = 4 * float(np.finfo(np.float32).eps)   # 4 float32 ulps of the block's largest value
LOGITS_ATOL = 1e-4          # logits through every layer (float32)
DETAIL_MAX_HIDDEN = 16      # models this small print full matrices and vectors
ENGINE_CALLS = {"prefill": "engine.prefill", "chunk": "engine.extend", "decode": "engine.decode_step",
                "verify": "engine.extend"}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """|a - b| <= atol + rtol * max|b| over a compared block.

    `for_model` picks atol 1e-6 and rtol of 4 float32 ulps (4.8e-7) for
    tiny float32 models (the toy: calls of different lengths sum their dot
    products in another order, which moves a score of magnitude ~10 by an
    ulp, 9.5e-7); rtol 1e-5 for larger float32 models, where the
    difference grows through the layers; rtol 2e-2 for 16-bit params.
    """

    atol: float = ATOL
    rtol: float = 0.0

    @classmethod
    def for_model(cls, config: ModelConfig, dtype) -> "Tolerance":
        if jnp.dtype(dtype) != jnp.float32:
            return cls(ATOL, 2e-2)
        return cls(ATOL, ULPS_RTOL if config.hidden_size <= DETAIL_MAX_HIDDEN else 1e-5)

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
    """One layer in one call, batch row 0, float32 numpy.

    Attributes:
      layer: layer index; kind: FULL_ATTENTION or SLIDING_ATTENTION.
      q: [T, N, H] new queries (RoPE applied, scaled by `config.query_scale`).
      k, v: [T, K, H] new keys (RoPE applied) and values.
      key_pos: [S'] positions of the key columns below, ascending: the keys
        the cache held and then the call's own.
      scores: [N, T, S'] raw q.k (before the mask); mask: bool [T, S'] (True =
        visible); weights: [N, T, S'] softmax(scores + where(mask, 0, -inf)).
      masked_weight_max: largest |weight| over every masked entry (must be 0).
      cache_k, cache_v: [slots, K, H] the engine's buffer after the call;
      cache_pos: [slots] position held by each slot, -1 when empty.
      changed_slots: slots whose K or V changed in this call.
      checks: this layer's checks.
      recompute: the same layer of the full recompute (not for a whole prefill).
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
    """One engine call: a whole prefill, a prefill chunk, a decode step, or
    a speculative verification step.

    Attributes:
      kind: "prefill", "chunk", "decode" or "verify"; index: 0 for a prefill,
        the chunk number (1, 2, ...) or the decode / verify step (1, 2, ...).
      token_ids / positions: the tokens fed in this call and their positions.
      embeddings: [T, D] their embedding rows (the input x of layer 0).
      length_before / length_after: cache.lengths[0] around the call.
      layers: one LayerTrace per layer.
      logits: float32 [V] at the last fed position; chosen: the greedy id
        (None for a chunk that is not the prompt's last).
      engine_logits: the compiled phase's logits for the same call.
      phase_checks: checks about the whole call.
      verify: for a verification step, a `Verification`.
    """

    kind: str
    index: int
    token_ids: list[int]
    positions: list[int]
    embeddings: np.ndarray
    length_before: int
    length_after: int
    layers: list[LayerTrace]
    logits: np.ndarray
    chosen: Optional[int]
    engine_logits: Optional[np.ndarray] = None
    phase_checks: list[Check] = dataclasses.field(default_factory=list)
    verify: Optional["Verification"] = None

    @property
    def name(self) -> str:
        return {"prefill": "prefill", "chunk": f"prefill chunk {self.index}",
                "decode": f"decode step {self.index}",
                "verify": f"verification step {self.index}"}[self.kind]

    @property
    def engine_call(self) -> str:
        return ENGINE_CALLS[self.kind]

    @property
    def step_order(self) -> tuple[int, int]:
        """Order of the call in a trace: prefill and chunks, verify, then decode steps."""
        return ({"prefill": 0, "chunk": 0, "verify": 1, "decode": 2}[self.kind], self.index)

    @property
    def checks(self) -> list[Check]:
        return [c for layer in self.layers for c in layer.checks] + self.phase_checks


@dataclasses.dataclass
class Verification:
    """What a greedy verification step decided.

    Attributes:
      drafts: the k proposed ids (fed after the last token).
      targets: the target's argmax after each fed position, [k + 1] ids.
      accepted: drafts accepted (the longest prefix equal to the targets).
      emitted: the accepted drafts plus the target's next token.
      length_written / length_kept: cache.lengths after the block was
        written and after the rollback (`cache.truncate`).
    """

    drafts: list[int]
    targets: list[int]
    accepted: int
    emitted: list[int]
    length_written: int
    length_kept: int


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

    def tokens_at(self, phase: Phase) -> list[int]:
        """The token at each position as of `phase` (its own fed tokens
        included; a rejected draft's position shows the draft there and the
        later token after it was overwritten)."""
        seq = list(self.prompt_ids)
        for ph in self.phases:
            for pos, tok in zip(ph.positions, ph.token_ids):   # positions are consecutive
                if pos < len(seq):
                    seq[pos] = tok
                else:
                    seq.append(tok)
            if ph is phase:
                break
        return seq


# --- the recording attention ----------------------------------------------------------------


class RecordingAttention:
    """An `engine.Attend`: dense masked attention over [the cache's keys |
    the call's own keys] (before the call writes), then the write; records
    each layer's numbers (batch row 0) in `self.layers`."""

    def __init__(self, config: ModelConfig, cache, positions: jax.Array, valid: jax.Array):
        self.config, self.cache, self.positions, self.valid = config, cache, positions, valid
        self.layers: list[LayerTrace] = []

    def __call__(self, kind, q, k, v, kv: LayerKV):
        cache, positions = self.cache, self.positions
        key_pos = jnp.concatenate([kv_cache.key_positions(cache, kind),
                                   jnp.where(self.valid, positions, -1)], axis=1)
        cached_k, cached_v = paged.gather_rows(kv, kv_cache.block_tables(cache))   # the rows, float32
        keys = jnp.concatenate([cached_k.astype(k.dtype), k.transpose(0, 2, 3, 1)], axis=-1)  # [B, K, H, S + T]
        values = jnp.concatenate([cached_v.astype(v.dtype), v.transpose(0, 2, 1, 3)], axis=2)  # [B, K, S + T, H]
        mask = kv_cache.visible(key_pos, positions, kind, cache.window)          # [B, T, S + T]
        qg = group_heads(q, k.shape[2])
        scores = attention_scores(qg, keys, self.config.attn_logit_softcapping)  # [B, K, T, G, S + T]
        weights = masked_softmax(scores, mask[:, None, :, None, :])
        out = ungroup_heads(attention_output(weights, values))
        self._record(kind, q, k, v, key_pos, scores, mask, weights)
        return out, kv_cache.write(cache, kind, kv, k, v, positions, self.valid)

    def _record(self, kind, q, k, v, key_pos, scores, mask, weights) -> None:
        row0 = lambda a: np.asarray(a[0], np.float32)
        pos = np.asarray(key_pos[0])
        cols = [c for c in np.argsort(pos, kind="stable") if pos[c] >= 0]
        t, width = q.shape[1], scores.shape[-1]
        # [K, T, G, S + T] -> [N, T, S + T], query head n = kv head * G + g
        by_head = lambda a: row0(a).transpose(0, 2, 1, 3).reshape(-1, t, width)
        s, w, m = by_head(scores), by_head(weights), np.asarray(mask[0])
        masked = np.abs(w[:, ~m]) if (~m).any() else np.zeros(1)
        self.layers.append(LayerTrace(
            layer=len(self.layers), kind=kind, q=row0(q), k=row0(k), v=row0(v), key_pos=pos[cols],
            scores=s[:, :, cols], mask=m[:, cols], weights=w[:, :, cols],
            masked_weight_max=float(masked.max())))


def _traced_call(config: ModelConfig, params: dict, cache, ids: Sequence[int]):
    """Run `ids` after the cache's contents through the tracer's attention.
    Returns (logits [T, V] float32 at every fed position, LayerTraces)."""
    tokens = jnp.asarray([list(ids)], jnp.int32)
    positions, valid = kv_cache.new_positions(cache, jnp.array([len(ids)], jnp.int32), len(ids))
    attend = RecordingAttention(config, cache, positions, valid)
    x, _ = engine.run_layers(params, cache.layers, tokens, config, positions, attend)
    logits = models.family(config.arch).unembed(params, x, config)
    return np.asarray(logits[0], np.float32), attend.layers


def _engine_call(kind: str, config: ModelConfig, params: dict, cache, ids: Sequence[int]):
    """The compiled phase for the same call. Returns (logits [T, V] at every
    fed position (the last one only, [1, V], for prefill and decode), cache)."""
    tokens = jnp.asarray([list(ids)], jnp.int32)
    n = jnp.array([len(ids)], jnp.int32)
    if kind == "prefill":
        logits, cache = engine.prefill(params, cache, tokens, n, config=config)
    elif kind in ("chunk", "verify"):
        logits, cache = engine.extend(params, cache, tokens, n, config=config, all_logits=True)
    else:
        logits, cache = engine.decode_step(params, cache, tokens[:, 0], config=config)
    return np.asarray(logits, np.float32).reshape(-1, logits.shape[-1]), cache


# --- checks -----------------------------------------------------------------------------------


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max(initial=0.0))


def _close(what: str, a: np.ndarray, b: np.ndarray, tol: Tolerance) -> Check:
    diff = _max_abs(a, b)
    return Check(what, diff <= tol.bound(b), diff, str(tol))


def _cache_checks(layers: list[LayerTrace], before, after, expected: dict,
                  positions: Sequence[int], tol: Tolerance) -> None:
    """Attach the engine's cache contents to each LayerTrace and check them:
    the buffer holds the K/V written so far at their slots (the traced K/V,
    within `tol`) and zeros elsewhere; only slots written by this call changed."""
    for lt in layers:
        k_after, v_after, pos_after = (a[0] for a in kv_cache.read_layer(after, lt.layer))
        k_before, v_before, _ = (a[0] for a in kv_cache.read_layer(before, lt.layer))
        if lt.layer not in expected:
            expected[lt.layer] = (np.zeros_like(k_after), np.zeros_like(v_after))
        exp_k, exp_v = expected[lt.layer]
        written = [kv_cache.write_index(after, lt.layer, p) for p in positions]
        for i, slot in enumerate(written):
            exp_k[slot], exp_v[slot] = lt.k[i], lt.v[i]
        changed = np.flatnonzero((k_after != k_before).any(axis=(1, 2)) |
                                 (v_after != v_before).any(axis=(1, 2)))
        lt.cache_k, lt.cache_v, lt.cache_pos = k_after, v_after, pos_after
        lt.changed_slots = tuple(int(s) for s in changed)
        diff = max(_max_abs(k_after, exp_k), _max_abs(v_after, exp_v))
        unused = ~(exp_k.any(axis=(1, 2)) | exp_v.any(axis=(1, 2)))
        zeros = not k_after[unused].any() and not v_after[unused].any()
        length = int(np.asarray(after.lengths)[0])
        what = f"engine cache holds the traced K/V at positions < {length}, zeros beyond"
        bound = tol.bound(np.concatenate([exp_k.ravel(), exp_v.ravel()]))
        lt.checks.append(Check(what, diff <= bound and zeros, diff, str(tol)))
        lt.checks.append(Check("buffer slots changed by this call were all written by it",
                               set(lt.changed_slots) <= set(written)))
        lt.checks.append(Check("masked weights are exactly 0", lt.masked_weight_max == 0.0,
                               lt.masked_weight_max))


def _recompute_checks(step: LayerTrace, full: LayerTrace, previous: Optional[LayerTrace],
                      rows: Sequence[int], tol: Tolerance) -> None:
    """A call's rows vs the same rows of the full [t, t] recompute, and the
    recompute's rows before the call vs the previous recompute."""
    t = full.scores.shape[-1]
    pos = step.key_pos
    weights = np.zeros((step.weights.shape[0], len(rows), t), np.float32)
    weights[:, :, pos] = step.weights
    what = f"rows {rows[0]}..{rows[-1]}" if len(rows) > 1 else "row"
    step.checks += [
        _close(f"{what} of the scores == the same rows of a full [{t}, {t}] recompute",
               step.scores, full.scores[:, rows][:, :, pos], tol),
        _close(f"{what} of the weights == the same rows of a full [{t}, {t}] recompute",
               weights, full.weights[:, rows], tol)]
    if previous is not None:
        n = previous.scores.shape[-1]
        step.checks += [
            _close(f"earlier score rows [{n}, {n}] unchanged vs previous recompute",
                   full.scores[:, :n, :n], previous.scores, tol),
            _close(f"earlier weight rows [{n}, {n}] unchanged vs previous recompute",
                   full.weights[:, :n, :n], previous.weights, tol)]
    step.recompute = full


# --- the walk ---------------------------------------------------------------------------------


def _copy(cache):
    return jax.tree_util.tree_map(jnp.copy, cache)


class _Walk:
    """The state of one trace: the engine's cache, expected contents, checks."""

    def __init__(self, config, params, size, tol, embed):
        self.config, self.params, self.size, self.tol, self.embed = config, params, size, tol, embed
        dtype = jax.tree_util.tree_leaves(params)[0].dtype
        self.cache = init_cache(config, 1, size, dtype, page_size=size)   # one page a row
        self.expected: dict = {}
        self.previous: Optional[list[LayerTrace]] = None

    def call(self, kind: str, index: int, ids: list[int], seq: list[int]) -> Phase:
        """Trace one call of `ids` (the last tokens of `seq`, the sequence so far)."""
        before = _copy(self.cache)
        start = int(np.asarray(before.lengths)[0])
        positions = list(range(start, start + len(ids)))
        logits, layers = _traced_call(self.config, self.params, before, ids)
        engine_logits, self.cache = _engine_call(kind, self.config, self.params, self.cache, ids)
        _cache_checks(layers, before, self.cache, self.expected, positions, self.tol)
        logits = logits if len(engine_logits) == len(logits) else logits[-1:]
        checks = [_close(f"traced logits == {ENGINE_CALLS[kind]} logits", logits, engine_logits,
                         Tolerance(LOGITS_ATOL, self.tol.rtol))]
        if kind != "prefill":
            _, full = _traced_call(self.config, self.params, init_cache(
                self.config, 1, self.size, before.dtype, page_size=self.size), seq)
            for lt, ft, pt in zip(layers, full, self.previous or [None] * len(layers)):
                _recompute_checks(lt, ft, pt, positions, self.tol)
            self.previous = full
        else:
            self.previous = layers
        phase = Phase(kind, index, list(ids), positions, self.embed[ids], start,
                      int(np.asarray(self.cache.lengths)[0]), layers, logits[-1],
                      int(np.argmax(logits[-1])), engine_logits[-1], checks)
        if kind == "verify":
            self._accept(phase, logits)
        return phase

    def _accept(self, phase: Phase, logits: np.ndarray) -> None:
        """Greedy acceptance of a verification block and the cache rollback."""
        drafts = phase.token_ids[1:]
        targets = [int(t) for t in np.argmax(logits, axis=-1)]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), len(drafts))
        written = int(np.asarray(self.cache.lengths)[0])
        self.cache = kv_cache.truncate(self.cache, jnp.array([phase.length_before + 1 + accepted]))
        kept = int(np.asarray(self.cache.lengths)[0])
        phase.verify = Verification(drafts, targets, accepted, drafts[:accepted] + [targets[accepted]],
                                    written, kept)
        phase.length_after, phase.chosen = kept, targets[accepted]
        phase.logits = logits[accepted]
        phase.phase_checks.append(Check(
            f"cache rolled back to the last token + {accepted} accepted draft(s): cache.lengths "
            f"{written} -> {kept}", kept == phase.length_before + 1 + accepted))


def run_trace(config: ModelConfig, params: dict, prompt_ids: Sequence[int], steps: int,
              stop_ids: Sequence[int] = (), tolerance: Optional[Tolerance] = None,
              prefill_chunk: Optional[int] = None, drafts: Sequence[int] = ()) -> Trace:
    """Prefill `prompt_ids` (whole, or in chunks of `prefill_chunk` tokens
    through `engine.extend`) and run up to `steps` greedy decode steps,
    recording internals, cache contents and checks (see the module docstring).

    Args:
      config: ModelConfig; params: its params pytree (jax arrays).
      prompt_ids: the prompt, >= 1 ids in [0, V).
      steps: decode steps (>= 0); tracing stops early after a stop id is
        chosen (the stop id is not fed back).
      stop_ids: ids that end the generation (EOS).
      tolerance: for the comparisons; default `Tolerance.for_model`.
      prefill_chunk: None for one prefill, else the chunk size (>= 1).
      drafts: ids to verify after the prefill in one speculative
        verification step ([first token, drafts] through `engine.extend`,
        greedy acceptance, rollback), before the decode steps.
    Returns:
      Trace with one Phase per engine call. The cache holds
      len(prompt_ids) + 1 + len(drafts) + steps positions.
    Raises:
      ValueError: empty prompt, negative steps, a chunk size < 1, or more
        positions than the model's max_position_embeddings.
    """
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids or steps < 0 or (prefill_chunk is not None and prefill_chunk < 1):
        raise ValueError(f"need a non-empty prompt, steps >= 0 and a chunk size >= 1, got "
                         f"{len(prompt_ids)} ids, steps {steps}, chunk {prefill_chunk}")
    drafts = [int(d) for d in drafts]
    size = len(prompt_ids) + steps + (1 + len(drafts) if drafts else 0)
    if size > config.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + steps ({steps}) exceeds the "
                         f"model's max_position_embeddings {config.max_position_embeddings}")
    embed = np.asarray(params["embed_tokens"], np.float32)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    walk = _Walk(config, prepare_params(params, config, pack=False), size,
                 tolerance or Tolerance.for_model(config, dtype), embed)
    if prefill_chunk is None:
        phases = [walk.call("prefill", 0, prompt_ids, prompt_ids)]
    else:
        phases = [walk.call("chunk", i // prefill_chunk + 1, prompt_ids[i:i + prefill_chunk],
                            prompt_ids[:i + prefill_chunk])
                  for i in range(0, len(prompt_ids), prefill_chunk)]
    chosen, seq, generated = phases[-1].chosen, list(prompt_ids), [phases[-1].chosen]
    if drafts and chosen not in stop_ids:
        phases.append(walk.call("verify", 1, [chosen] + drafts, seq + [chosen] + drafts))
        v = phases[-1].verify
        seq += [chosen] + v.emitted[:-1]
        chosen = v.emitted[-1]
        generated += v.emitted
        walk.previous = None   # the recompute of the next call no longer extends this block
    for step in range(1, steps + 1):
        if chosen in stop_ids:
            break
        seq.append(chosen)
        phases.append(walk.call("decode", step, [chosen], seq))
        chosen = phases[-1].chosen
        generated.append(chosen)
    for ph in phases[:-1]:
        if ph.kind == "chunk" and ph.positions[-1] + 1 < len(prompt_ids):
            ph.chosen = None  # a middle chunk predicts nothing that is used
    return Trace(config, prompt_ids, phases, generated, size, stopped=chosen in stop_ids)
