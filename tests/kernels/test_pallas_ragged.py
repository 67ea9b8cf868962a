"""The Pallas ragged paged attention kernel (`kernels.pallas_ragged`, the
`pallas` attention backend), run through Pallas' interpreter on CPU: the kernel against the float64 reference of tests/kernels/test_ragged_attention.py
  (atol 2e-6, as the C++ kernel there), decode-only and mixed steps, page
  sizes 8 and 16, windows; against the XLA path (atol 2e-6) with soft-caps
and int8 pools, which the reference does not model. Served end to end:
tests/engine/test_pallas_backend.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.codecs import dequantize
from jaxinfer.cache.int8 import quantize_kv
from jaxinfer.cache.kv import LayerKV
from jaxinfer.engine import ragged
from jaxinfer.engine.backends import AttentionBackend
from jaxinfer.kernels.pallas_ragged import ragged_paged_attention_pallas
from test_ragged_attention import HEADS, HEAD_IDS, _step, reference_ragged

ATOL = 2e-6


def softcap_atol(softcap: float, v: np.ndarray) -> float:
    """Float32 error bound of soft-capped attention against float64: a capped
    score softcap * tanh(s / softcap) is off by about 4 units in the last
    place of softcap at most (tanh within a few ulp, then the product),
    however large s is; scores that move by at most e move softmax(scores) @ v
    by at most 2 e max|v| (the probabilities' changes sum to at most 2 e in
    absolute value); ATOL for the rest of the sum."""
    return ATOL + 2 * float(np.abs(v).max()) * 4 * float(np.spacing(np.float32(softcap)))
INTERPRET = AttentionBackend("pallas", interpret=True)
MIXED = [(r, r, 1, pos) for r, pos in enumerate([3, 17, 31, 64, 90, 127, 200, 255])] + [
    (8, 10, 37, 50), (9, 50, 100, 0)]          # 8 decodes, a chunk at 50, a whole prompt


def _pallas(args, window, **kw):
    out = ragged_paged_attention_pallas(*args, window=window, interpret=True, **kw)
    return np.asarray(out)


def _covered(args) -> np.ndarray:
    covered = np.zeros(args[0].shape[0], bool)
    for start, n in zip(args[5], args[6]):
        if n > 0:
            covered[start:start + n] = True
    return covered


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("ps", [8, 16])
@pytest.mark.parametrize("window", [None, 16, 100])
def test_kernel_matches_the_float64_reference(heads, ps, window):
    for segments, t in ([(r, r, 1, pos) for r, pos in enumerate([0, 1, 15, 16, 63, 64, 130, 511])],
                        8), (MIXED, 160):
        args, window = _step(segments, t, heads, ps, window)
        got = _pallas(args, window)
        assert got.shape == args[0].shape and got.dtype == np.float32
        np.testing.assert_allclose(got, reference_ragged(*args, window), atol=ATOL, rtol=0)
        assert np.all(got[~_covered(args)] == 0.0)


def _segments(args) -> ragged.Segments:
    """The step's `Segments` as the engine builds them, for the XLA path."""
    q, _, _, tables, slot, start, n, pos = args
    t = q.shape[0]
    inside = (np.arange(t)[:, None] >= start) & (np.arange(t)[:, None] < start + n)
    seg = inside.argmax(1)
    valid = inside.any(1)
    token_slot = np.where(valid, slot[seg], tables.shape[0]).astype(np.int32)
    token_pos = np.where(valid, pos[seg] + np.arange(t) - start[seg], 0).astype(np.int32)
    return ragged.Segments(*(jnp.asarray(a) for a in (slot, start, n, pos, token_slot, token_pos,
                                                       valid)))


@pytest.mark.parametrize("heads", HEADS[:2], ids=HEAD_IDS[:2])
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("softcap,int8", [(50.0, False), (None, True), (30.0, True)],
                         ids=["softcap", "int8", "softcap-int8"])
def test_kernel_matches_the_xla_path_with_softcaps_and_int8_pools(heads, window, softcap, int8):
    """Soft-capped scores of tens (queries x 20) and int8 pools: the kernel
    and the XLA path both within `softcap_atol` (soft-caps) or ATOL of the
    float64 reference on the same (dequantized) values."""
    args, window = _step(MIXED, 160, heads, 16, window)
    q, k, v, tables = args[:4]
    q = q * (20.0 if softcap else 1.0)
    # the XLA path reads every gathered column (masked after): no NaN in the pool
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    tables = np.where(tables < 0, 0, tables)
    if int8:
        (k_codes, k_scale), (v_codes, v_scale) = (
            quantize_kv(jnp.asarray(k).transpose(0, 3, 1, 2)), quantize_kv(jnp.asarray(v)
                                                                            .transpose(0, 2, 1, 3)))
        kv = LayerKV(k_codes.transpose(0, 2, 3, 1), v_codes.transpose(0, 2, 1, 3),
                     k_scale.transpose(0, 2, 1), v_scale.transpose(0, 2, 1))
    else:
        kv = LayerKV(jnp.asarray(k), jnp.asarray(v))
    plain = [np.asarray(x) for x in dequantize(kv)]
    want = reference_ragged(q, *plain, tables, *args[4:], window, softcap)
    seg = _segments((q, k, v, tables, *args[4:]))
    xla = np.asarray(ragged.attend_xla(jnp.asarray(q), kv, jnp.asarray(tables), seg, window or 0,
                                       softcap))
    got = np.asarray(ragged.attend(INTERPRET, jnp.asarray(q), kv, jnp.asarray(tables), seg,
                                   window or 0, softcap))
    atol = softcap_atol(softcap, plain[1]) if softcap else ATOL
    np.testing.assert_allclose(xla, want, atol=atol, rtol=0, err_msg="xla")
    np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg="pallas")
    assert np.abs(want).max() > 0.1


def test_int8_pages_without_scales_are_refused():
    args, _ = _step(MIXED, 160, HEADS[0], 16, None)
    codes = [np.zeros(a.shape, np.int8) for a in args[1:3]]
    with pytest.raises(ValueError, match="int8 pages need key_scale and value_scale"):
        ragged_paged_attention_pallas(args[0], *codes, *args[3:], interpret=True)
