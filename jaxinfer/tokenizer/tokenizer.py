"""Tokenizer and chat template, from the checkpoint's own files.

Encoding and decoding run on Hugging Face's Rust `tokenizers`; chat templates
render with jinja2 as transformers renders them (`jaxinfer.tokenizer.chat`).
Nothing here implements BPE or SentencePiece. `transformers` builds the
tokenizer when a source is first seen; a cached load does not import it.

* GGUF: the tokenizer `AutoTokenizer.from_pretrained(folder, gguf_file=name)`
  would build, built without PyTorch from the GGUF's `tokenizer.*` metadata
  (`jaxinfer.tokenizer.gguf`, which reads the file with the same
  `gguf.GGUFReader` the weights are loaded with).

  Conversion is slow for a large vocabulary (the merges of Gemma 3's 262k
  vocab are rebuilt from the tokens), so the result is cached
  (`jaxinfer.tokenizer.cache`); a cached load reads `tokenizer.json` with
  `tokenizers` alone and never opens the GGUF. A damaged entry is reported
  as one line on the `jaxinfer.tokenizer.tokenizer` logger (warning level;
  stderr when logging is not configured) and converted again.
* Hugging Face folder: `tokenizer.json` + `tokenizer_config.json` (chat
  template inside, or in `chat_template.jinja`), loaded with
  `AutoTokenizer.from_pretrained(folder)`.

The streaming detokenizer is `jaxinfer.tokenizer.detokenizer`.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from jaxinfer.tokenizer import (cache as tokenizer_cache, chat as chat_render,
                                gguf as gguf_tokenizer, template_setting)
from jaxinfer.checkpoint.gguf import open_reader

log = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"

# Tokens that end a chat turn in common templates. One counts as an EOS id
# when it is in the vocabulary and the chat template's text contains it.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>",
    "<|end_of_text|>", "</s>", "<|return|>", "<|call|>", "<|END_OF_TURN_TOKEN|>",
)

class Tokenizer:
    """Encode text, render chat prompts and decode ids with one Rust `tokenizers` tokenizer.

    Build it with `from_gguf`, `from_pretrained` or `from_source`; the
    constructor wraps an already-loaded `transformers` fast tokenizer and
    copies what it needs from it (the Rust tokenizer, the special tokens and
    the chat template).

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
        self._hf_loader = None
        self._setup(backend, tokenizer_cache.special_tokens_of(hf_tokenizer),
                    hf_tokenizer.chat_template, extra_eos_token_ids, source)

    @classmethod
    def from_parts(cls, backend, special_tokens: Mapping[str, Any],
                   chat_template: str | Mapping[str, str] | None, *,
                   extra_eos_token_ids: Iterable[int] = (), source: str | None = None,
                   hf_loader=None) -> "Tokenizer":
        """A tokenizer from its parts, without transformers.

        Args:
          backend: a `tokenizers.Tokenizer` (encodes with its own settings;
            truncation and padding are turned off on it).
          special_tokens: transformers' `special_tokens_map` ("bos_token",
            "eos_token", "pad_token", ... -> token strings); the chat template
            sees them as variables.
          chat_template: Jinja2 source, a dict of named templates, or None.
          extra_eos_token_ids, source: as for the constructor.
          hf_loader: a function returning the equivalent `transformers`
            tokenizer, called once when `hf_tokenizer` is first read.
        """
        self = cls.__new__(cls)
        self._hf = None
        self._hf_loader = hf_loader
        self._setup(backend, special_tokens, chat_template, extra_eos_token_ids, source)
        return self

    def _setup(self, backend, special_tokens, chat_template, extra_eos_token_ids, source) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.source = source
        self._special_tokens = {k: v for k, v in dict(special_tokens).items() if v is not None}
        self._chat_templates = chat_template
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self._special_ids = frozenset(
            int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._byte_ids = _byte_fallback_ids(backend)
        self._bos_id = self._token_id("bos_token")
        self._add_bos = self._detect_add_bos()
        self._eos_ids = self._collect_eos(extra_eos_token_ids)

    # ----- construction -------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, cache: bool = True,
                  cache_dir: str | os.PathLike | None = None, reader=None) -> "Tokenizer":
        """Tokenizer from a GGUF file's `tokenizer.*` metadata.

        Builds, without PyTorch, the tokenizer `transformers.AutoTokenizer.
        from_pretrained(folder, gguf_file=name)` would (see
        `jaxinfer.tokenizer.gguf`). The converted tokenizer is
        cached and reused when the file's path, size and mtime and the
        library versions are unchanged; a cached load does not open the GGUF.

        Args:
          path: a `.gguf` file.
          cache: read and write the converted-tokenizer cache.
          cache_dir: cache root; default `jaxinfer.checkpoint.sources.cache_dir()`
            ($JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer).
          reader: a `gguf.GGUFReader` of `path`, or a function returning one,
            used when the tokenizer must be converted (so the caller's one
            header read serves both); None opens the file.

        Raises:
          FileNotFoundError: no such file.
          ValueError: not a GGUF file, or transformers cannot convert its tokenizer.
        """

        path = pathlib.Path(path).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        slot = tokenizer_cache.slot(path, cache_dir) if cache else None
        if slot is not None and tokenizer_cache.holds(slot):
            try:
                backend, meta, hf_loader = tokenizer_cache.load(slot)
                return cls.from_parts(backend, meta["special_tokens"], meta["chat_template"],
                                      extra_eos_token_ids=meta["gguf_eos_token_ids"],
                                      source=str(path), hf_loader=hf_loader)
            except Exception as e:  # a damaged cache entry: convert again
                log.warning("jaxinfer tokenizer cache: ignoring unreadable %s: %s; converting again",
                            slot, e)
                shutil.rmtree(slot, ignore_errors=True)
        reader = reader() if callable(reader) else reader
        if reader is None:
            reader = open_reader(path)
        hf = gguf_tokenizer.convert_gguf_tokenizer(path, reader)
        eos = gguf_tokenizer.eos_token_ids(reader)
        if slot is not None:
            tokenizer_cache.save(hf, slot, extra={"gguf_eos_token_ids": eos, "gguf": str(path)})
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
        """The equivalent `transformers` tokenizer: the wrapped one, or one built
        on first read by the `hf_loader` of `from_parts` (a cached GGUF
        conversion: its folder loaded with its class). jaxinfer does not use it.

        Raises:
          ValueError: built by `from_parts` without an `hf_loader`.
        """
        if self._hf is None:
            if self._hf_loader is None:
                raise ValueError(f"the tokenizer from {self.source} was built from its parts "
                                 "and has no transformers tokenizer")
            self._hf = self._hf_loader()
        return self._hf

    @property
    def backend(self):
        """The Rust `tokenizers.Tokenizer` that encodes and decodes."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (with added tokens). The
        model's embedding may have more rows (padding); ids >= this are invalid here."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

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
        return self._token_id("pad_token")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special added tokens: the ones `skip_special_tokens` drops."""
        return self._special_ids

    @property
    def special_tokens(self) -> dict[str, Any]:
        """transformers' `special_tokens_map`: "bos_token", "eos_token", ... ->
        token strings, as the chat template sees them."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja2 source (the "default" one of a named set),
        or None. Settable; EOS ids stay as collected at construction."""
        template = self._chat_templates
        if isinstance(template, Mapping):
            template = template.get("default")
        return template if isinstance(template, str) and template else None

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_templates = template

    replace_chat_template = template_setting.replace_chat_template   # the chat_template setting

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def renders_tools(self) -> bool:
        """True when the chat template reads a `tools` variable (so tools
        passed to `apply_chat_template(..., tools=)` reach the prompt). Decided
        from the parsed template's undeclared variables; a template that does
        not parse is searched for the word `tools` instead."""
        template = self.chat_template
        return template is not None and chat_render.reads_variable(template, "tools")

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, add_bos={self.add_bos}, eos={sorted(self.eos_token_ids)})")

    # ----- encode / decode ----------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, exactly as the HF tokenizer's `encode` (which
        calls the same Rust `encode` with truncation and padding off).

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
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

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

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, Any]], chat: bool = False,
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids: text encoded as is (BOS added when the model uses one),
        or, with `chat` or for a message list, rendered with the chat template
        (a text `prompt` becomes one user turn) and tokenized. `tools` (OpenAI
        tool dicts), when given, are passed to the template as `tools`.

        Raises:
          ValueError: chat without a chat template, empty messages, or tools
            for a template that does not render them (`renders_tools`).
          TypeError: text that is not a str.
        """
        if isinstance(prompt, str) and not chat and not tools:
            return self.encode(prompt)
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: use a raw prompt (chat: false)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not tools:
            return self.apply_chat_template(messages)
        if not self.renders_tools:
            raise ValueError("this model's chat template does not render tools")
        return self.apply_chat_template(messages, tools=[dict(t) for t in tools])

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """The chat template's text for `messages` (no tokenization), rendered
        as transformers' `apply_chat_template(..., tokenize=False)` renders it
        (`jaxinfer.tokenizer.chat`).

        Args:
          messages: dicts with "role" and "content" (and whatever else the template reads).
          add_generation_prompt: append the assistant-turn header.
          template_kwargs: `chat_template=` (Jinja2 source, or the name of one
            of the checkpoint's named templates), `tools=` (JSON-schema dicts),
            `documents=`, and any other template variable.

        Raises:
          ValueError: no chat template, or empty `messages`.
          TypeError: a message or tool that is not a dict.
          jinja2.TemplateError: the template failed or called `raise_exception`.
        """
        self._check_chat(messages, template_kwargs)
        template = self._template_for(template_kwargs.pop("chat_template", None),
                                      template_kwargs.get("tools"))
        return chat_render.render(template, messages, add_generation_prompt=add_generation_prompt,
                                  special_tokens=self._special_tokens, **template_kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Prompt ids for `messages` rendered with the checkpoint's chat template.

        The text of `render_chat`, encoded without added special tokens (as
        transformers' `apply_chat_template(..., tokenize=True)`); then, when the
        model uses BOS (`add_bos`), the ids are made to start with exactly one
        BOS (a template that writes `{{ bos_token }}` keeps its one; a template
        without it gets one added; repeated leading BOS collapse to one).

        Args and Raises: as for `render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self._single_bos(self.encode(text, add_special_tokens=False))

    def _template_for(self, chat_template: str | None, tools) -> str:
        """The template to render: `chat_template` (source, or a name in the
        checkpoint's named set), else the checkpoint's ("tool_use" from a named
        set when tools are given, as transformers picks it)."""
        named = self._chat_templates if isinstance(self._chat_templates, Mapping) else {}
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        return self.chat_template

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

    def _token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        tid = self._backend.token_to_id(token) if isinstance(token, str) else None
        return None if tid is None else int(tid)

    def _detect_add_bos(self) -> bool:
        bos = self.bos_token_id
        if bos is None:
            return False
        with_special = self.encode("a", add_special_tokens=True)
        without = self.encode("a", add_special_tokens=False)
        return with_special[:1] == [bos] and without[:1] != [bos]

    def _collect_eos(self, extra: Iterable[int]) -> frozenset[int]:
        ids = set(_as_int_list(self._token_id("eos_token"))) | set(_as_int_list(list(extra)))
        template = self.chat_template or ""
        for token in END_OF_TURN_TOKENS:
            if token in template:
                tid = self._backend.token_to_id(token)
                if tid is not None:
                    ids.add(int(tid))
        return frozenset(i for i in ids if 0 <= i < self._vocab_size)


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
