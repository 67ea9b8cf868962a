"""GGUF tokenizer metadata -> a Hugging Face `transformers` tokenizer, without PyTorch.

`transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)` builds a
tokenizer from a GGUF's `tokenizer.*` metadata, but its GGUF path imports
torch (its GGUF reader does), and torch is not a jaxinfer dependency. This
module does the torch-dependent part itself and hands the rest to transformers:

  1. read the metadata with `gguf.GGUFReader` (the reader `checkpoint.gguf`
     loads the weights with: one header read serves both), values as
     transformers' reader returns them (`ReaderField.contents()`);
  2. group the `tokenizer.*` keys into transformers' `tokenizer` and
     `tokenizer_config` dicts with its `GGUF_TOKENIZER_MAPPING`, plus the few
     rules of its `get_gguf_tokenizer` (`_gguf_tokenizer_dicts`);
  3. `convert_gguf_tokenizer` (transformers) builds the Rust tokenizer:
     vocab, merges, normalizer, pre-tokenizer, decoder, control and
     user-defined tokens;
  4. wrap it in the tokenizer class `AutoTokenizer` picks for the GGUF's
     architecture (`_gguf_tokenizer_class`: e.g. `GemmaTokenizer` for Gemma 3,
     `TokenizersBackend` for Llama), with the `tokenizer_config` kwargs
     (special tokens, `add_bos_token` / `add_eos_token`, `chat_template`), as
     transformers' `TokenizersBackend.__init__` does for `gguf_file=`.

The tests check the result against a fresh `AutoTokenizer` (with torch) for
SmolLM2 and Gemma 3: same class, same serialized Rust tokenizer, same ids.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from jaxinfer.checkpoint.gguf import open_reader

# Scalar GGUF keys whose ids end generation (llama.cpp's end-of-generation set).
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")
# GGUF `tokenizer.ggml.*` id keys naming the special tokens transformers' tokenizer_config
# gets (as in transformers' `get_gguf_tokenizer`).
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def tokenizer_metadata(reader) -> dict[str, Any]:
    """`general.architecture`, `general.name` and every `tokenizer.*` value of
    a `gguf.GGUFReader`, as Python values (numbers, str, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.") or key in ("general.architecture", "general.name")}


def tokenizer_scalars(reader) -> dict[str, Any]:
    """The non-array `tokenizer.*` values of a `gguf.GGUFReader` (special
    token ids, add_bos/eos flags, model, chat template)."""
    from gguf import GGUFValueType

    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.") and field.types[:1] != [GGUFValueType.ARRAY]}


def read_gguf_tokenizer_scalars(path: str | os.PathLike) -> dict[str, Any]:
    """`tokenizer_scalars` of the GGUF file at `path`.

    Raises:
      FileNotFoundError: no such file.  ValueError: not a GGUF file.
    """
    return tokenizer_scalars(open_reader(path))


def eos_token_ids(reader) -> list[int]:
    """The end-of-generation ids the GGUF names (eos, eot, eom)."""
    scalars = tokenizer_scalars(reader)
    return [int(scalars[k]) for k in EOS_KEYS if k in scalars]


def convert_gguf_tokenizer(path: str | os.PathLike, reader=None):
    """The transformers tokenizer `AutoTokenizer.from_pretrained(folder,
    gguf_file=name)` would build for the GGUF at `path`, built without torch.

    Args:
      path: the .gguf file (its folder becomes the tokenizer's name_or_path).
      reader: an open `gguf.GGUFReader` of `path` to reuse; None opens one.
    Raises:
      ValueError: not a GGUF file, or its tokenizer cannot be converted.
    """
    import pathlib

    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer as convert_backend)

    path = pathlib.Path(path)
    reader = reader if reader is not None else open_reader(path)
    metadata = tokenizer_metadata(reader)
    tensor_names = tuple(t.name for t in reader.tensors)
    try:
        tokenizer_dict, tokenizer_config = _gguf_tokenizer_dicts(metadata, GGUF_TOKENIZER_MAPPING)
        backend, extra_kwargs = convert_backend(metadata.get("general.architecture"), tokenizer_dict)
        tokenizer_class = _gguf_tokenizer_class(metadata, tensor_names)
        # The kwargs `from_pretrained` gives the class for a local `gguf_file` (its other
        # vocab files absent), with the converted backend passed in (`__init__` deep-copies
        # it) and `tokenizer_config` added, as `TokenizersBackend.__init__` adds it after
        # converting.
        absent = {k: None for k in getattr(tokenizer_class, "vocab_files_names", {}) if k != "tokenizer_file"}
        return tokenizer_class(tokenizer_object=backend, name_or_path=str(path.parent), is_local=True,
                               local_files_only=False, added_tokens_decoder={},
                               **{**absent, **tokenizer_config, **extra_kwargs})
    except Exception as e:  # transformers raises several types for unsupported files
        raise ValueError(f"transformers could not build a tokenizer from {path}: {e}") from e


