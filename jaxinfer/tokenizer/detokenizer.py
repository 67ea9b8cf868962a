"""Streaming detokenization: a growing id sequence -> text chunks whose
concatenation equals `Tokenizer.decode` of all ids, holding back characters
whose UTF-8 bytes are not complete yet."""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from jaxinfer.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


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
