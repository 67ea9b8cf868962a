"""Ragged paged attention (the C++ kernel and the pure-JAX version) against a
float64 numpy reference, its bitwise invariance to how a prompt is split into
steps, and its input checks.

Tolerance: atol 2e-6 on outputs of magnitude ~1 for scores of size ~1, as in
tests/kernels/test_cpu_kernels.py (float32 sums in another order; the kernel's
polynomial exp has a relative error of about 1e-7).

Pools are filled with NaN wherever no query may look (pages no slot uses,
positions past a segment's last query, pages before a window), so a read of
an invisible position shows up as NaN in the output.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels.ragged import ragged_paged_attention, ragged_paged_attention_xla

ATOL = 2e-6

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")

HEADS = [(3, 3, 64),   # SmolLM2-135M: K, G, H
         (1, 4, 256),  # Gemma 3 270M
         (2, 5, 40),   # G = 5 (a row block of 6 splits a token's heads), odd head_dim tail
         (2, 2, 8)]    # tests/tiny.py's Llama: head_dim one AVX2 vector
HEAD_IDS = ["smollm2", "gemma3", "g5h40", "tiny"]


def reference_ragged(q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len, seg_pos,
                     window, softcap=None):
    """Float64 ragged paged attention, one query token at a time: token
    seg_start[r] + i at position p = seg_pos[r] + i sees slot seg_slot[r]'s
    positions [max(0, p - window + 1), p] (window None: [0, p]); tokens no
    segment covers are zeros. With `softcap`, scores s become
    softcap * tanh(s / softcap) before the softmax. q [T, K, G, H] -> [T, K, G, H]."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    ps = k_pages.shape[-1]
    out = np.zeros_like(q)
    for r in range(len(seg_len)):
        for i in range(seg_len[r]):
            t, p = seg_start[r] + i, seg_pos[r] + i
            positions = np.arange(0 if window is None else max(0, p - window + 1), p + 1)
            pages = np.asarray(block_tables)[seg_slot[r], positions // ps]
            keys = k_pages[pages, :, :, positions % ps]            # [n, K, H]
            values = v_pages[pages, :, positions % ps, :]          # [n, K, H]
            scores = np.einsum("kgh,nkh->kgn", q[t], keys)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[t] = np.einsum("kgn,nkh->kgh", weights, values)
    return out


class Pool:
    """A paged K/V pool of one layer in numpy, NaN where nothing was written,
    with block tables whose pages are handed out in a scrambled order."""

    def __init__(self, kv_heads, h, ps, num_slots, pages_per_slot, seed=0):
        self.rng = np.random.default_rng(seed)
        self.ps, self.m = ps, pages_per_slot
        num_pages = num_slots * pages_per_slot + 3                 # 3 pages nobody uses
        self.k = np.full((num_pages, kv_heads, h, ps), np.nan, np.float32)
        self.v = np.full((num_pages, kv_heads, ps, h), np.nan, np.float32)
        order = self.rng.permutation(num_pages)[:num_slots * pages_per_slot]
        self.tables = order.reshape(num_slots, pages_per_slot).astype(np.int32)

    def write(self, slot, pos, k, v):
        """Store k [n, K, H] and v [n, K, H] at positions pos .. pos + n - 1 of slot."""
        positions = pos + np.arange(len(k))
        pages = self.tables[slot, positions // self.ps]
        self.k[pages, :, :, positions % self.ps] = k
        self.v[pages, :, positions % self.ps, :] = v

    def fill(self, slot, end):
        """Random K/V at positions [0, end) of slot."""
        kv_heads, h = self.k.shape[1], self.k.shape[2]
        k, v = (self.rng.standard_normal((2, end, kv_heads, h))).astype(np.float32)
        self.write(slot, 0, k, v)

    def forget_before(self, slot, pos, window):
        """Mark the slot's pages wholly before the window of a query at pos as
        evicted (-1), as a sliding-window cache may: nobody may read them."""
        if window is not None:
            first = max(0, pos - window + 1) // self.ps
            self.tables[slot, :first] = -1


def _step(segments, t, heads, ps, window, seed=0, extra_pages=1, q_scale=1.0):
    """A step of `segments` [(slot, start, len, pos)] over T = t tokens, each
    slot holding keys up to its segment's last position, plus two unused
    segments with garbage fields; queries ~N(0, q_scale^2 / H). Returns
    (args tuple, window)."""
    kv_heads, g, h = heads
    needed = max(pos + n for _, _, n, pos in segments)
    pool = Pool(kv_heads, h, ps, len(segments), -(-needed // ps) + extra_pages, seed)
    for slot, _, n, pos in segments:
        pool.fill(slot, pos + n)
        pool.forget_before(slot, pos, window)
    rng = np.random.default_rng(seed + 1)
    q = (rng.standard_normal((t, kv_heads, g, h)) * q_scale / np.sqrt(h)).astype(np.float32)
    garbage = [(-7, 999, 0, -3), (12345, -1, 0, 5)]
    slot, start, n, pos = (np.array(c, np.int32) for c in zip(*(segments + garbage)))
    return (q, pool.k, pool.v, pool.tables, slot, start, n, pos), window


def _check_against_reference(args, window, atol=ATOL):
    want = reference_ragged(*args, window)
    covered = np.zeros(args[0].shape[0], bool)
    for start, n in zip(args[5], args[6]):
        if n > 0:
            covered[start:start + n] = True
    for fn in (ragged_paged_attention, ragged_paged_attention_xla):
        got = np.asarray(jax.jit(lambda *a: fn(*a, window=window))(*args))
        assert got.shape == args[0].shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=fn.__name__)
        assert np.all(got[~covered] == 0.0)


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("ps", [16, 32])
@pytest.mark.parametrize("window", [None, 16, 100])
def test_decode_only_step_matches_reference(heads, ps, window):
    """8 one-token segments at positions around page and key-block edges."""
    positions = [0, 1, 15, 16, 63, 64, 130, 511]
    segments = [(r, r, 1, pos) for r, pos in enumerate(positions)]
    _check_against_reference(*_step(segments, 8, heads, ps, window))


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("ps", [8, 16, 32])   # 8: with AVX-512 the kernel gathers keys
@pytest.mark.parametrize("window", [None, 16, 100])
def test_mixed_step_matches_reference(heads, ps, window):
    """8 decode segments, a 37-token prompt chunk at position 50 and a whole
    100-token prompt at 0, with uncovered tokens between and after them
    (exact zeros) and two unused segments."""
    decodes = [(r, r, 1, pos) for r, pos in enumerate([3, 17, 31, 64, 90, 127, 200, 255])]
    segments = decodes + [(8, 10, 37, 50), (9, 50, 100, 0)]        # tokens 8, 9, 47..49 uncovered
    _check_against_reference(*_step(segments, 160, heads, ps, window))


def _split_runs(heads, window, splits, k_all, v_all, q_all, ps=16, quantize=None):
    """Run a 70-token prompt (slot 1) as steps of the given segment lengths,
    each step writing its own K/V first; slot 0 decodes beside it in every
    other step (one token at its next position) so units mix. `quantize`:
    (k, v, seed=step) -> (k codes, v codes, key scales, value scales), the
    int8 pool each step reads (None: the float pool). Returns the prompt's
    outputs [70, K, G, H]."""
    kv_heads, g, h = heads
    pool = Pool(kv_heads, h, ps, 2, 128 // ps, seed=5)                # 128 positions a slot
    pool.fill(0, 40)
    rng = np.random.default_rng(9)
    run = jax.jit(lambda *a: ragged_paged_attention(*a, window=window))
    outs, done = [], 0
    for step, n in enumerate(splits):
        pool.write(1, done, k_all[done:done + n], v_all[done:done + n])
        segments = [(1, 0, n, done)]
        q = q_all[done:done + n]
        if step % 2:                                                 # a decode of slot 0 first
            pos = 40 + step
            pool.write(0, pos, *rng.standard_normal((2, 1, kv_heads, h)).astype(np.float32))
            segments = [(0, 0, 1, pos), (1, 1, n, done)]
            q = np.concatenate([rng.standard_normal((1, kv_heads, g, h)).astype(np.float32), q])
        t = 8 * -(-len(q) // 8)                                      # padded to a bucket of 8
        q = np.concatenate([q, np.zeros((t - len(q), kv_heads, g, h), np.float32)])
        slot, start, length, pos = (np.array(c, np.int32) for c in zip(*segments))
        k, v, *scales = (pool.k, pool.v) if quantize is None else quantize(pool.k, pool.v, seed=step)
        out = np.asarray(run(q, k, v, pool.tables, slot, start, length, pos, *scales))
        outs.append(out[start[-1]:start[-1] + n])
        done += n
    return np.concatenate(outs)


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("window", [None, 16])
def test_prompt_whole_chunked_or_token_by_token_gives_identical_bits(heads, window):
    """A 70-token prompt as one segment, as chunks 16 + 16 + 38, and as 70
    one-token steps: every query's output has the same bits, whatever the
    step's other segments, the unit it lands in, or the step's T; and
    whatever the page size (8: keys gathered with AVX-512; 16, 32: read in place)."""
    kv_heads, g, h = heads
    rng = np.random.default_rng(4)
    k_all, v_all = rng.standard_normal((2, 70, kv_heads, h)).astype(np.float32)
    q_all = (rng.standard_normal((70, kv_heads, g, h)) / np.sqrt(h)).astype(np.float32)
    whole = _split_runs(heads, window, [70], k_all, v_all, q_all)
    assert np.all(np.isfinite(whole))
    for splits, ps in [([16, 16, 38], 16), ([1] * 70, 16), ([16, 16, 38], 8), ([70], 32)]:
        got = _split_runs(heads, window, splits, k_all, v_all, q_all, ps=ps)
        np.testing.assert_array_equal(got.view(np.uint32), whole.view(np.uint32),
                                      err_msg=f"{len(splits)} steps, page size {ps}")
    segments = [(1, 0, 70, 0)]
    pool = Pool(kv_heads, h, 16, 2, 5, seed=5)
    pool.write(1, 0, k_all, v_all)
    slot, start, n, pos = (np.array(c, np.int32) for c in zip(*segments))
    want = reference_ragged(q_all, pool.k, pool.v, pool.tables, slot, start, n, pos, window)
    np.testing.assert_allclose(whole, want, atol=ATOL, rtol=0)


@needs_kernels
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("heads, segments, t, q_scale, atol", [
    # a 2,049-token prompt: 16+ key blocks, partial last query and key blocks
    ((1, 2, 64), [(0, 0, 2049, 0)], 2049, 1.0, ATOL),
    # verification blocks of 1 + 4 tokens after long caches, beside a 511-token prompt
    ((3, 3, 64), [(0, 0, 5, 1275), (1, 5, 5, 700), (2, 16, 511, 0)], 530, 1.0, ATOL),
    # sharp scores (spread ~100 nats): rounding the q.k sums to float32 alone, in the
    # kernel's order over H, moves the output by ~9e-6 (measured in numpy)
    ((3, 3, 64), [(r, r, 1, p) for r, p in enumerate([0, 5, 40, 383])] + [(4, 4, 37, 9)], 48,
     30.0, 3e-5),
    # Gemma 3 heads over 37 positions, as the dense decode kernel's case was
    ((1, 4, 256), [(0, 0, 1, 36), (1, 1, 1, 20), (2, 2, 1, 5), (3, 3, 10, 27)], 16, 30.0, 3e-5),
])
def test_long_and_sharp_steps_match_reference(heads, segments, t, q_scale, atol, window):
    """What prefill, verification and decode of the phases ask beyond the
    steps above: long prompts and caches, and scores far from 1."""
    _check_against_reference(*_step(segments, t, heads, 16, window, q_scale=q_scale), atol=atol)


@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_is_differentiable_through_the_xla_function(window):
    """The kernel's gradient is `ragged_paged_attention_xla`'s (its custom
    VJP), for queries and both pools: training differentiates through the
    phases' forward."""
    (q, k, v, tables, *segments), _ = _step([(0, 0, 37, 0), (1, 40, 20, 10)], 64, (2, 3, 16), 16,
                                            window, q_scale=3.0)
    k, v = np.nan_to_num(k), np.nan_to_num(v)       # zeros where nothing was written
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, tables, *segments, window=window)))
    got = jax.jit(jax.grad(loss(ragged_paged_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(ragged_paged_attention_xla), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):   # the same backward at forwards 2e-6 apart
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)


# Validation: a small valid step (T = 8, page size 4, M = 4, P = 11, S = 2) and one change each.
def _small_step():
    pool = Pool(1, 16, 4, 2, 4, seed=1)
    pool.fill(0, 16)
    pool.fill(1, 16)
    q = np.ones((8, 1, 2, 16), np.float32) * 0.1
    segs = {"slot": [0, 1], "start": [0, 4], "len": [4, 3], "pos": [0, 5]}
    return q, pool.k, pool.v, pool.tables, segs


def _run_small(tables=None, window=None, **changes):
    q, k, v, base_tables, segs = _small_step()
    segs.update(changes)
    args = [np.array(segs[name], np.int32) for name in ("slot", "start", "len", "pos")]
    tables = base_tables if tables is None else tables
    return np.asarray(jax.block_until_ready(jax.jit(
        lambda *a: ragged_paged_attention(*a, window=window))(q, k, v, tables, *args)))


@needs_kernels
@pytest.mark.parametrize("changes, message", [
    ({"start": [0, 6]}, "segment 1's tokens [6, 9) are not within [0, T=8)"),
    ({"start": [-1, 4]}, "segment 0's tokens [-1, 3) are not within [0, T=8)"),
    ({"len": [4, -2]}, "segment 1's tokens [4, 2) are not within [0, T=8)"),
    ({"start": [0, 3]}, "segments 0 and 1 overlap at token 3"),
    ({"pos": [0, -1]}, "segment 1's seg_pos -1 is negative"),
    ({"slot": [0, 2]}, "segment 1's slot 2 is not within [0, S=2)"),
    ({"slot": [-1, 1]}, "segment 0's slot -1 is not within [0, S=2)"),
    ({"pos": [0, 14]}, "segment 1's position 16 needs block-table column 4, past M=4"),
])
def test_bad_segments_are_refused(changes, message):
    """Nothing is clamped: a step that breaks the contract fails the call."""
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=re.escape(f"ragged_paged_attention: {message}")):
        _run_small(**changes)


@needs_kernels
@pytest.mark.parametrize("entry", [-1, 11])
def test_a_needed_block_table_entry_outside_the_pool_is_refused(entry):
    tables = _small_step()[3].copy()
    tables[1, 1] = entry                                             # positions 4..7 of slot 1
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
            f"ragged_paged_attention: segment 1 reads block_tables[1, 1] = {entry}, "
            "not a page in [0, P=11)")):
        _run_small(tables)


