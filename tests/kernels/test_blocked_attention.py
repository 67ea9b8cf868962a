"""`layers.blocked_attention` (online softmax over key blocks) against dense
masked attention: a float64 numpy reference and the dense float32 path
(`attention_scores` -> `masked_softmax` -> `attention_output`).

Tolerance: atol 2e-5 on outputs of magnitude ~1 (values ~N(0, 1), scores of
size ~1): float32 sums in another order, and the running max rescaling
exp(m_old - m_new) applied up to S / key_block times.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import nn as layers

ATOL = 2e-5
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64  # SmolLM2: 9 query heads, 3 kv heads, head_dim 64


def reference(qg, k, v, q_pos, k_pos, window):
    """Dense masked attention in float64 numpy: [B, K, T, G, H]."""
    qg, k, v = (np.asarray(a, np.float64) for a in (qg, k, v))
    q_pos, k_pos = np.asarray(q_pos)[:, :, None], np.asarray(k_pos)[:, None, :]
    visible = (k_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = np.einsum("bktgh,bkhs->bktgs", qg, k)
    scores = np.where(visible[:, None, :, None, :], scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    seen = np.isfinite(row_max)
    w = np.exp(scores - np.where(seen, row_max, 0.0))
    w /= np.where(seen, w.sum(-1, keepdims=True), 1.0)
    return np.einsum("bktgs,bksh->bktgh", w, v)


def dense(qg, k, v, q_pos, k_pos, window):
    """The dense float32 path of `layers`."""
    mask = layers.visible_keys(q_pos, k_pos, window)[:, None, :, None, :]
    weights = layers.masked_softmax(layers.attention_scores(qg, k), mask)
    return layers.attention_output(weights, v)


def _case(t, cached, batch=1, seed=0, pad_last_row=0, holes=0):
    """Queries at positions cached..cached+T-1 over S = cached + T key slots
    holding positions 0..S-1; the last row's final `pad_last_row` queries and
    keys are padding (-1), and `holes` random key slots of row 0 are empty."""
    rng = np.random.default_rng(seed)
    s = cached + t
    qg = (rng.standard_normal((batch, KV_HEADS, t, GROUP, HEAD_DIM)) / np.sqrt(HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((batch, KV_HEADS, HEAD_DIM, s)).astype(np.float32)
    v = rng.standard_normal((batch, KV_HEADS, s, HEAD_DIM)).astype(np.float32)
    q_pos = np.tile(np.arange(cached, s, dtype=np.int32), (batch, 1))
    k_pos = np.tile(np.arange(s, dtype=np.int32), (batch, 1))
    if pad_last_row:
        q_pos[-1, t - pad_last_row:] = -1
        k_pos[-1, s - pad_last_row:] = -1
    if holes:
        k_pos[0, rng.choice(s, holes, replace=False)] = -1
    return qg, k, v, q_pos, k_pos


def _check(args, window, **blocks):
    out = jax.jit(lambda *a: layers.blocked_attention(*a, window=window, **blocks))(*args)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    out = np.asarray(out)
    np.testing.assert_allclose(out, reference(*args, window), atol=ATOL, rtol=0)
    np.testing.assert_allclose(out, np.asarray(dense(*args, window)), atol=ATOL, rtol=0)
    return out


@pytest.mark.parametrize("window", [None, 100, 512])
@pytest.mark.parametrize("t, cached, batch, pad, holes", [
    (1, 300, 2, 0, 20),       # one decode token over a cache with empty slots
    (511, 0, 2, 37, 0),       # a prompt; row 1 padded
    (1024, 100, 1, 0, 9),     # an extend chunk after 100 cached tokens
    (2049, 0, 1, 0, 0),       # a long prompt: 9 x 9 blocks of 256, the last ones partial
])
def test_blocked_matches_dense(t, cached, batch, pad, holes, window):
    out = _check(_case(t, cached, batch, pad_last_row=pad, holes=holes), window)
    if pad:  # padding queries see nothing: exact zeros
        assert np.all(out[-1, :, t - pad:] == 0.0)


@pytest.mark.parametrize("query_block, key_block", [(64, 100), (1, 7), (511, 511), (1000, 1000)])
def test_block_sizes_do_not_change_the_result(query_block, key_block):
    _check(_case(511, 20, 2, pad_last_row=5, holes=3), 64, query_block=query_block, key_block=key_block)


def test_ring_buffer_order_and_softcap():
    """Key slots in ring order (positions not sorted), as a sliding layer's cache holds them."""
    qg, k, v, q_pos, k_pos = _case(40, 200, 2, holes=0)
    perm = np.random.default_rng(1).permutation(k_pos.shape[1])
    k, v, k_pos = k[..., perm], v[:, :, perm], k_pos[:, perm]
    _check((qg, k, v, q_pos, k_pos), 64, key_block=32)
    cap = 0.5  # a cap well below the score range changes every weight
    out = layers.blocked_attention(qg * 4, k, v, q_pos, k_pos, 64, softcap=cap, key_block=32)
    mask = layers.visible_keys(q_pos, k_pos, 64)[:, None, :, None, :]
    w = layers.masked_softmax(layers.attention_scores(qg * 4, k, softcap=cap), mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(layers.attention_output(w, v)),
                               atol=ATOL, rtol=0)


def test_bad_shapes_and_blocks_are_errors():
    qg, k, v, q_pos, k_pos = _case(8, 0)
    with pytest.raises(ValueError, match=r"blocked_attention: v has shape \[1, 3, 7, 64\], expected \[1, 3, 8, 64\]"):
        layers.blocked_attention(qg, k, v[:, :, :7], q_pos, k_pos)
    with pytest.raises(ValueError, match=r"k_positions has shape \[1, 9\], expected \[1, 8\]"):
        layers.blocked_attention(qg, k, v, q_pos, np.zeros((1, 9), np.int32))
    with pytest.raises(ValueError, match="key_block=0 and window=None must be >= 1"):
        layers.blocked_attention(qg, k, v, q_pos, k_pos, key_block=0)


def test_attention_bench_prints_one_row_per_length(capsys):
    """`python -m jaxinfer_tools.bench.attention` runs and reports each length
    (the kernel's columns filled where the CPU kernels run)."""
    from jaxinfer.kernels import cpu as cpu_kernels
    from jaxinfer_tools.bench.attention import main

    assert main(["--lengths", "16,40", "--repeats", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| 16 |", "| 40 |"))]
    assert [int(r[0]) for r in rows] == [16, 40] and all(len(r) == 9 for r in rows)
    kernel_ms = [r[4].strip() for r in rows]
    assert all((float(ms) > 0) if cpu_kernels.enabled() else ms == "-" for ms in kernel_ms)
