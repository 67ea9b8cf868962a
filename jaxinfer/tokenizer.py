"""Tokenizer, chat template and streaming detokenizer, from the checkpoint's own files.

All tokenization is done by Hugging Face `transformers` on its Rust `tokenizers`
backend; nothing here implements BPE or SentencePiece.

* GGUF: the tokenizer `AutoTokenizer.from_pretrained(folder, gguf_file=name)`
  would build, built without PyTorch. transformers' own GGUF path imports torch
  (its GGUF reader does), and torch is not a jaxinfer dependency, so jaxinfer
  does the torch-dependent part itself and hands the rest to transformers:

    1. read the GGUF metadata here (`_read_gguf_metadata`, a plain header
       parser: values as transformers' reader returns them, the vocabulary and
       merges as lists of strings);
    2. group the `tokenizer.*` keys into transformers' `tokenizer` and
       `tokenizer_config` dicts with its `GGUF_TOKENIZER_MAPPING`, plus the few
       rules of its `get_gguf_tokenizer` (`_gguf_tokenizer_dicts`);
    3. `convert_gguf_tokenizer` (transformers) builds the Rust tokenizer:
       vocab, merges, normalizer, pre-tokenizer, decoder, control and
       user-defined tokens;
    4. wrap it in the tokenizer class `AutoTokenizer` picks for the GGUF's
       architecture (`_gguf_tokenizer_class`: e.g. `GemmaTokenizer` for Gemma 3,
       `TokenizersBackend` for Llama), with the `tokenizer_config` kwargs
       (special tokens, `add_bos_token` / `add_eos_token`, `chat_template`),
       as transformers' `TokenizersBackend.__init__` does for `gguf_file=`.

  The tests check the result against a fresh `AutoTokenizer` (with torch) for
  SmolLM2 and Gemma 3: same class, same serialized Rust tokenizer, same ids.
  On a transformers without `transformers.integrations.gguf` (older layouts)
  this falls back to `AutoTokenizer.from_pretrained(..., gguf_file=...)`.

  Conversion takes seconds for a large vocabulary (the merges of Gemma 3's
  262k vocab are rebuilt from the tokens), so the result is saved with
  `save_pretrained` under

      <jaxinfer cache dir>/tokenizers/<gguf stem>-<key>/

  where the key hashes the file's resolved path, size and mtime and the
  transformers/tokenizers versions. Later runs load the saved folder instead.
* Hugging Face folder: `tokenizer.json` + `tokenizer_config.json` (chat
  template inside, or in `chat_template.jinja`), loaded with
  `AutoTokenizer.from_pretrained(folder)`.

`IncrementalDetokenizer` turns a stream of ids into text chunks whose
concatenation equals `Tokenizer.decode` of all ids, holding back characters
whose UTF-8 bytes are not complete yet.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pathlib
import shutil
import struct
import tempfile
import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

_CACHE_FORMAT = 2   # 2: built without torch (see the module docstring)
_META_FILE = "jaxinfer_tokenizer.json"
_REPLACEMENT = "\ufffd"

# Tokens that end a chat turn in common templates. One counts as an EOS id
# when it is in the vocabulary and the chat template's text contains it.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>",
    "<|end_of_text|>", "</s>", "<|return|>", "<|call|>", "<|END_OF_TURN_TOKEN|>",
)

# Scalar GGUF keys whose ids end generation (llama.cpp's end-of-generation set).
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                  "tokenizer.ggml.eom_token_id")


class Tokenizer:
    """Encode text, render chat prompts and decode ids with one HF fast tokenizer.

    Build it with `from_gguf`, `from_pretrained` or `from_source`; the
    constructor wraps an already-loaded `transformers` tokenizer.

    Args:
      hf_tokenizer: a `transformers` tokenizer with a Rust `tokenizers`
        backend (`backend_tokenizer`).
      extra_eos_token_ids: further ids that end generation (from the GGUF
        metadata, or `generation_config.json` / `config.json` of a folder).
      source: where it came from, for messages.

    Raises:
      ValueError: the tokenizer has no `tokenizers` backend.
    """

    def __init__(self, hf_tokenizer, *, extra_eos_token_ids: Iterable[int] = (),
                 source: str | None = None):
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer {type(hf_tokenizer).__name__} from {source} has no "
                             "Rust `tokenizers` backend; jaxinfer needs a fast tokenizer")
        self._hf = hf_tokenizer
        self._backend = backend
        self.source = source
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(
            int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._byte_ids = _byte_fallback_ids(backend)
        self._add_bos = self._detect_add_bos()
        self._eos_ids = self._collect_eos(extra_eos_token_ids)

    # ----- construction -------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, cache: bool = True,
                  cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Tokenizer from a GGUF file's `tokenizer.*` metadata.

        Builds, without PyTorch, the tokenizer `transformers.AutoTokenizer.
        from_pretrained(folder, gguf_file=name)` would (see the module
        docstring). The converted tokenizer is cached and reused when the
        file's path, size and mtime and the library versions are unchanged.

        Args:
          path: a `.gguf` file.
          cache: read and write the converted-tokenizer cache.
          cache_dir: cache root; default `jaxinfer.checkpoint.sources.cache_dir()`
            ($JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer).

        Raises:
          FileNotFoundError: no such file.
          ValueError: not a GGUF file, or transformers cannot convert its tokenizer.
        """
        from transformers import AutoTokenizer

        path = pathlib.Path(path).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        slot = _cache_slot(path, cache_dir) if cache else None
        if slot is not None and (slot / _META_FILE).is_file():
            try:
                meta = json.loads((slot / _META_FILE).read_text())
                hf = AutoTokenizer.from_pretrained(str(slot))
                return cls(hf, extra_eos_token_ids=meta["gguf_eos_token_ids"], source=str(path))
            except Exception as e:  # a damaged cache entry: convert again
                warnings.warn(f"ignoring unreadable tokenizer cache {slot}: {e}", RuntimeWarning)
                shutil.rmtree(slot, ignore_errors=True)
        hf, scalars = _convert_gguf(path)
        eos = [int(scalars[k]) for k in _GGUF_EOS_KEYS if k in scalars]
        if slot is not None:
            _save_to_cache(hf, slot, {"gguf_eos_token_ids": eos, "gguf": str(path)})
        return cls(hf, extra_eos_token_ids=eos, source=str(path))

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Tokenizer from a Hugging Face checkpoint folder.

        Loads `tokenizer.json` / `tokenizer_config.json` (and `chat_template.jinja`)
        with `transformers.AutoTokenizer`. EOS ids from `generation_config.json`
        and `config.json` (an int or a list) join the tokenizer's own.

        Raises:
          FileNotFoundError: the folder has no tokenizer files.
        """
        from transformers import AutoTokenizer

        folder = pathlib.Path(folder).expanduser()
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(f"{folder} holds no tokenizer.json or tokenizer_config.json")
        hf = AutoTokenizer.from_pretrained(str(folder))
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (folder / name).is_file():
                extra += _as_int_list(json.loads((folder / name).read_text()).get("eos_token_id"))
        return cls(hf, extra_eos_token_ids=extra, source=str(folder))

    @classmethod
    def from_source(cls, path: str | os.PathLike, **gguf_kwargs) -> "Tokenizer":
        """`from_gguf` for a `.gguf` file, `from_pretrained` for a folder.

        A folder without tokenizer files but with exactly one `.gguf` file uses
        that file. `gguf_kwargs` go to `from_gguf`.

        Raises:
          FileNotFoundError: nothing usable at `path`.
          ValueError: a folder with several `.gguf` files and no tokenizer files.
        """
        path = pathlib.Path(path).expanduser()
        if path.is_file():
            return cls.from_gguf(path, **gguf_kwargs)
        if not path.is_dir():
            raise FileNotFoundError(f"no tokenizer source at {path}")
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return cls.from_pretrained(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return cls.from_gguf(ggufs[0], **gguf_kwargs)
        if ggufs:
            raise ValueError(f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}")
        raise FileNotFoundError(f"{path} holds no tokenizer files and no .gguf file")

    # ----- properties ---------------------------------------------------

    @property
    def hf_tokenizer(self):
        """The wrapped `transformers` tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (with added tokens). The
        model's embedding may have more rows (padding); ids >= this are invalid here."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def add_bos(self) -> bool:
        """True when `encode(text)` starts the sequence with BOS (the model uses one)."""
        return self._add_bos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's EOS, the checkpoint's EOS ids
        (GGUF `eos/eot/eom_token_id`, or generation_config/config eos_token_id),
        and any `END_OF_TURN_TOKENS` entry in the vocab that the chat template uses."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._hf.pad_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special added tokens: the ones `skip_special_tokens` drops."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        template = self._hf.chat_template
        return template if isinstance(template, str) and template else None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, add_bos={self.add_bos}, eos={sorted(self.eos_token_ids)})")

    # ----- encode / decode ----------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, exactly as the HF tokenizer's `encode`.

        Args:
          text: the string to encode. Special-token strings in it (e.g.
            "<|im_end|>") become their special ids, as in transformers.
          add_special_tokens: add BOS (and whatever the post-processor adds)
            when the model uses it.

        Raises:
          TypeError: `text` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (1-D ints) via the `tokenizers` backend.

        `clean_up_tokenization_spaces` is never applied: the text is the raw
        concatenation of the tokens, like llama.cpp's output, so that streaming
        can reproduce it exactly.

        Raises:
          TypeError: ids are not integers.
          ValueError: ids not 1-D, or an id outside [0, vocab_size).
        """
        return self._backend.decode(self.check_ids(ids), skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Sequence[int] | np.ndarray | int) -> list[int]:
        """`ids` as a list of Python ints, checked against the vocabulary.

        Raises:
          TypeError: not integers.  ValueError: not 1-D, or an id out of range.
        """
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
            ids = [ids]
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return []
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
        out = arr.tolist()
        lo, hi = min(out), max(out)
        if lo < 0 or hi >= self._vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return out

    # ----- chat ---------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """The chat template's text for `messages` (no tokenization).

        Raises:
          ValueError: no chat template, or empty `messages`.
        """
        self._check_chat(messages, template_kwargs)
        return self._hf.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            tokenize=False, **template_kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Prompt ids for `messages` rendered with the checkpoint's chat template.

        Rendering and tokenization are transformers' `apply_chat_template(...,
        tokenize=True)`; then, when the model uses BOS (`add_bos`), the ids are
        made to start with exactly one BOS (a template that writes
        `{{ bos_token }}` keeps its one; a template without it gets one added;
        repeated leading BOS collapse to one).

        Args:
          messages: dicts with "role" and "content" (and whatever else the template reads).
          add_generation_prompt: append the assistant-turn header.
          template_kwargs: passed to transformers (e.g. `chat_template=` to
            override the template, `tools=`, template variables).

        Raises:
          ValueError: no chat template (base models often have none), or empty `messages`.
        """
        self._check_chat(messages, template_kwargs)
        ids = self._hf.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False, **template_kwargs)
        return self._single_bos([int(i) for i in ids])

    def _check_chat(self, messages, template_kwargs) -> None:
        if not self.has_chat_template and not template_kwargs.get("chat_template"):
            raise ValueError(f"the tokenizer from {self.source} has no chat template; "
                             "encode plain text instead, or pass chat_template=")
        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")

    def _single_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if not self._add_bos or bos is None:
            return ids
        start = 0
        while start < len(ids) and ids[start] == bos:
            start += 1
        return [bos] + ids[start:]

    # ----- helpers ------------------------------------------------------

    def _detect_add_bos(self) -> bool:
        bos = self.bos_token_id
        if bos is None:
            return False
        with_special = self._hf.encode("a", add_special_tokens=True)
        without = self._hf.encode("a", add_special_tokens=False)
        return with_special[:1] == [bos] and without[:1] != [bos]

    def _collect_eos(self, extra: Iterable[int]) -> frozenset[int]:
        ids = set(_as_int_list(self._hf.eos_token_id)) | set(_as_int_list(list(extra)))
        template = self.chat_template or ""
        for token in END_OF_TURN_TOKENS:
            if token in template:
                tid = self._backend.token_to_id(token)
                if tid is not None:
                    ids.add(int(tid))
        return frozenset(i for i in ids if 0 <= i < self._vocab_size)


