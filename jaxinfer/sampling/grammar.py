"""Structured output on the host: a `StructuredOutput` compiled against the
tokenizer's vocabulary, into device tables (a finite automaton) or into a
parser that masks on the host (a context-free grammar).

    GrammarCompiler(tokenizer, vocab_size).compile(spec) -> Grammar | HostGrammar   (cached per spec)
    GrammarPool.add(grammar) -> offset; GrammarPool.tables() -> structured.GrammarTables
    GrammarPool.acquire(matcher) -> j; GrammarPool.release(j)     host-masked rows

The automaton is outlines-core's `Index`: a DFA whose edges are token ids
(Willard & Louf 2023, arXiv:2307.09702). A JSON schema and "any JSON object"
become a regular expression first (`outlines_core.json_schema`, nesting
bounded by the library), a choice list becomes an alternation of escaped
literals. Nothing here parses regexes or schemas. A `Grammar` is the Index
renumbered densely (state 0 .. S-1) and laid out for the device: the packed
allowed-token bitmask [S, ceil(V/32)] uint32 and, per state, its outgoing
edges sorted by token id (CSR: starts [S + 1], tokens [E], next [E]). EOS
ids are allowed only in final states (an edge to the same state).

Where the automaton is not finite, or too large for the device, the
constraint becomes a `HostGrammar` instead (`host_grammar`): llguidance
(github.com/guidance-ai/llguidance) parses the output so far and gives the
next token's mask on the host, one step at a time. That is every
`StructuredOutput.grammar` (a context-free grammar, GBNF or Lark), and a
regex, choice or JSON schema whose tables would exceed `max_table_bytes`.
A host-masked row reads its mask from `GrammarTables.live` (`GrammarPool`),
which the runner rewrites before each step; while such a row runs, the
scheduler reads each step before dispatching the next, the row runs one
step per dispatch (the other rows keep their decode loop) and drafts no
tokens.

Building an automaton's tables takes seconds for a JSON schema (its Index
walks every token through every state). With `background=True` (what
`jaxinfer serve` uses) a regex, choice or schema not built yet is masked on
the host at once, while its tables build on a thread; requests admitted
after the build run on the device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
from typing import Iterable, Optional, Union

import llguidance
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from jaxinfer.config.sampling import DEFAULT_GRAMMAR_CACHE_BYTES, StructuredOutput
from jaxinfer.sampling.grammar_pool import GrammarPool, remap_states   # the device side
from jaxinfer.sampling.host_grammar import (ANY_OBJECT, HostGrammar, HostMatcher, TokenTable,
                                            closed_objects, host_grammar_text, library_errors)

# Metacharacters of the Rust `regex` crate's syntax (regex_syntax::is_meta_character).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# The end of a constraint's text, written by an id past the model's (`GrammarCompiler.end_mark_id`):
# outlines-core (0.2) leaves out of its Index a token that leaves an accepting state when the text
# before its last byte is accepted ("1" then "." under [0-9]+(\.[0-9]+)?, "x<" then "tool_call>"
# under [^<]*(<tool_call>)?), so every regex is compiled followed by this mark, with no accepting
# state before it (`marked_regex`, `grammar_from_index`).
END_MARK = "\ue000"
# Device tables one grammar may take (SmolLM2's vocabulary: 6 KiB of mask per state).
MAX_TABLE_BYTES = 256 << 20


def escape_literal(text: str) -> str:
    """A regex (outlines-core's Rust syntax) matching exactly `text`."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def constraint_regex(spec: StructuredOutput) -> str:
    """The regular expression outlines-core compiles for `spec`.

    Raises:
      ValueError: a schema the library rejects (naming its message).
    """
    if spec.grammar is not None:
        raise ValueError("a context-free grammar has no regular expression")
    if spec.regex is not None:
        return spec.regex
    if spec.choice is not None:
        return "(" + "|".join(escape_literal(c) for c in spec.choice) + ")"
    schema = ANY_OBJECT if spec.json_object else spec.json_schema
    with library_errors("json_schema"):
        return build_regex_from_schema(schema)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes each ordinary token id stands for in decoded text: byte-level
    BPE (GPT-2 alphabet), SentencePiece (U+2581 is a space, `<0xNN>` a byte)
    or plain pieces. Special tokens are left out."""
    backend = tokenizer.backend
    decoder = backend.decoder.__getstate__() if backend.decoder is not None else b""
    byte_level = b"ByteLevel" in decoder
    table = _byte_decoder() if byte_level else {}
    out = {}
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        if i in tokenizer.special_token_ids:
            continue
        if byte_level:
            if all(c in table for c in piece):
                out[i] = bytes(table[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode("utf-8")
    return out


def build_vocabulary(pieces: dict[int, bytes], eos_id: int,
                     end_mark_id: Optional[int] = None) -> "outlines_core.Vocabulary":
    """An outlines-core Vocabulary of id -> bytes (`eos_id` and empty pieces
    left out), with `END_MARK` written by the id `end_mark_id` when given
    (an id past the model's, see `END_MARK`)."""
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in pieces.items():
        if i != eos_id and b:
            by_bytes.setdefault(b, []).append(int(i))
    if end_mark_id is not None:
        by_bytes.setdefault(END_MARK.encode(), []).append(int(end_mark_id))
    return outlines_core.Vocabulary(int(eos_id), by_bytes)


def marked_regex(regex: str) -> str:
    """`regex` followed by `END_MARK`: what `GrammarCompiler` gives outlines-core."""
    return f"(?:{regex}){END_MARK}"


def _alive(src: np.ndarray, nxt: np.ndarray, finals: np.ndarray) -> np.ndarray:
    """The states from which a final state is reachable over edges src -> nxt (finals too)."""
    pairs = np.unique((src << 32) | nxt)
    into: dict[int, list[int]] = {}
    for a, b in zip((pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).tolist()):
        into.setdefault(b, []).append(a)
    seen, todo = set(finals.tolist()), list(finals.tolist())
    while todo:
        for a in into.get(todo.pop(), ()):
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return np.array(sorted(seen), np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """One compiled constraint, states numbered 0 .. S-1 (host numpy arrays).

    Attributes:
      initial: the start state.
      final: bool [S], accepting states (where EOS is allowed).
      mask: uint32 [S, ceil(V/32)], bit t % 32 of word t // 32 set when
        token t is allowed in the state.
      starts: int32 [S + 1]; state s's edges are tokens[starts[s]:starts[s+1]]
        (sorted ascending) -> next[...].
      tokens, next: int32 [E].
      source: the regex it was compiled from.
    """

    initial: int
    final: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    tokens: np.ndarray
    next: np.ndarray
    source: str = ""

    @property
    def num_states(self) -> int:
        return int(self.final.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its device tables (mask, starts, edges)."""
        return self.mask.nbytes + self.starts.nbytes + self.tokens.nbytes + self.next.nbytes

    def step(self, state: int, token: int) -> Optional[int]:
        """The state after `token`, or None when the token is not allowed."""
        lo, hi = int(self.starts[state]), int(self.starts[state + 1])
        j = lo + int(np.searchsorted(self.tokens[lo:hi], token))
        return int(self.next[j]) if j < hi and self.tokens[j] == token else None

    def walk(self, tokens: Iterable[int]) -> int:
        """The state after `tokens` from the start (a row resumed after
        preemption). Raises ValueError on a token the grammar does not allow."""
        state = self.initial
        for t in tokens:
            nxt = self.step(state, int(t))
            if nxt is None:
                raise ValueError(f"token {t} is not allowed in state {state}")
            state = nxt
        return state


def grammar_from_index(index, vocab_size: int, eos_ids: Iterable[int] = (), source: str = "",
                       end_mark_id: Optional[int] = None) -> Grammar:
    """Lay out an outlines-core `Index` as a `Grammar` over `vocab_size` ids;
    every id in `eos_ids` is allowed (and keeps the state) in final states,
    like the Index's own EOS id. Edges with ids outside [0, vocab_size) are
    dropped. States are renumbered densely in the order of the Index's ids.

    With `end_mark_id` (an id >= vocab_size that writes `END_MARK`, the Index
    built from `marked_regex`), the final states are those whose END_MARK
    edge reaches one of the Index's final states, and states from which no
    such state can be reached (the mark's own path) are dropped."""
    transitions = index.get_transitions()
    finals = np.array(sorted(index.get_final_states()), np.int64)
    eos = np.array(sorted({int(e) for e in eos_ids}), np.int64)
    # every edge as numpy columns (src, token, next), each read in one C-level pass
    states = np.fromiter(transitions.keys(), np.int64, len(transitions))
    counts = np.fromiter(map(len, transitions.values()), np.int64, len(transitions))
    edges = lambda part: itertools.chain.from_iterable(map(part, transitions.values()))  # noqa: E731
    total = int(counts.sum())
    toks = np.fromiter(edges(dict.keys), np.int64, total)
    nxts = np.fromiter(edges(dict.values), np.int64, total)
    src = np.repeat(states, counts)
    initial = int(index.get_initial_state())
    if end_mark_id is not None:
        finals = np.unique(src[(toks == end_mark_id) & np.isin(nxts, finals)])
        ordinary = (toks >= 0) & (toks < vocab_size)
        alive = _alive(src[ordinary], nxts[ordinary], finals)
        keep = ordinary & np.isin(src, alive) & np.isin(nxts, alive)
        src, toks, nxts = src[keep], toks[keep], nxts[keep]
        states = alive
    names = np.unique(np.concatenate([states, finals, np.unique(nxts), [initial]]))
    # final states: every EOS id allowed and keeping the state, replacing an edge it had
    keep = ~(np.isin(src, finals) & np.isin(toks, eos)) & (toks >= 0) & (toks < vocab_size)
    eos = eos[(eos >= 0) & (eos < vocab_size)]
    src = np.concatenate([src[keep], np.repeat(finals, len(eos))])
    toks = np.concatenate([toks[keep], np.tile(eos, len(finals))])
    nxts = np.concatenate([nxts[keep], np.repeat(finals, len(eos))])
    dense = lambda ids: np.searchsorted(names, ids)  # noqa: E731
    if names[-1] < 1 << 22:  # small ids (the usual case): a lookup table, one gather
        table = np.zeros(int(names[-1]) + 1, np.int64)
        table[names] = np.arange(len(names))
        dense = table.__getitem__
    rows, nxts = dense(src), dense(nxts)
    # edges sorted by (state, token): one argsort of a single int64 key (ids < 2**31)
    order = np.argsort((rows << 31) | toks)
    rows, toks, nxts = rows[order], toks[order], nxts[order]
    num = len(names)
    starts = np.searchsorted(rows, np.arange(num + 1)).astype(np.int32)
    mask = np.zeros((num, -(-vocab_size // 32)), np.uint32)
    np.bitwise_or.at(mask, (rows, toks >> 5), (np.uint32(1) << (toks & 31).astype(np.uint32)))
    final = np.isin(names, finals)
    return Grammar(int(np.searchsorted(names, initial)), final, mask, starts, toks.astype(np.int32),
                   nxts.astype(np.int32), source)


CompiledConstraint = Union[Grammar, HostGrammar]


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer, caching each by spec.

    `compile(spec)` is an LRU cache keyed by the spec (equal schemas are
    equal specs: `StructuredOutput` keeps canonical JSON); the compiler is
    bound to one tokenizer and V, so the key is in effect (constraint,
    tokenizer). A repeated spec returns the same object; a spec that fails
    is not cached. `compile.cache_info()` counts hits and misses (with
    background=False).

    A regex, choice or JSON schema becomes a `Grammar` (device tables,
    outlines-core), unless its tables would take more than max_table_bytes:
    then, like every context-free `grammar`, a `HostGrammar` (llguidance).

    Args:
      tokenizer: a `jaxinfer.tokenizer.Tokenizer` (compiling needs an EOS id).
      vocab_size: the model's V (its logits' width; >= the tokenizer's).
      cache_size: compiled constraints kept (least recently used dropped
        first); 64 by default.
      max_table_bytes: the most device memory one automaton's tables may
        take; 0: every constraint is masked on the host (no automaton is built).
      cache_bytes: the cap on each runner's device tables (`GrammarPool`,
        the `grammar_cache_bytes` setting), and on the host copies of the
        automata this compiler keeps (least recently used dropped first).
      background: `compile` of a regex, choice or schema whose tables are
        not built yet returns its `HostGrammar` (llguidance, about a
        millisecond) and builds the tables on a thread; once built (or
        refused: over max_table_bytes, or rejected by outlines-core),
        `compile` returns that result. `wait_built()` joins the builds.
    Raises (compile):
      ValueError: an invalid regex, schema or grammar, or one the libraries
        reject, naming the problem (with background=True, one llguidance
        accepts and outlines-core rejects stays on the host instead).
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64,
                 max_table_bytes: int = MAX_TABLE_BYTES, background: bool = False,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.max_table_bytes = int(max_table_bytes)
        self.cache_bytes = int(cache_bytes)
        self.eos_ids = tuple(sorted(tokenizer.eos_token_ids))
        self._vocabulary = None
        self._host_tokenizer = None
        self._lock = threading.Lock()
        self.cache_size = int(cache_size)
        self._lru = functools.lru_cache(cache_size)(self._compile)
        self._done: collections.OrderedDict = collections.OrderedDict()   # background results, LRU
        self._building: dict[StructuredOutput, tuple[HostGrammar, threading.Thread]] = {}
        self._building_lock = threading.Lock()
        self.background = background

    @property
    def end_mark_id(self) -> int:
        """The id that writes `END_MARK` in the vocabulary (past every model id)."""
        return max(self.vocab_size, self.tokenizer.vocab_size)

    @property
    def background(self) -> bool:
        """Whether `compile` builds device tables on a thread (settable)."""
        return self.compile == self._compile_soon

    @background.setter
    def background(self, on: bool) -> None:
        self.compile = self._compile_soon if on else self._lru

    def _compile_soon(self, spec: StructuredOutput) -> CompiledConstraint:
        """`compile` with background=True (class docstring)."""
        if spec.grammar is not None or self.max_table_bytes <= 0:
            return self._host_cached(spec)
        with self._building_lock:
            if spec in self._done:
                return self._recall(spec)
            if spec in self._building:
                return self._building[spec][0]
            try:
                host = self._host(spec, "its device tables are being built")
            except ValueError:      # llguidance rejects it: outlines-core decides below
                host = None
            if host is not None:
                thread = threading.Thread(target=self._build, args=(spec, host), daemon=True,
                                          name="jaxinfer-grammar")
                self._building[spec] = (host, thread)
        if host is None:
            return self._keep(spec, self._compile(spec))    # ValueError: outlines-core's message
        thread.start()
        return host

    def _host_cached(self, spec: StructuredOutput) -> CompiledConstraint:
        with self._building_lock:
            if spec in self._done:
                return self._recall(spec)
        return self._keep(spec, self._compile(spec))

    def _recall(self, spec: StructuredOutput) -> CompiledConstraint:
        """A kept result, now the most recently used (the caller holds `_building_lock`)."""
        self._done.move_to_end(spec)
        return self._done[spec]

    def _build(self, spec: StructuredOutput, host: HostGrammar) -> None:
        try:
            result = self._compile(spec)
        except ValueError as e:     # outlines-core rejects what llguidance takes: stay on the host
            result = dataclasses.replace(host, reason=str(e))
        with self._building_lock:   # one step: a compile in between would build it again
            del self._building[spec]
            self._remember(spec, result)

    def _keep(self, spec: StructuredOutput, result: CompiledConstraint) -> CompiledConstraint:
        with self._building_lock:
            self._remember(spec, result)
        return result

    def _remember(self, spec: StructuredOutput, result: CompiledConstraint) -> None:
        """Keep a finished result (the caller holds `_building_lock`)."""
        self._done[spec] = result
        while len(self._done) > self.cache_size or (len(self._done) > 1
                                                    and self._held() > self.cache_bytes):
            self._done.popitem(last=False)

    def _held(self) -> int:
        """Bytes of the automata's tables kept (`_done`)."""
        return sum(r.nbytes for r in self._done.values() if isinstance(r, Grammar))

    def prepare(self) -> None:
        """Build what every constraint needs once per tokenizer (the
        vocabulary's bytes for outlines-core, llguidance's tokenizer)."""
        self.vocabulary()
        self.host_tokenizer()

    def wait_built(self, timeout_s: Optional[float] = None) -> bool:
        """Join the background builds under way; True when none is left."""
        with self._building_lock:
            threads = [t for _, t in self._building.values()]
        for t in threads:
            t.join(timeout_s)
        with self._building_lock:
            return not self._building

    def vocabulary(self):
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = build_vocabulary(token_bytes(self.tokenizer), self.eos_ids[0],
                                                    self.end_mark_id)
            return self._vocabulary

    def host_tokenizer(self):
        """llguidance's tokenizer over the same token bytes (built once)."""
        with self._lock:
            if self._host_tokenizer is None:
                table = TokenTable(self.tokenizer, token_bytes(self.tokenizer), self.vocab_size,
                                   self.eos_ids[0])
                self._host_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(table), n_vocab=self.vocab_size,
                    eos_token=list(self.eos_ids))
            return self._host_tokenizer

    def _compile(self, spec: StructuredOutput) -> CompiledConstraint:
        if not self.eos_ids:
            raise ValueError("structured output needs a tokenizer with an EOS id")
        if spec.grammar is not None:
            return self._host(spec, "a context-free grammar is not a finite automaton")
        if self.max_table_bytes <= 0:
            return self._host(spec, "max_table_bytes is 0: every constraint is masked on the host")
        regex = constraint_regex(spec)
        with library_errors("structured output"):
            index = outlines_core.Index(marked_regex(regex), self.vocabulary())
        grammar = grammar_from_index(index, self.vocab_size, self.eos_ids, regex, self.end_mark_id)
        if grammar.nbytes > self.max_table_bytes:
            return self._host(spec, f"its automaton needs {grammar.nbytes / 2**20:.1f} MiB of device "
                                    f"tables ({grammar.num_states} states), over the limit of "
                                    f"{self.max_table_bytes / 2**20:.0f} MiB")
        return grammar

    def host_grammar(self, spec: StructuredOutput, reason: str) -> HostGrammar:
        """`spec` masked on the host (llguidance), whatever its automaton;
        `reason` says why. Raises ValueError as `compile`."""
        return self._host(spec, reason)

    def _host(self, spec: StructuredOutput, reason: str) -> HostGrammar:
        text = host_grammar_text(spec)
        tokenizer = self.host_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"structured output: {error.strip()}")
        source = spec.grammar if spec.grammar is not None else constraint_regex(spec)
        return HostGrammar(text, tokenizer, source, reason)


__all__ = ["DEFAULT_GRAMMAR_CACHE_BYTES", "END_MARK", "MAX_TABLE_BYTES", "CompiledConstraint",
           "Grammar", "GrammarCompiler", "GrammarPool", "HostGrammar", "HostMatcher",
           "build_vocabulary",
           "constraint_regex", "escape_literal", "closed_objects", "grammar_from_index",
           "host_grammar_text", "marked_regex", "remap_states", "token_bytes"]
