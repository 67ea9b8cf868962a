"""Constraints masked on the host (`grammar.HostGrammar`): llguidance
(github.com/guidance-ai/llguidance) parses a row's output so far and gives
the next token's bitmask; `grammar.GrammarPool` puts it on the device
(`GrammarTables.live`). Used for context-free grammars (GBNF or Lark) and
for automata too large for the device tables (`grammar.GrammarCompiler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Iterator, Sequence

import llguidance
import llguidance.numpy
import numpy as np
from outlines_core.json_schema import WHITESPACE

from jaxinfer.config.sampling import StructuredOutput

ANY_OBJECT = '{"type": "object"}'


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` added to every object
    schema that lists `properties` and does not say: outlines-core reads
    such an object as closed, the JSON Schema default (and llguidance) as
    open. Nothing else changes; the input is not modified."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def host_grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec` (its `grammar_from`: a GBNF or Lark
    grammar, a regex or a choice list). A JSON schema is read as
    outlines-core reads it on the device: objects that list their
    properties are closed (`closed_objects`), with outlines-core's
    whitespace rule between JSON tokens.

    Raises:
      ValueError: a grammar llguidance cannot convert (naming the problem).
    """
    if spec.grammar is not None:
        kind, text = "grammar", spec.grammar
    elif spec.regex is not None:
        kind, text = "regex", spec.regex
    elif spec.choice is not None:
        kind, text = "choice", json.dumps(list(spec.choice))
    else:
        kind, text = "json_schema", ANY_OBJECT if spec.json_object else spec.json_schema
    with library_errors("structured output"):
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed_objects(json.loads(text))), overrides={"whitespace_pattern": WHITESPACE})
        return llguidance.grammar_from(kind, text)


@contextlib.contextmanager
def library_errors(what: str) -> Iterator[None]:
    """Raise what a grammar library (llguidance, outlines-core) raises in the
    block, its Rust panics (BaseException) included, as ValueError("<what>:
    <message>"); KeyboardInterrupt and SystemExit pass through."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # the library's errors, and a Rust panic (a BaseException)
        raise ValueError(f"{what}: {e}") from None


class TokenTable:
    """What `llguidance.TokenizerWrapper` reads: every id's bytes (`pieces`,
    `grammar.token_bytes`; special tokens by their text, marked special),
    the EOS id and an encoder."""

    def __init__(self, tokenizer, pieces: dict[int, bytes], vocab_size: int, eos_id: int):
        backend = tokenizer.backend
        names = {i: p for p, i in backend.get_vocab(with_added_tokens=True).items()}
        self.tokens = [pieces.get(i, names.get(i, "").encode("utf-8")) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in tokenizer.special_token_ids if i < vocab_size)
        self.eos_token_id, self.bos_token_id = int(eos_id), None
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids


class HostMatcher:
    """One row's parser state under a `HostGrammar` (llguidance's `LLMatcher`).

    Args:
      grammar: the compiled `HostGrammar`.
      tokens: the row's output so far (a row resumed after preemption).
    Raises:
      ValueError: a token the grammar does not allow.
    """

    def __init__(self, grammar: "HostGrammar", tokens: Sequence[int] = ()):
        self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar)
        self.consumed = 0
        self.advance(tokens)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume tokens[self.consumed:] (the row's whole output so far).

        Raises:
          ValueError: a token the grammar does not allow (naming it).
        """
        for t in tokens[self.consumed:]:
            if not self._matcher.consume_token(int(t)):
                raise ValueError(f"structured output: token {int(t)} is not allowed after "
                                 f"{self.consumed} tokens ({self._matcher.get_error()})")
            self.consumed += 1

    def fill(self, words: np.ndarray, row: int) -> None:
        """Write the next token's mask into words[row] (int32 [L, ceil(V/32)],
        bit t % 32 of word t // 32: token t allowed)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, words, row)

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()


@dataclasses.dataclass(frozen=True, eq=False)
class HostGrammar:
    """A constraint masked on the host, one step at a time (module docstring).

    Attributes:
      grammar: llguidance's grammar text.
      tokenizer: the `llguidance.LLTokenizer` it runs against.
      source: what it was compiled from (`StructuredOutput` field: text).
      reason: why it is not on the device.
    """

    grammar: str
    tokenizer: object
    source: str = ""
    reason: str = ""

    def matcher(self, tokens: Sequence[int] = ()) -> HostMatcher:
        """A parser at the start, after `tokens` (ValueError: not allowed)."""
        return HostMatcher(self, tokens)


__all__ = ["ANY_OBJECT", "HostGrammar", "HostMatcher", "TokenTable", "closed_objects", "host_grammar_text",
           "library_errors"]