class IncrementalDetokenizer:
    """Streams the text of a growing id sequence, one chunk per `push`.

    Invariant (for any ids and any chunking):
        "".join(push(c) for c in chunks) + flush() == tokenizer.decode(all ids, skip_special_tokens)
    and a chunk never ends in a half-finished character: text whose UTF-8
    bytes may still be completed (or, with SentencePiece byte fallback, a run
    of `<0xNN>` tokens that may still grow) is held back until it is final.
    A U+FFFD that is in the full decode (invalid bytes) comes out once final,
    at the latest at `flush`.

    Method (as vLLM's detokenizer): decode only a window `ids[prefix:]` and
    emit its text beyond `decode(ids[prefix:read])`; the context tokens
    `ids[prefix:read]` keep leading-space handling (Strip/Metaspace decoders)
    identical to the full decode. Window boundaries are only placed where the
    decode so far is final, so window texts add up to the full text. Work per
    push is proportional to the new tokens plus the held-back ones.

    Args:
      tokenizer: a `Tokenizer`.
      skip_special_tokens: as in `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer._byte_ids
        self._ids: list[int] = []      # ids kept for decoding (special ids dropped when skipped)
        self._prefix = 0               # window start: context tokens begin here
        self._read = 0                 # text of ids[:read] has been emitted
        self._prefix_text = ""         # decode(ids[prefix:read])
        self._emitted = 0              # characters emitted so far
        self._full_mode = False        # fallback: diff against full decodes
        self._done = False

    def push(self, ids: Sequence[int] | np.ndarray | int) -> str:
        """Add token ids; return the text that became final.

        Raises:
          ValueError / TypeError: as `Tokenizer.check_ids`.
          RuntimeError: called after `flush`.
        """
        if self._done:
            raise RuntimeError("push() after flush(): make a new IncrementalDetokenizer")
        new = self._tok.check_ids(ids)
        self._ids.extend(i for i in new if i not in self._skip)
        end = len(self._ids)
        while end > self._read and self._ids[end - 1] in self._byte_ids:
            end -= 1                   # a byte-fallback run may still grow: its text is not final
        if end <= self._read:
            return ""
        return self._advance(end, final=False)

    def flush(self) -> str:
        """Return all remaining text (held-back bytes decode as U+FFFD, as in
        the full decode). Afterwards `push` raises; `flush` returns ""."""
        if self._done:
            return ""
        self._done = True
        if len(self._ids) <= self._read:
            return ""
        return self._advance(len(self._ids), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tok._backend.decode(ids, skip_special_tokens=False)

    def _advance(self, end: int, final: bool) -> str:
        if self._full_mode:
            return self._advance_full(end, final)
        window = self._decode(self._ids[self._prefix:end])
        if not window.startswith(self._prefix_text):
            self._full_mode = True     # a decoder this method does not model: stay exact
            warnings.warn("IncrementalDetokenizer: windowed decode is not prefix-consistent for this "
                          "tokenizer; falling back to full decodes", RuntimeWarning, stacklevel=3)
            return self._advance_full(end, final)
        text = window[len(self._prefix_text):]
        if not final and text.endswith(_REPLACEMENT):
            return ""                  # maybe an incomplete character: wait for more ids
        self._prefix_text = self._decode(self._ids[self._read:end])
        self._prefix, self._read = self._read, end
        self._emitted += len(text)
        return text

    def _advance_full(self, end: int, final: bool) -> str:
        full = self._decode(self._ids[:end])
        text = full[self._emitted:]
        if not final and text.endswith(_REPLACEMENT):
            return ""
        self._read = end
        self._emitted = len(full)
        return text


# ----- module helpers ----------------------------------------------------

def _as_int_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _byte_fallback_ids(backend) -> frozenset[int]:
    """Ids of `<0xNN>` tokens when the decoder has SentencePiece ByteFallback, else empty."""
    decoder = backend.decoder
    if decoder is None or b"ByteFallback" not in decoder.__getstate__():
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(int(i) for i in ids if i is not None)


def _cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    from jaxinfer.checkpoint.sources import cache_dir as default_cache_dir

    return default_cache_dir()


def _cache_slot(path: pathlib.Path, cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Cache folder for the tokenizer converted from the GGUF at `path`."""
    import tokenizers
    import transformers

    st = path.stat()
    key = json.dumps([str(path), st.st_size, st.st_mtime_ns, transformers.__version__,
                      tokenizers.__version__, _CACHE_FORMAT])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return _cache_root(cache_dir) / "tokenizers" / f"{path.stem}-{digest}"


