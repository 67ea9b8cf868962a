"""GGUF checkpoint reader: metadata -> ModelConfig, tensors -> params pytree.

Format: GGUF spec, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
Parsing and dequantization use the `gguf` package (`GGUFReader`,
`gguf.quants.dequantize`); this module only maps names and layouts:

* Names: GGUF tensor names map onto Hugging Face names in one table,
  `GGUF_TO_HF`; `convert.params_from_hf_tensors` then builds the params.
* Dimensions: a GGUF tensor lists its dimensions fastest-first (`ne0` is
  the row length), the reverse of numpy order, so a linear weight listed as
  `[in, out]` is read as numpy `[out, in]`, the PyTorch `nn.Linear` layout.
* Llama Q/K rows: llama.cpp's converter regroups each head's rows for
  GGML's interleaved RoPE; `unpermute_qk` undoes it (arch "llama" only).
* Gemma norms: llama.cpp stores Gemma RMSNorm weights with the `+1` folded
  in, which is already the direct multiplier jaxinfer uses: no offset.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from collections import Counter
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from jaxinfer.weights import quant
from jaxinfer.checkpoint.convert import (EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD, CheckpointError,
                                         _fetch, _hf_shape, _layer_table, _stack_layer_param, counted,
                                         has_separate_lm_head, params_from_hf_tensors, resolve_tied)
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.progress import Progress

SUPPORTED_ARCHS = ("llama", "gemma3")

# GGUF name -> HF name. "{i}" is the layer index. A dict value gives the HF
# name per GGUF architecture: llama.cpp's `ffn_norm` is always the norm in
# front of the MLP, which HF Llama calls post_attention_layernorm and HF
# Gemma 3 calls pre_feedforward_layernorm (Gemma's post_attention_layernorm
# is the norm on the attention output, GGUF `post_attention_norm`).
GGUF_TO_HF: dict[str, Any] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": {
        "llama": "model.layers.{i}.post_attention_layernorm.weight",
        "gemma3": "model.layers.{i}.pre_feedforward_layernorm.weight",
    },
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """Non-architecture facts from a GGUF header (None when the file omits them).

    Attributes:
      architecture: `general.architecture`, e.g. "llama", "gemma3".
      name: `general.name`.
      context_length: `{arch}.context_length`, tokens.
      bos_token_id, eos_token_id, pad_token_id: `tokenizer.ggml.*_token_id`.
      chat_template: `tokenizer.chat_template` (Jinja2 source).
      add_bos_token, add_eos_token: `tokenizer.ggml.add_{bos,eos}_token`.
      tokenizer_model: `tokenizer.ggml.model` ("gpt2" = byte-level BPE,
        "llama" = SentencePiece).
      tensor_types: sorted (GGML type name, tensor count) pairs.
    """

    architecture: str
    name: Optional[str] = None
    context_length: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    chat_template: Optional[str] = None
    add_bos_token: Optional[bool] = None
    add_eos_token: Optional[bool] = None
    tokenizer_model: Optional[str] = None
    tensor_types: tuple[tuple[str, int], ...] = ()


def gguf_to_hf_name(gguf_name: str, arch: str) -> Optional[str]:
    """The HF name for a GGUF tensor name under `arch`, or None if unmapped."""
    match = _BLOCK.fullmatch(gguf_name)
    key, layer = (f"blk.{{i}}.{match.group(2)}", match.group(1)) if match else (gguf_name, None)
    hf = GGUF_TO_HF.get(key)
    if isinstance(hf, dict):
        hf = hf.get(arch)
    if hf is None:
        return None
    return hf.format(i=layer) if layer is not None else hf


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGML interleaved -> HF rotate-half.

    llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`)
    rewrites each head's rows so that RoPE pairs (j, j + H/2) become adjacent
    rows (2j, 2j + 1): `w.reshape(n, 2, H/2, ...).swapaxes(1, 2)`. This is
    the inverse: `w.reshape(n, H/2, 2, ...).swapaxes(1, 2)`.

    Args:
      w: `[n * H, in]` weight (or `[n * H]` bias) as read from the file.
      num_heads: n, the heads in this tensor: query heads N for `attn_q`,
        KV heads K for `attn_k` (using N for K is the classic GQA bug).

    Returns:
      array of the same shape and dtype, rows in HF order.

    Raises:
      CheckpointError: rows are not a multiple of 2 * num_heads.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------
# Metadata -> ModelConfig

def _get(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    field = fields.get(key)
    return default if field is None else field.contents()


def _require(fields: Mapping[str, Any], key: str) -> Any:
    if key not in fields:
        raise CheckpointError(f"GGUF metadata is missing {key!r}")
    return fields[key].contents()


def _scalar_heads(value: Any, key: str) -> int:
    """Head counts may be per-layer arrays in GGUF; we need one value."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"per-layer {key} {sorted(set(value))} is not supported")
        value = value[0]
    return int(value)