@needs_kernels
def test_entries_nobody_reads_are_not_checked():
    """Columns past a segment's last position, pages before its window, and
    unused segments' fields may hold anything."""
    tables = _small_step()[3].copy()
    tables[1, 3] = 99                                                # past position 7
    tables[1, 0] = -1                                                # before the window of 2
    out = _run_small(tables, window=2, len=[4, 3, 0], slot=[0, 1, 77], start=[0, 4, -5],
                     pos=[0, 5, -9])
    assert np.all(np.isfinite(out)) and np.all(out[7] == 0.0)


def test_wrapper_rejects_bad_shapes_and_dtypes():
    q, k, v, tables, segs = _small_step()
    slot, start, n, pos = (np.array(segs[name], np.int32) for name in ("slot", "start", "len", "pos"))
    for fn in (ragged_paged_attention, ragged_paged_attention_xla):
        name = fn.__name__
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: seg_len is int32[3], expected int32[2]")):
            fn(q, k, v, tables, slot, start, np.zeros(3, np.int32), pos)
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: v_pages is float32[11, 1, 4, 8], expected float32[11, 1, 4, 16]")):
            fn(q, k, v[..., :8], tables, slot, start, n, pos)
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: block_tables is int64[2, 4], expected int32[2, 4]")):
            fn(q, k, v, tables.astype(np.int64), slot, start, n, pos)
        with pytest.raises(ValueError, match=re.escape(f"{name}: window=0 must be None or >= 1")):
            fn(q, k, v, tables, slot, start, n, pos, window=0)


def test_kernel_wrapper_needs_the_kernels(monkeypatch):
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    q, k, v, tables, segs = _small_step()
    args = [np.array(segs[name], np.int32) for name in ("slot", "start", "len", "pos")]
    with pytest.raises(RuntimeError, match="CPU kernels are not enabled"):
        ragged_paged_attention(q, k, v, tables, *args)
    out = ragged_paged_attention_xla(q, k, v, tables, *args)       # the XLA version still runs
    assert out.shape == q.shape