def _save_to_cache(hf, slot: pathlib.Path, meta: dict) -> None:
    """Write `hf` to `slot` atomically (temp folder + rename); warn, don't fail, on OSError."""
    tmp = None
    try:
        slot.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=slot.parent))
        hf.save_pretrained(str(tmp))
        (tmp / _META_FILE).write_text(json.dumps(meta, indent=1))
        os.rename(tmp, slot)
        tmp = None
    except OSError as e:
        if not (slot / _META_FILE).is_file():  # not just a concurrent writer that won
            warnings.warn(f"could not cache the converted tokenizer in {slot}: {e}", RuntimeWarning)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ----- GGUF -> transformers tokenizer, without torch ----------------------

# GGUF `tokenizer.ggml.*` id keys naming the special tokens transformers' tokenizer_config
# gets (as in transformers' `get_gguf_tokenizer`).
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
# The string arrays the tokenizer needs in full; any other string array is only counted.
_GGUF_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def _convert_gguf(path: pathlib.Path):
    """`(transformers tokenizer, tokenizer.* scalars)` for the GGUF at `path`, built as
    `AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)` builds it, but
    without importing torch (see the module docstring).

    Raises:
      ValueError: not a GGUF file, or its tokenizer cannot be converted.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    except ImportError:   # a transformers without this layout: its own (torch-needing) path
        return _convert_gguf_with_auto_tokenizer(path), read_gguf_tokenizer_scalars(path)

    metadata, array_keys, tensor_names = _read_gguf_metadata(
        path, string_arrays=_GGUF_STRING_ARRAYS, tensor_names=True)
    scalars = {k: v for k, v in metadata.items() if k.startswith("tokenizer.") and k not in array_keys}
    try:
        tokenizer_dict, tokenizer_config = _gguf_tokenizer_dicts(metadata, GGUF_TOKENIZER_MAPPING)
        backend, extra_kwargs = convert_gguf_tokenizer(metadata.get("general.architecture"),
                                                       tokenizer_dict)
        tokenizer_class = _gguf_tokenizer_class(metadata, tensor_names)
        # The kwargs `from_pretrained` gives the class for a local `gguf_file` (its other
        # vocab files absent), with the converted backend passed in (`__init__` deep-copies
        # it: ~2 s for Gemma 3) and `tokenizer_config` added, as `TokenizersBackend.__init__`
        # adds it after converting.
        absent = {k: None for k in getattr(tokenizer_class, "vocab_files_names", {}) if k != "tokenizer_file"}
        hf = tokenizer_class(tokenizer_object=backend, name_or_path=str(path.parent), is_local=True,
                             local_files_only=False, added_tokens_decoder={},
                             **{**absent, **tokenizer_config, **extra_kwargs})
    except Exception as e:  # transformers raises several types for unsupported files
        raise ValueError(f"transformers could not build a tokenizer from {path}: {e}") from e
    return hf, scalars


def _convert_gguf_with_auto_tokenizer(path: pathlib.Path):
    from transformers import AutoTokenizer

    read_gguf_tokenizer_scalars(path)             # a clear error for a non-GGUF file
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
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


# ----- GGUF header reader --------------------------------------------------

# GGUF value types (ggml gguf.h): struct format of the fixed-size ones.
_GGUF_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
               10: "<u8", 11: "<i8", 12: "<f8"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_tokenizer_scalars(path: str | os.PathLike) -> dict[str, Any]:
    """Scalar and string `tokenizer.*` values of a GGUF (v2/v3, little-endian) header.

    Arrays (the vocabulary itself) are skipped, so this takes ~0.1 s even for
    a 262k vocab, where `gguf.GGUFReader` takes ~10 s.

    Raises:
      ValueError: not a GGUF v2/v3 little-endian file.
    """
    metadata, array_keys, _ = _read_gguf_metadata(path, arrays=False)
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") and k not in array_keys}


def _read_gguf_metadata(path: str | os.PathLike, *, arrays: bool = True,
                        string_arrays: Iterable[str] = (), tensor_names: bool = False
                        ) -> tuple[dict[str, Any], frozenset[str], tuple[str, ...]]:
    """`(metadata, array_keys, tensor_names)` of a GGUF v2/v3 file, reading no tensor data.

    Values as transformers' GGUF reader (`read_gguf_metadata`) returns them: numbers
    as Python ints/floats/bools, strings as str, numeric arrays as lists, the string
    arrays named in `string_arrays` as lists of str (strict UTF-8, like transformers)
    and any other string array as its length. With `arrays=False` every array is
    skipped (absent from `metadata`, but listed in `array_keys`). Tensor names only
    with `tensor_names=True`.

    Used instead of `gguf.GGUFReader`, which builds numpy views of every field
    and tensor (~10 s for Gemma 3's 262k vocab; this takes well under a second).

    Raises:
      ValueError: not a GGUF v2/v3 little-endian file.
    """
    keep_strings = frozenset(string_arrays)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
            try:
                pos, metadata, array_keys = 24, {}, set()
                for _ in range(n_kv):
                    key, pos = _gguf_string(m, pos)
                    (vtype,), pos = struct.unpack_from("<I", m, pos), pos + 4
                    if vtype == _GGUF_ARRAY:
                        array_keys.add(key)
                    value, pos = _gguf_value(m, pos, vtype, arrays, key in keep_strings)
                    if value is not _SKIPPED:
                        metadata[key] = value
                names = []
                if tensor_names:
                    for _ in range(n_tensors):
                        name, pos = _gguf_string(m, pos)
                        (n_dims,) = struct.unpack_from("<I", m, pos)
                        pos += 4 + 8 * n_dims + 12          # dims, ggml type, data offset
                        names.append(name)
            except (struct.error, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt GGUF header: {e}") from e
    return metadata, frozenset(array_keys), tuple(names)


_SKIPPED = object()


def _gguf_string(m, pos: int, errors: str = "replace") -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, pos)
    if pos + 8 + n > len(m):
        raise struct.error(f"string of {n} bytes at byte {pos} runs past the end of the file")
    return m[pos + 8:pos + 8 + n].decode("utf-8", errors=errors), pos + 8 + n


def _gguf_value(m, pos: int, vtype: int, arrays: bool = False, strings: bool = False):
    """`(value, position after it)`; an array is `_SKIPPED` unless `arrays`, and a
    string array is its length unless `strings` too."""
    if vtype in _GGUF_FIXED:
        fmt = _GGUF_FIXED[vtype]
        return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _GGUF_STRING:
        return _gguf_string(m, pos)
    if vtype != _GGUF_ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype} at byte {pos}")
    etype, count = struct.unpack_from("<IQ", m, pos)
    pos += 12
    if etype in _GGUF_FIXED:
        end = pos + count * struct.calcsize(_GGUF_FIXED[etype])
        if end > len(m):
            raise struct.error(f"array of {count} values at byte {pos} runs past the end of the file")
        if not arrays:
            return _SKIPPED, end
        return np.frombuffer(m[pos:end], dtype=_GGUF_NUMPY[etype]).tolist(), end
    if etype == _GGUF_STRING:
        if arrays and strings:
            out = []
            for _ in range(count):
                value, pos = _gguf_string(m, pos, errors="strict")
                out.append(value)
            return out, pos
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(m, pos)[0]
        return (count if arrays else _SKIPPED), pos
    out = []
    for _ in range(count):
        value, pos = _gguf_value(m, pos, etype, arrays, strings)
        out.append(value)
    return (out if arrays else _SKIPPED), pos
