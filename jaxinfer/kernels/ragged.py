"""Ragged paged attention: one scheduler step's tokens over a paged KV cache.

A step's T query tokens are flat and made of segments, one per request:
1 token for a decoding row, 1 + k to verify k drafted tokens, a prompt chunk
or a whole prompt, each at its request's own position in its own slot of the
paged cache (vLLM v1's one forward per step; tpu-inference's "ragged paged
attention"). The step's new K/V are written into the pages before attention
runs, so every query attends over pages only.

- `ragged_paged_attention`: the C++ kernel (`JaxinferRaggedPagedAttention`
  in `cpu_kernels.cc`, `JaxinferRaggedPagedAttentionInt8` for int8 pools
  with their scales), flash-style (online softmax over key blocks), reading
  keys and values from the pages through the block tables. Each output row
  depends only on its query, its position and the K/V it sees, bit for bit:
  a prompt run whole, in chunks or one token at a time gives identical bits.
  Differentiable: its backward pass is `ragged_paged_attention_xla`'s
  (training differentiates through the phases' forward).
- `ragged_paged_attention_xla`: the same function in pure JAX, for other
  backends, in blocks of query tokens so memory stays bounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kernels.cpu import _require_enabled, check_operands

TOKEN_BLOCK = 32  # query tokens per step of `ragged_paged_attention_xla`'s lax.map


def _check(fn: str, q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len, seg_pos,
           key_scale, value_scale, window) -> None:
    """Trace-time shape, dtype and window checks shared by both versions."""
    if (key_scale is None) != (value_scale is None):
        raise ValueError(f"{fn}: key_scale and value_scale go together (int8 pools), "
                         "or neither (float32 pools)")
    t, kv_heads, g, h = q.shape
    p, ps = k_pages.shape[0], k_pages.shape[-1]
    s, m = block_tables.shape if block_tables.ndim == 2 else (0, 0)
    r = seg_slot.shape[0] if seg_slot.ndim == 1 else 0
    pages = jnp.float32 if key_scale is None else jnp.int8
    expected = {"q": (q, (t, kv_heads, g, h), jnp.float32),
                "k_pages": (k_pages, (p, kv_heads, h, ps), pages),
                "v_pages": (v_pages, (p, kv_heads, ps, h), pages),
                "block_tables": (block_tables, (s, m), jnp.int32),
                "seg_slot": (seg_slot, (r,), jnp.int32), "seg_start": (seg_start, (r,), jnp.int32),
                "seg_len": (seg_len, (r,), jnp.int32), "seg_pos": (seg_pos, (r,), jnp.int32)}
    if key_scale is not None:
        expected.update(key_scale=(key_scale, (p, kv_heads, ps), jnp.float32),
                        value_scale=(value_scale, (p, kv_heads, ps), jnp.float32))
    check_operands(fn, expected)
    if window is not None and window < 1:
        raise ValueError(f"{fn}: window={window} must be None or >= 1")


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, seg_slot: jax.Array, seg_start: jax.Array,
                           seg_len: jax.Array, seg_pos: jax.Array,
                           key_scale: jax.Array | None = None,
                           value_scale: jax.Array | None = None,
                           window: int | None = None) -> jax.Array:
    """Attention of a step's ragged query tokens over a paged cache (C++ kernel).

    Segment r is the step's tokens [seg_start[r], seg_start[r] + seg_len[r]);
    its query i sits at position p = seg_pos[r] + i of slot seg_slot[r] and
    sees that slot's keys at positions [max(0, p - window + 1), p] (all of
    [0, p] without a window). Slot s's position x is stored in page
    block_tables[s, x // page_size] at offset x % page_size. The output is
    softmax(q . k over the visible keys) . v, and exact zeros for tokens no
    segment covers. The step's own K/V must already be in the pages. K/V at
    positions no query of a segment sees may hold anything (NaN included);
    values a segment sees must be finite (a NaN there reaches its other
    queries' outputs, as 0 x NaN).

    An int8 pool (`cache.int8`) passes its codes as k_pages and v_pages with
    key_scale and value_scale: the kernel attends over the dequantized K/V
    (key = codes * key_scale, value = codes * value_scale, per token and kv
    head) without writing them out, reading a quarter of float32's bytes;
    every property above holds for it, bitwise invariance included, and a
    scale the segment's queries do not see may hold anything too.

    Args:
      q: float32 [T, K, G, H], the step's queries already multiplied by the
        query scale (query head k*G + g reads kv head k): [T, N, H] reshaped.
      k_pages: float32 [P, K, H, page_size], one layer's key pool (positions
        minor); int8 codes with key_scale.
      v_pages: float32 [P, K, page_size, H], the value pool; int8 codes with
        value_scale.
      block_tables: int32 [S, M].
      seg_slot, seg_start, seg_len, seg_pos: int32 [R]; a segment with
        seg_len 0 is unused and its other entries are not read.
      key_scale, value_scale: None (float32 pools), or float32 [P, K,
        page_size] each (int8 pools).
      window: None, or the sliding window W >= 1.
    Returns:
      float32 [T, K, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (one scale
        without the other included), or a window below 1 (at trace time).
      RuntimeError: the kernels are not `cpu.enabled()`.
      JaxRuntimeError (when run; nothing is clamped, nothing read out of
        bounds): a used segment whose tokens are not within [0, T), two used
        segments that overlap, a negative seg_pos, a slot outside [0, S), a
        visible position whose block-table column p // page_size is >= M, or
        a visible position's block-table entry outside [0, P).
    """
    _check("ragged_paged_attention", q, k_pages, v_pages, block_tables, seg_slot, seg_start,
           seg_len, seg_pos, key_scale, value_scale, window)
    _require_enabled()
    return _ragged_paged_attention(q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len,
                                   seg_pos, key_scale, value_scale, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len,
                            seg_pos, key_scale, value_scale, window):
    operands = (q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len, seg_pos)
    target = "jaxinfer_ragged_paged_attention"
    if key_scale is not None:
        operands, target = (*operands, key_scale, value_scale), target + "_int8"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        *operands, window=np.int64(window or 0))


def _ragged_fwd(*args):
    *operands, window = args
    return _ragged_paged_attention(*operands, window), tuple(operands)


def _ragged_bwd(window, residuals, grad):
    """`ragged_paged_attention_xla`'s VJP: for q and the float pools, or for
    q and the scales of an int8 pool (its codes, like the tables and
    segments, get none)."""
    q, k_pages, v_pages, tables, *segments, key_scale, value_scale = residuals
    xla = functools.partial(ragged_paged_attention_xla, block_tables=tables, seg_slot=segments[0],
                            seg_start=segments[1], seg_len=segments[2], seg_pos=segments[3],
                            window=window)
    none = (None,) * 5
    if key_scale is None:
        _, vjp = jax.vjp(lambda q, k, v: xla(q, k, v), q, k_pages, v_pages)
        return (*vjp(grad), *none, None, None)
    _, vjp = jax.vjp(lambda q, ks, vs: xla(q, k_pages, v_pages, key_scale=ks, value_scale=vs),
                     q, key_scale, value_scale)
    dq, dks, dvs = vjp(grad)
    return (dq, None, None, *none, dks, dvs)


_ragged_paged_attention.defvjp(_ragged_fwd, _ragged_bwd)


def token_positions(t: int, seg_slot, seg_start, seg_len, seg_pos) -> tuple[jax.Array, jax.Array]:
    """(position, slot) of each of the T query tokens, int32 [T] each: the
    position is -1 for a token no used segment covers (its slot is then 0).
    Where used segments overlap, the lowest-numbered one wins."""
    tok = jnp.arange(t, dtype=jnp.int32)[:, None]
    inside = (tok >= seg_start) & (tok < seg_start + seg_len) & (seg_len > 0)  # [T, R]
    r = jnp.argmax(inside, axis=1)
    covered = inside.any(axis=1)
    pos = jnp.where(covered, seg_pos[r] + tok[:, 0] - seg_start[r], -1)
    return pos.astype(jnp.int32), jnp.where(covered, seg_slot[r], 0).astype(jnp.int32)


def _attend_block(q, pos, slot, k_pages, v_pages, block_tables, key_scale, value_scale, window):
    """One block of query tokens: q [B, K, G, H], pos and slot int32 [B] ->
    [B, K, G, H]. Gathers each token's pages (entries clamped into [0, P)),
    dequantized when scales are given; keys and values at positions a token
    cannot see are masked out, so whatever they hold (NaN included) does not
    reach its output."""
    b, kv_heads, g, h = q.shape
    p, _, _, ps = k_pages.shape
    m = block_tables.shape[1]
    pages = jnp.clip(block_tables[slot], 0, p - 1)                          # [B, M]
    keys = k_pages[pages]                                                   # [B, M, K, H, ps]
    if key_scale is not None:
        keys = keys.astype(jnp.float32) * key_scale[pages][:, :, :, None, :]
    scores = jnp.einsum("bkgh,bmkhs->bkgms", q, keys).reshape(b, kv_heads, g, m * ps)
    key_pos = jnp.arange(m * ps, dtype=jnp.int32)
    visible = (key_pos <= pos[:, None]) & (pos[:, None] >= 0)               # [B, M * ps]
    if window is not None:
        visible &= key_pos > pos[:, None] - window
    seen = visible[:, None, None, :]
    scores = jnp.where(seen, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(seen, jnp.exp(scores - top), 0.0)
    total = jnp.sum(weights, axis=-1)[..., None]
    values = v_pages[pages]                                                 # [B, M, K, ps, H]
    if value_scale is not None:
        values = values.astype(jnp.float32) * value_scale[pages][..., None]
    values = jnp.where(visible.reshape(b, m, 1, ps, 1), values, 0.0)
    out = jnp.einsum("bkgms,bmksh->bkgh", weights.reshape(b, kv_heads, g, m, ps), values)
    return out / jnp.where(total > 0, total, 1.0)


def ragged_paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               block_tables: jax.Array, seg_slot: jax.Array, seg_start: jax.Array,
                               seg_len: jax.Array, seg_pos: jax.Array,
                               key_scale: jax.Array | None = None,
                               value_scale: jax.Array | None = None,
                               window: int | None = None) -> jax.Array:
    """`ragged_paged_attention`'s function in pure JAX (any backend), equal
    up to float32 rounding on the inputs the kernel accepts (int8 pools
    with their scales included).

    Query tokens go in blocks of `TOKEN_BLOCK` (a `lax.map`); each token
    gathers its slot's pages, so memory holds [TOKEN_BLOCK, K, G, M * page_size]
    scores (and the block's gathered K/V), never [T, M * page_size]. Nothing
    is validated at run time: inputs the kernel rejects give unspecified
    values here (block-table entries are clamped into [0, P); overlapping
    segments: the lower-numbered one wins).

    Args, Returns: as `ragged_paged_attention`.
    Raises:
      ValueError: shapes or dtypes that do not match, or a window below 1
        (at trace time).
    """
    _check("ragged_paged_attention_xla", q, k_pages, v_pages, block_tables, seg_slot, seg_start,
           seg_len, seg_pos, key_scale, value_scale, window)
    q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len, seg_pos = map(
        jnp.asarray, (q, k_pages, v_pages, block_tables, seg_slot, seg_start, seg_len, seg_pos))
    if key_scale is not None:
        key_scale, value_scale = jnp.asarray(key_scale), jnp.asarray(value_scale)
    t = q.shape[0]
    if t == 0:
        return jnp.zeros(q.shape, jnp.float32)
    pos, slot = token_positions(t, seg_slot, seg_start, seg_len, seg_pos)
    blocks = -(-t // TOKEN_BLOCK)
    pad = blocks * TOKEN_BLOCK - t
    q_blocks = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(
        blocks, TOKEN_BLOCK, *q.shape[1:])
    pos_blocks = jnp.pad(pos, (0, pad), constant_values=-1).reshape(blocks, TOKEN_BLOCK)
    slot_blocks = jnp.pad(slot, (0, pad)).reshape(blocks, TOKEN_BLOCK)
    out = jax.lax.map(lambda x: _attend_block(*x, k_pages, v_pages, block_tables, key_scale,
                                              value_scale, window),
                      (q_blocks, pos_blocks, slot_blocks))
    return out.reshape(blocks * TOKEN_BLOCK, *q.shape[1:])[:t]
