"""GGUF checkpoint reader: metadata -> ModelConfig, tensors -> params pytree.

Format: GGUF spec, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
Parsing and dequantization use the `gguf` package (`GGUFReader`,
`gguf.quants.dequantize`); this module finds the family of the file's
`general.architecture` (`jaxinfer.models`) and reads what it says:

* Config: the family's `config_from_gguf` reads the `{arch}.*` keys.
* Names: the family's `gguf_names` maps GGUF tensor names onto Hugging Face
  names; `convert.params_from_hf_tensors` then builds the params.
* Dimensions: a GGUF tensor lists its dimensions fastest-first (`ne0` is
  the row length), the reverse of numpy order, so a linear weight listed as
  `[in, out]` is read as numpy `[out, in]`, the PyTorch `nn.Linear` layout.
* Layout fixes: the family's `gguf_row_order` (llama.cpp's Q/K permute for
  arch "llama", `models.llama.unpermute_qk`), applied alike to dequantized
  tensors and to blocks kept quantized (`gguf_blocks`). Gemma norms need
  none: llama.cpp stores them with the `+1` folded in.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import struct
from collections import Counter
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.checkpoint.convert import (EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD, CheckpointError,
                                         _fetch, _hf_shape, _stack_layer_param, counted,
                                         has_separate_lm_head, layer_table, params_from_hf_tensors,
                                         resolve_tied)
from jaxinfer.checkpoint.gguf_blocks import BLOCK_TYPES, gguf_block_codes, numpy_shape
from jaxinfer.config import ModelConfig
from jaxinfer.models.gguf_keys import check_rope_scaling, get as _get, require as _require
from jaxinfer.progress import Progress

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


def _family(arch: str) -> models.Family:
    """The family reading GGUF architecture `arch`.

    Raises:
      CheckpointError: none does (names the architectures that are read).
    """
    family = models.family_for_gguf(arch)
    if family is None:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; expected one of "
                              f"{models.gguf_architectures()}")
    return family


def gguf_to_hf_name(gguf_name: str, arch: str) -> Optional[str]:
    """The HF name for a GGUF tensor name under GGUF architecture `arch`
    (the family's `gguf_names`), or None if unmapped or no family reads `arch`."""
    family = models.family_for_gguf(arch)
    match = _BLOCK.fullmatch(gguf_name)
    key, layer = (f"blk.{{i}}.{match.group(2)}", match.group(1)) if match else (gguf_name, None)
    hf = family.gguf_names.get(key) if family is not None else None
    if hf is None:
        return None
    return hf.format(i=layer) if layer is not None else hf


def config_from_gguf(fields: Mapping[str, Any],
                     tensor_shapes: Optional[Mapping[str, tuple[int, ...]]] = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (the family's `config_from_gguf`).

    Args:
      fields: `gguf.GGUFReader(path).fields` (key -> ReaderField).
      tensor_shapes: GGUF tensor name -> numpy-order shape, used to detect a
        tied LM head (no `output.weight`), q/k/v biases and the vocab size
        when `{arch}.vocab_size` is absent (else the token list length).
        Without it the model is taken as tied and bias-free.

    Returns:
      ModelConfig whose arch is the family's name ("llama", "gemma3", "qwen3").

    Raises:
      CheckpointError: unsupported architecture or RoPE scaling, or missing
        required metadata keys.
    """
    arch = _require(fields, "general.architecture")
    family = _family(arch)
    check_rope_scaling(fields, arch, tensor_shapes)
    return family.config_from_gguf(fields, arch, tensor_shapes)


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
    return np.asarray(w, dtype=np.float32).reshape(numpy_shape(tensor))


def _hf_name_map(tensors, arch: str) -> dict[str, Any]:
    """HF name -> ReaderTensor; an unmapped GGUF tensor is an error."""
    out = {}
    for t in tensors:
        hf = gguf_to_hf_name(t.name, arch)
        if hf is None:
            raise CheckpointError(f"GGUF tensor {t.name!r} has no mapping for arch {arch!r}")
        out[hf] = t
    return out


def _tensor_getter(by_hf: Mapping[str, Any], config: ModelConfig):
    """get(hf_name) -> float32 [out, in] array, rows in the family's
    `gguf_row_order` (Q/K unpermuted for llama)."""
    order = models.family(config.arch).gguf_row_order

    def get(hf_name: str) -> np.ndarray:
        w = dequantize_tensor(by_hf[hf_name])
        perm = order(hf_name, w.shape[0], config)
        return w if perm is None else w[perm]
    return get


_LINEAR_KINDS = ("q_in", "kv_in", "o_out", "mlp_in", "mlp_out")


def _matmul_weight(by_hf: Mapping[str, Any], config: ModelConfig, name: str, shape):
    """One linear weight [out, in] as [in, out]: `quant.BlockCodes` for a
    block type, else float32 (rows in the family's `gguf_row_order` either way)."""
    if name not in by_hf:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    tensor = by_hf[name]
    if numpy_shape(tensor) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {numpy_shape(tensor)}, but the config "
                              f"implies {tuple(shape)}")
    perm = models.family(config.arch).gguf_row_order(name, shape[0], config)
    if tensor.tensor_type.name not in BLOCK_TYPES:
        w = dequantize_tensor(tensor)
        return np.ascontiguousarray((w if perm is None else w[perm]).T)
    w = gguf_block_codes(tensor)
    return w if perm is None else w.take_columns(perm)


def _params_keeping_blocks(by_hf: Mapping[str, Any], config: ModelConfig, dtype) -> dict:
    """The params pytree (see `checkpoint.convert`) with every linear weight
    as a tuple of L per-layer [in, out] weights (`_matmul_weight`) in the
    prepared layout's 2-D form (q_proj [D, N*H], o_proj [N*H, D], ...), and
    the LM head [D, V] likewise; a tied model keeps only "lm_head"."""
    get = _tensor_getter(by_hf, config)
    layers = {}
    for key, (suffix, kind) in layer_table(config).items():
        if kind in _LINEAR_KINDS:
            names = [LAYER_PREFIX.format(i=i) + suffix for i in range(config.num_layers)]
            layers[key] = tuple(_matmul_weight(by_hf, config, n, _hf_shape(kind, config))
                                for n in names)
        else:
            layers[key] = _stack_layer_param(get, by_hf, config, suffix, kind, 0.0, dtype)
    params = {"norm": jnp.asarray(_fetch(get, by_hf, FINAL_NORM, (config.hidden_size,)), dtype),
              "layers": layers}
    shape = (config.vocab_size, config.hidden_size)
    if has_separate_lm_head(config, by_hf):
        params["embed_tokens"] = jnp.asarray(_fetch(get, by_hf, EMBED, shape), dtype)
        params["lm_head"] = _matmul_weight(by_hf, config, LM_HEAD, shape)
    else:
        params["lm_head"] = _matmul_weight(by_hf, config, EMBED if EMBED in by_hf else LM_HEAD, shape)
    return params


@functools.cache
def _reader_class():
    """`gguf.GGUFReader` with its per-element parsing of array fields made cheap.

    The package's reader slices its `np.memmap` once per array element, and
    each slice of a memmap runs the subclass's Python hooks, which makes a
    large vocabulary slow to open (benchmarks/README.md, "GGUF header"). This subclass reads
    through a plain ndarray view of the same mapping and parses arrays of
    numbers and of strings in one pass each, building the same
    `ReaderField`s (one part per element, as the package does, so
    `contents()` and `len(field.data)` are unchanged). A file in the other
    byte order takes the package's own path. A string array running past
    the end of the file raises ValueError.
    """
    from gguf import GGUFReader, GGUFValueType

    class FastGGUFReader(GGUFReader):
        def _plain(self) -> np.ndarray:
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            return plain

        def _get(self, offset, dtype, count=1, override_order=None):
            dtype = np.dtype(dtype)
            count = int(count)
            arr = self._plain()[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            parts: list = [raw_itype, alen]
            if itype == GGUFValueType.STRING:
                plain, lengths = self._plain(), np.dtype("<u8")
                for _ in range(count):
                    n = int.from_bytes(plain[offs:offs + 8].tobytes(), "little")
                    if offs + 8 + n > plain.size:
                        raise ValueError(f"a string array at byte {orig_offs} runs past the end of the file")
                    parts += (plain[offs:offs + 8].view(lengths), plain[offs + 8:offs + 8 + n])
                    offs += 8 + n
                return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), [GGUFValueType.ARRAY, itype]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:   # nested arrays: the package's own recursion
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, count)
            parts += (values[i:i + 1] for i in range(count))
            return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), [GGUFValueType.ARRAY, itype]

    return FastGGUFReader


def open_reader(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path` (memory-maps the file; parses every
    metadata field and tensor header, array fields in one pass each:
    `_reader_class`).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file (names the file).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return _reader_class()(path)
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
        for the layout), for `weights.prepare.prepare_params(..., weights="q4")`;
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
    shapes = {t.name: numpy_shape(t) for t in reader.tensors}
    config = config_from_gguf(reader.fields, shapes)
    by_hf = _hf_name_map(reader.tensors, _require(reader.fields, "general.architecture"))
    config = resolve_tied(config, by_hf)
    if keep_quantized:
        params = _params_keeping_blocks(by_hf, config, dtype)
    else:
        with (progress or Progress.off()).bar(len(by_hf), "loading tensors", unit="tensor") as bar:
            params = params_from_hf_tensors(counted(_tensor_getter(by_hf, config), bar), by_hf,
                                            config, dtype)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return config, params, metadata_from_gguf(reader.fields, types)
