"""GGUF quantized blocks kept as codes and scales (`quant.BlockCodes`),
for loads that keep a file's quantization (`gguf.load_gguf(keep_quantized=True)`):
the codes come from `gguf.quants.dequantize` itself with every scale set to
1 and every min to 0, the scales from the block fields it reads.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.checkpoint.convert import CheckpointError
from jaxinfer.weights import quant


def numpy_shape(tensor) -> tuple[int, ...]:
    """A `gguf.ReaderTensor`'s shape in numpy order: GGUF lists ne0 (the
    contiguous dimension) first; numpy lists it last."""
    return tuple(int(d) for d in reversed(tensor.shape))


# GGML block layouts (ggml-common.h), as `gguf.quants` reads them: byte
# offsets of the fields set to "scale 1, min 0" so that `gguf.quants.dequantize`
# returns the codes themselves, in the tensor's element order.
_F16_ONE = np.frombuffer(np.float16(1).tobytes(), np.uint8)
_UNIT_FIELDS = {  # type name -> [(start, bytes)] per block
    "Q4_0": [(0, _F16_ONE)], "Q5_0": [(0, _F16_ONE)], "Q8_0": [(0, _F16_ONE)],
    "Q4_1": [(0, _F16_ONE), (2, np.zeros(2, np.uint8))],
    "Q5_1": [(0, _F16_ONE), (2, np.zeros(2, np.uint8))],
    # d = 1, dmin = 0, the 12 packed 6-bit (scale, min) pairs all (1, 0)
    "Q4_K": [(0, _F16_ONE), (2, np.zeros(2, np.uint8)),
             (4, np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8))],
    "Q6_K": [(192, np.ones(16, np.uint8)), (208, _F16_ONE)],  # 16 int8 scales = 1, d = 1
}
_UNIT_FIELDS["Q5_K"] = _UNIT_FIELDS["Q4_K"]
BLOCK_TYPES = tuple(_UNIT_FIELDS)  # kept as `quant.BlockCodes` by keep_quantized loads
_ROWS_PER_CHUNK = 8192


def _codes(blocks: np.ndarray, type_name: str, qtype, shape) -> np.ndarray:
    """The tensor's codes as float32 [rows, in]: `gguf.quants.dequantize` of
    its blocks with every scale set to 1 and every min to 0 (in row chunks)."""
    from gguf.quants import dequantize

    unit = blocks.copy()
    for start, value in _UNIT_FIELDS[type_name]:
        unit[:, start:start + len(value)] = value
    rows, cols = shape
    per_row = unit.shape[0] // rows
    out = np.empty((rows, cols), np.float32)
    for r in range(0, rows, _ROWS_PER_CHUNK):
        chunk = unit[r * per_row:(r + _ROWS_PER_CHUNK) * per_row]
        out[r:r + _ROWS_PER_CHUNK] = dequantize(chunk.reshape(-1), qtype).reshape(-1, cols)
    return out


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0]


def _scales(blocks: np.ndarray, type_name: str):
    """(scale, min or None) per block of codes, [n_blocks, sub-blocks]."""
    from gguf.quants import Q4_K

    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blocks, 0)[:, None]
        return d, (d * np.float16(-8) if type_name == "Q4_0" else None)
    if type_name in ("Q4_1", "Q5_1"):
        return _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
    if type_name in ("Q4_K", "Q5_K"):  # scale = d * sc, min = -(dmin * m), 8 sub-blocks of 32
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        d, dmin = (_f16(blocks, i).astype(np.float32)[:, None] for i in (0, 2))
        return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    # Q6_K: scale = d * sc, 16 sub-blocks of 16
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return _f16(blocks, 208).astype(np.float32)[:, None] * sc, None


def gguf_block_codes(tensor) -> quant.BlockCodes:
    """A block-quantized 2-D GGUF tensor [out, in] (numpy order) as
    `quant.BlockCodes` of its transpose [in, out], the values unchanged.

    Q4_0 / Q4_1 (4-bit, float16 scale and min; Q4_0's min is -8 d) and Q8_0
    / Q5_0 (8-bit, float16 scale) keep their blocks of 32; Q5_1 becomes
    8-bit codes with float16 scale and min; Q4_K / Q5_K become blocks of 32
    with float32 scale d * sc and min -dmin * m; Q6_K blocks of 16 with
    float32 scale d * sc. `BlockCodes.dequantize` then computes the same
    float32 values as `gguf.quants.dequantize` (same products, same order).
    The codes come from `gguf.quants.dequantize` itself (see `_codes`), the
    scales from the block fields it reads.

    Raises:
      CheckpointError: a type not in BLOCK_TYPES, or a tensor that is not 2-D.
    """
    from gguf.constants import GGML_QUANT_SIZES

    name = tensor.tensor_type.name
    shape = numpy_shape(tensor)
    if name not in _UNIT_FIELDS or len(shape) != 2:
        raise CheckpointError(f"tensor {tensor.name!r}: cannot keep {name}{list(shape)} as blocks")
    _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = np.asarray(tensor.data).reshape(-1, type_size)
    codes = _codes(blocks, name, tensor.tensor_type, shape)
    scale, low = _scales(blocks, name)
    rows = shape[0]
    per_row = lambda a: np.ascontiguousarray(a.reshape(rows, -1).T)  # [in / bs, out]
    bits = 4 if name in ("Q4_0", "Q4_1", "Q4_K") else 8
    if name == "Q4_0":
        codes = codes + 8  # d * (q - 8) = d * q + (-8 d), both exact
    codes = codes.astype(np.uint8 if bits == 4 else np.int8)
    return quant.BlockCodes(np.ascontiguousarray(codes.T), per_row(scale),
                            None if low is None else per_row(low), bits)