def _gguf_tokenizer_dicts(metadata: Mapping[str, Any],
                          mapping: Mapping[str, Mapping[str, str]]) -> tuple[dict, dict]:
    """transformers' `(tokenizer_dict, tokenizer_config)` for GGUF `metadata`.

    The same dicts as `transformers.integrations.gguf.get_gguf_tokenizer` (which
    reads the file with a torch-importing reader): `tokenizer.*` keys renamed by
    `GGUF_TOKENIZER_MAPPING`, BOS on by default for a SentencePiece ("llama")
    vocabulary and off for "gemma4", and the special tokens as strings.
    """
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in mapping.items()}
    tokenizer, config = grouped.get("tokenizer", {}), grouped.get("tokenizer_config", {})
    tokens = tokenizer.get("tokens")
    if not isinstance(tokens, list):
        raise ValueError("the GGUF has no tokenizer.ggml.tokens vocabulary")
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":
        config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    return tokenizer, config


def _gguf_model_type(metadata: Mapping[str, Any], tensor_names: Sequence[str]) -> str | None:
    """The transformers `model_type` AutoTokenizer derives for a GGUF (its config
    for the file: `get_gguf_config` where transformers has one, else the renames of
    `modeling_gguf_pytorch_utils.load_gguf_checkpoint`)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return None
    try:
        from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS, get_gguf_config
    except ImportError:
        GGUF_CONFIG_ARCHS = {}
    if arch in GGUF_CONFIG_ARCHS:
        try:
            return get_gguf_config(dict(metadata), tuple(tensor_names)).get("model_type")
        except Exception:
            return None
    name = metadata.get("general.name")
    name = name if isinstance(name, str) else ""
    model_type = arch
    if "llama" in arch and name == "mistral":
        model_type = "mistral"
    elif "t5" in arch:
        model_type = "umt5" if "umt5" in name.lower() else "t5"
    if "qwen2moe" in arch:
        model_type = "qwen2_moe"
    elif "gpt_oss" in arch or "gpt-oss" in arch:
        model_type = "gpt_oss"
    elif "qwen3moe" in arch:
        model_type = "qwen3_moe"
    elif "minimax-m2" in arch:
        model_type = "minimax_m2"
    return {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(model_type, model_type)


def _gguf_tokenizer_class(metadata: Mapping[str, Any], tensor_names: Sequence[str]):
    """The tokenizer class AutoTokenizer uses for a GGUF: the one registered for its
    model type (e.g. `GemmaTokenizer` for Gemma 3), else `TokenizersBackend`."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    model_type = _gguf_model_type(metadata, tensor_names)
    name = TOKENIZER_MAPPING_NAMES.get(model_type) if model_type else None
    tokenizer_class = tokenizer_class_from_name(name) if name else None
    # MistralCommonBackend needs mistral-common files a GGUF does not carry; AutoTokenizer
    # then uses TokenizersBackend too.
    if (not isinstance(tokenizer_class, type) or not issubclass(tokenizer_class, TokenizersBackend)
            or tokenizer_class.__name__ == "MistralCommonBackend"):
        return TokenizersBackend
    return tokenizer_class