def _vocab_size(fields, arch: str, tensor_shapes: Optional[Mapping[str, tuple]]) -> int:
    if f"{arch}.vocab_size" in fields:
        return int(_get(fields, f"{arch}.vocab_size"))
    if tensor_shapes and "token_embd.weight" in tensor_shapes:
        return int(tensor_shapes["token_embd.weight"][0])   # numpy order [V, D]
    if "tokenizer.ggml.tokens" in fields:
        return len(fields["tokenizer.ggml.tokens"].data)
    raise CheckpointError("GGUF metadata gives no vocab size and no token list")


def _check_rope_scaling(fields, arch: str, tensor_shapes) -> None:
    """Refuse RoPE variants the config cannot express (wrong logits otherwise)."""
    kind = _get(fields, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported")
    if tensor_shapes and "rope_freqs.weight" in tensor_shapes:
        raise CheckpointError(
            "tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors) is not supported")


def _common_config(fields, arch: str, tensor_shapes) -> dict:
    """ModelConfig fields shared by all architectures."""
    hidden = int(_require(fields, f"{arch}.embedding_length"))
    heads = _scalar_heads(_require(fields, f"{arch}.attention.head_count"), "head_count")
    kv_heads = _scalar_heads(_get(fields, f"{arch}.attention.head_count_kv", heads), "head_count_kv")
    head_dim = _get(fields, f"{arch}.attention.key_length") or _get(
        fields, f"{arch}.rope.dimension_count") or hidden // heads
    names = tensor_shapes or {}
    return dict(
        vocab_size=_vocab_size(fields, arch, tensor_shapes),
        num_layers=int(_require(fields, f"{arch}.block_count")),
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
        intermediate_size=int(_require(fields, f"{arch}.feed_forward_length")),
        rope_theta=float(_get(fields, f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(_require(fields, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_get(fields, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def _gemma3_layer_types(fields, num_layers: int) -> tuple[str, ...]:
    """Sliding/full per layer: metadata pattern, else Gemma 3's 5 local : 1 global.

    `{arch}.attention.sliding_window_pattern` is either a period n (layer i
    is full when (i + 1) % n == 0, llama.cpp's `set_swa_pattern`) or one
    bool per layer (True = sliding).
    """
    pattern = _get(fields, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise CheckpointError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in pattern)
    n = int(pattern)
    return tuple(FULL_ATTENTION if (i + 1) % n == 0 else SLIDING_ATTENTION for i in range(num_layers))


def _gemma3_config(fields, common: dict) -> dict:
    # llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) scales queries by
    # hidden/heads for the 62-layer 27B model and by head_dim otherwise,
    # matching the HF configs' query_pre_attn_scalar.
    layers = common["num_layers"]
    scalar = common["hidden_size"] // common["num_heads"] if layers == 62 else common["head_dim"]
    return dict(
        hidden_act="gelu_pytorch_tanh", qk_norm=True, sandwich_norm=True, scale_embeddings=True,
        sliding_window=int(_require(fields, "gemma3.attention.sliding_window")),
        layer_types=_gemma3_layer_types(fields, layers),
        rope_local_theta=10_000.0, query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_get(fields, "gemma3.attn_logit_softcapping"),
        final_logit_softcapping=_get(fields, "gemma3.final_logit_softcapping"),
    )


def config_from_gguf(fields: Mapping[str, Any],
                     tensor_shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata.

    Args:
      fields: `gguf.GGUFReader(path).fields` (key -> ReaderField).
      tensor_shapes: GGUF tensor name -> numpy-order shape, used to detect a
        tied LM head (no `output.weight`), q/k/v biases and the vocab size
        when `{arch}.vocab_size` is absent (else the token list length).
        Without it the model is taken as tied and bias-free.

    Returns:
      ModelConfig with arch "llama" (GGUF "llama") or "gemma3".

    Raises:
      CheckpointError: unsupported architecture or RoPE scaling, or missing
        required metadata keys.
    """
    arch = _require(fields, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}")
    _check_rope_scaling(fields, arch, tensor_shapes)
    common = _common_config(fields, arch, tensor_shapes)
    if arch == "gemma3":
        return ModelConfig(arch="gemma3", **common, **_gemma3_config(fields, common))
    return ModelConfig(arch="llama", hidden_act="silu", **common)


def metadata_from_gguf(fields: Mapping[str, Any], tensor_types: Counter | None = None) -> GGUFMetadata:
    """Tokenizer-facing and descriptive metadata (see GGUFMetadata)."""
    arch = _require(fields, "general.architecture")
    ctx = _get(fields, f"{arch}.context_length")
    return GGUFMetadata(
        architecture=arch,
        name=_get(fields, "general.name"),
        context_length=None if ctx is None else int(ctx),
        bos_token_id=_get(fields, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_get(fields, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_get(fields, "tokenizer.ggml.padding_token_id"),
        chat_template=_get(fields, "tokenizer.chat_template"),
        add_bos_token=_get(fields, "tokenizer.ggml.add_bos_token"),
        add_eos_token=_get(fields, "tokenizer.ggml.add_eos_token"),
        tokenizer_model=_get(fields, "tokenizer.ggml.model"),
        tensor_types=tuple(sorted((tensor_types or {}).items())),
    )


# ---------------------------------------------------------------------------
# Tensors

def _numpy_shape(tensor) -> tuple[int, ...]:
    """GGUF lists ne0 (the contiguous dimension) first; numpy lists it last."""
    return tuple(int(d) for d in reversed(tensor.shape))


def dequantize_tensor(tensor) -> np.ndarray:
    """A `gguf.ReaderTensor` as a float32 numpy array in numpy order.

    Supports every type `gguf.quants.dequantize` does (F32, F16, BF16,
    Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, IQ*, ...).

    Raises:
      CheckpointError: the quantization type is not supported; names the tensor.
    """
    from gguf.quants import dequantize
    try:
        w = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"tensor {tensor.name!r}: {e}") from e
    return np.asarray(w, dtype=np.float32).reshape(_numpy_shape(tensor))


def _hf_name_map(tensors, arch: str) -> dict[str, Any]:
    """HF name -> ReaderTensor; an unmapped GGUF tensor is an error."""
    out = {}
    for t in tensors:
        hf = gguf_to_hf_name(t.name, arch)
        if hf is None:
            raise CheckpointError(f"GGUF tensor {t.name!r} has no mapping for arch {arch!r}")
        out[hf] = t
    return out


def _tensor_getter(by_hf: Mapping[str, Any], config: ModelConfig, arch: str):
    """get(hf_name) -> float32 [out, in] array, Q/K unpermuted for llama."""
    def get(hf_name: str) -> np.ndarray:
        w = dequantize_tensor(by_hf[hf_name])
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config.num_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config.num_kv_heads)
        return w
    return get


# ---------------------------------------------------------------------------
# Quantized blocks kept as codes and scales

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
    shape = _numpy_shape(tensor)
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


_LINEAR_KINDS = ("q_in", "kv_in", "o_out", "mlp_in", "mlp_out")


def _matmul_weight(by_hf: Mapping[str, Any], config: ModelConfig, arch: str, name: str, shape):
    """One linear weight [out, in] as [in, out]: `quant.BlockCodes` for a
    block type, else float32 (Q/K rows unpermuted for llama either way)."""
    if name not in by_hf:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    tensor = by_hf[name]
    if _numpy_shape(tensor) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {_numpy_shape(tensor)}, but the config "
                              f"implies {tuple(shape)}")
    heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
    perm = next((unpermute_qk(np.arange(shape[0]), n) for suffix, n in heads.items()
                 if arch == "llama" and name.endswith(suffix)), None)
    if tensor.tensor_type.name not in BLOCK_TYPES:
        w = dequantize_tensor(tensor)
        return np.ascontiguousarray((w if perm is None else w[perm]).T)
    w = gguf_block_codes(tensor)
    return w if perm is None else w.take_columns(perm)


def _params_keeping_blocks(by_hf: Mapping[str, Any], config: ModelConfig, arch: str, dtype) -> dict:
    """The params pytree (see `checkpoint.convert`) with every linear weight
    as a tuple of L per-layer [in, out] weights (`_matmul_weight`) in the
    prepared layout's 2-D form (q_proj [D, N*H], o_proj [N*H, D], ...), and
    the LM head [D, V] likewise; a tied model keeps only "lm_head"."""
    get = _tensor_getter(by_hf, config, arch)
    table = _layer_table(config)
    layers = {}
    for key, (suffix, kind) in table.items():
        if kind in _LINEAR_KINDS:
            names = [LAYER_PREFIX.format(i=i) + suffix for i in range(config.num_layers)]
            layers[key] = tuple(_matmul_weight(by_hf, config, arch, n, _hf_shape(kind, config))
                                for n in names)
        else:
            layers[key] = _stack_layer_param(get, by_hf, config, suffix, kind, 0.0, dtype)
    params = {"norm": jnp.asarray(_fetch(get, by_hf, FINAL_NORM, (config.hidden_size,)), dtype),
              "layers": layers}
    shape = (config.vocab_size, config.hidden_size)
    if has_separate_lm_head(config, by_hf):
        params["embed_tokens"] = jnp.asarray(_fetch(get, by_hf, EMBED, shape), dtype)
        params["lm_head"] = _matmul_weight(by_hf, config, arch, LM_HEAD, shape)
    else:
        params["lm_head"] = _matmul_weight(by_hf, config, arch, EMBED if EMBED in by_hf else LM_HEAD,
                                           shape)
    return params


def open_reader(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path` (memory-maps the file; parses every
    metadata field and tensor header, which takes seconds for a large vocabulary).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file (names the file).
    """
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, struct.error) as e:   # bad magic, truncated header
        raise ValueError(f"{path} is not a GGUF file (or is truncated): {e}") from e


def load_gguf(path: str | os.PathLike, dtype=jnp.float32, *, reader=None,
              progress: Optional[Progress] = None,
              keep_quantized: bool = False) -> tuple[ModelConfig, dict, GGUFMetadata]:
    """Read a GGUF file into (config, params, metadata).

    Tensors are dequantized one at a time to float32 on the host, converted
    to the params layout (see `jaxinfer.checkpoint.convert`) and cast to
    `dtype`; peak host memory is roughly the file (memory-mapped) plus one
    stacked float32 param.

    Args:
      path: a `.gguf` file (GGUF v2/v3; spec
        https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
      dtype: jnp dtype of every params leaf.
      reader: an open `gguf.GGUFReader` of `path` to reuse (`open_reader`).
      progress: shows a "loading tensors" bar when enabled.
      keep_quantized: keep every linear weight of a type in BLOCK_TYPES as
        `quant.BlockCodes` (no float32 round trip; see `_params_keeping_blocks`
        for the layout), for `params.prepare_params(..., weights="q4")`;
        other tensors load as above. Peak host memory is then about the file
        plus one tensor's float32 codes (in chunks of 8192 rows).

    Returns:
      config: ModelConfig (tie_word_embeddings says whether "lm_head" exists).
      params: the params pytree, jax arrays.
      metadata: GGUFMetadata (special token ids, chat template, ...).

    Raises:
      CheckpointError: unsupported architecture, quantization or tensor, a
        missing tensor, or a shape that disagrees with the metadata.
      FileNotFoundError / ValueError: an unreadable or non-GGUF file (`open_reader`).
    """
    reader = reader if reader is not None else open_reader(path)
    shapes = {t.name: _numpy_shape(t) for t in reader.tensors}
    config = config_from_gguf(reader.fields, shapes)
    arch = _require(reader.fields, "general.architecture")
    by_hf = _hf_name_map(reader.tensors, arch)
    config = resolve_tied(config, by_hf)
    if keep_quantized:
        params = _params_keeping_blocks(by_hf, config, arch, dtype)
    else:
        with (progress or Progress.off()).bar(len(by_hf), "loading tensors", unit="tensor") as bar:
            params = params_from_hf_tensors(counted(_tensor_getter(by_hf, config, arch), bar), by_hf,
                                            config, dtype)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return config, params, metadata_from_gguf(reader.fields, types)
