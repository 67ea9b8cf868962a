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

import jax
import jax.numpy as jnp
import llguidance
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from jaxinfer.config.sampling import DEFAULT_GRAMMAR_CACHE_BYTES, StructuredOutput
from jaxinfer.sampling.arrays import to_device
from jaxinfer.sampling.host_grammar import (ANY_OBJECT, HostGrammar, HostMatcher, TokenTable,
                                            closed_objects, host_grammar_text, library_errors)
from jaxinfer.sampling.structured import (MIN_EDGES, MIN_LIVE_ROWS, MIN_STATES, GrammarTables,
                                          _pow2, pad_tables)

# Metacharacters of the Rust `regex` crate's syntax (regex_syntax::is_meta_character).
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
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


def build_vocabulary(pieces: dict[int, bytes], eos_id: int) -> "outlines_core.Vocabulary":
    """An outlines-core Vocabulary of id -> bytes (`eos_id` and empty pieces left out)."""
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in pieces.items():
        if i != eos_id and b:
            by_bytes.setdefault(b, []).append(int(i))
    return outlines_core.Vocabulary(int(eos_id), by_bytes)


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


def grammar_from_index(index, vocab_size: int, eos_ids: Iterable[int] = (), source: str = "") -> Grammar:
    """Lay out an outlines-core `Index` as a `Grammar` over `vocab_size` ids;
    every id in `eos_ids` is allowed (and keeps the state) in final states,
    like the Index's own EOS id. Edges with ids outside [0, vocab_size) are
    dropped. States are renumbered densely in the order of the Index's ids."""
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
        held = lambda: sum(r.nbytes for r in self._done.values() if isinstance(r, Grammar))  # noqa: E731
        while len(self._done) > self.cache_size or (len(self._done) > 1 and held() > self.cache_bytes):
            self._done.popitem(last=False)

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
                self._vocabulary = build_vocabulary(token_bytes(self.tokenizer), self.eos_ids[0])
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
            index = outlines_core.Index(regex, self.vocabulary())
        grammar = grammar_from_index(index, self.vocab_size, self.eos_ids, regex)
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


class GrammarPool:
    """The automata a runner's rows use, concatenated into one set of device
    tables (state ids are global: a grammar's local state + its offset),
    and the masks of its host-masked rows (`GrammarTables.live`).

    A bounded LRU: the padded device tables (`nbytes`: mask, starts and
    edges, as `tables()` lays them out) never exceed `max_bytes`. Adding an
    automaton that would pass it evicts the least recently used ones that no
    running row references (`add(grammar, slot)` references it for the
    slot's row until `release_slot`); when even that leaves no room, `add`
    returns None and the caller masks that row on the host. An evicted
    automaton is added again (from the compiler's copy, or compiled again)
    when a request next needs it.

    Evicting compacts the tables: the automata after an evicted one move
    down, so offsets are valid until the next `add`. `tables()` records how
    the states of the previous tables map to the new ones; `take_remap()`
    returns that map once (old global state -> new, -1 for an evicted
    automaton's states), for the runner to rewrite its rows' states.

    The same object, or one compiled from the same source again after the
    compiler's cache dropped it, reuses its entry. `tables()` pads S and E
    to powers of two (at least MIN_STATES, MIN_EDGES; kept at the size they
    reached while that still fits the cap, so evictions do not change the
    compiled step's shapes) and the live rows to a power of two (at least
    MIN_LIVE_ROWS).

    Args:
      vocab_size: the model's V (the masks' width: ceil(V / 32) words).
      max_bytes: the cap on the padded device tables (live rows apart); an
        automaton whose tables cannot fit it alone is never added.
    """

    def __init__(self, vocab_size: int, max_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES):
        self.max_bytes = int(max_bytes)
        self._width = -(-int(vocab_size) // 32)
        self._lru: collections.OrderedDict = collections.OrderedDict()  # key -> Grammar, LRU first
        self._layout: list = []            # resident keys in table order
        self._offsets: dict = {}           # key -> offset of its state 0 now
        self._users: dict[int, object] = {}  # slot -> key of the automaton its row runs
        self._shown: dict = {}             # key -> offset in the tables last built
        self._shown_states = 0             # padded S of the tables last built
        self._shape = (0, 0)               # padded (S, E) of the tables last built
        self._remap: Optional[np.ndarray] = None
        self.evictions = 0
        self._tables: Optional[GrammarTables] = None
        self.live: dict[int, HostMatcher] = {}
        self._words = np.zeros((MIN_LIVE_ROWS, self._width), np.int32)

    @staticmethod
    def key(grammar: Grammar):
        return grammar.source or id(grammar)

    @property
    def grammars(self) -> list[Grammar]:
        """The resident automata in table order."""
        return [self._lru[k] for k in self._layout]

    @property
    def entries(self) -> int:
        return len(self._lru)

    @property
    def num_states(self) -> int:
        return sum(g.num_states for g in self._lru.values())

    @property
    def num_edges(self) -> int:
        return sum(len(g.tokens) for g in self._lru.values())

    def table_bytes(self, states: int, edges: int) -> int:
        """Device bytes of tables padded to `states` x `edges` (mask, starts, tokens, next)."""
        return states * self._width * 4 + (states + 1) * 4 + edges * 8

    def _padded(self, states: int, edges: int) -> tuple[int, int]:
        return _pow2(states, MIN_STATES), _pow2(edges, MIN_EDGES)

    def _fits(self, states: int, edges: int) -> bool:
        return self.table_bytes(*self._padded(states, edges)) <= self.max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the padded device tables (those `tables()` holds or will build; 0: none)."""
        if not self._lru:
            return self.table_bytes(*self._shape) if self._tables is not None else 0
        return self.table_bytes(*self._layout_shape())

    def add(self, grammar: Grammar, slot: Optional[int] = None) -> Optional[int]:
        """The global id of `grammar`'s state 0 (adding it when new, evicting
        unreferenced automata as the cap needs), referenced by `slot`'s row
        when a slot is given (its earlier reference dropped); None when it
        cannot fit beside the referenced ones (nothing changes then)."""
        key = self.key(grammar)
        if slot is not None:
            self.release_slot(slot)
        if key not in self._lru:
            if not self._make_room(grammar):
                return None
            self._lru[key] = grammar
            self._layout.append(key)
            self._relayout()
        self._lru.move_to_end(key)
        if slot is not None:
            self._users[slot] = key
        return self._offsets[key]

    def offset(self, grammar: Grammar) -> int:
        """The global id of a resident `grammar`'s state 0 (KeyError: not resident)."""
        return self._offsets[self.key(grammar)]

    def release_slot(self, slot: int) -> None:
        """`slot`'s row no longer runs its automaton (it may be evicted)."""
        self._users.pop(slot, None)

    def release_all(self) -> None:
        """No row runs an automaton any more (the runner's rows were reset)."""
        self._users.clear()

    def _make_room(self, grammar: Grammar) -> bool:
        states, edges = self.num_states + grammar.num_states, self.num_edges + len(grammar.tokens)
        if self._fits(states, edges):
            return True
        pinned = set(self._users.values())
        victims = [k for k in self._lru if k not in pinned]       # least recently used first
        free_s = sum(self._lru[k].num_states for k in victims)
        free_e = sum(len(self._lru[k].tokens) for k in victims)
        if not self._fits(states - free_s, edges - free_e):
            return False
        for k in victims:
            if self._fits(states, edges):
                break
            g = self._lru.pop(k)
            self._layout.remove(k)
            states, edges = states - g.num_states, edges - len(g.tokens)
            self.evictions += 1
        return True

    def _relayout(self) -> None:
        self._offsets, n = {}, 0
        for k in self._layout:
            self._offsets[k] = n
            n += self._lru[k].num_states
        self._tables = None

    def _layout_shape(self) -> tuple[int, int]:
        """Padded (S, E) for the resident automata: the tables' current
        shape while it holds them within the cap, else the powers of two."""
        states, edges = self.num_states, self.num_edges
        need = self._padded(states, edges)
        keep = (max(need[0], self._shape[0]), max(need[1], self._shape[1]))
        return keep if self.table_bytes(*keep) <= self.max_bytes else need

    def acquire(self, matcher: HostMatcher) -> int:
        """A live row j for a host-masked row's `matcher` (row state
        `structured.host_state(j)`); the rows double when all are taken."""
        j = next((i for i in range(self._words.shape[0]) if i not in self.live), None)
        if j is None:
            j = self._words.shape[0]
            self._words = np.concatenate([self._words, np.zeros_like(self._words)])
        self.live[j] = matcher
        return j

    def release(self, j: int) -> None:
        """Free live row j (its row finished or left its slot)."""
        self.live.pop(j, None)

    def tables(self) -> Optional[GrammarTables]:
        """The device tables of every resident automaton, with each live
        row's next-token mask computed now (None before the first grammar
        or host-masked row)."""
        if not self._lru and not self.live and self._tables is None:
            return None
        if self._tables is None or self._tables.live.shape != self._words.shape:
            grammars = self.grammars
            offsets, edges = [], 0
            for g in grammars:
                offsets.append(edges)
                edges += len(g.tokens)
            starts = np.concatenate([g.starts[:-1] + o for g, o in zip(grammars, offsets)]
                                    + [[edges]]).astype(np.int32)
            if grammars:
                mask = np.concatenate([g.mask for g in grammars])
                tokens = np.concatenate([g.tokens for g in grammars])
                nxt = np.concatenate([g.next + self._offsets[self.key(g)] for g in grammars])
            else:   # host-masked rows only
                mask = np.zeros((0, self._width), np.uint32)
                tokens, nxt = np.zeros(0, np.int32), np.zeros(0, np.int32)
            shape = self._layout_shape()
            self._tables = pad_tables(mask, starts, tokens, nxt, self._live_words(), *shape)
            self._note_moves(shape)
        elif self.live:
            self._tables = self._tables.replace(live=to_device(self._live_words()))
        return self._tables

    def _note_moves(self, shape: tuple[int, int]) -> None:
        """Record how the previous tables' states map to these (`take_remap`)."""
        moved = any(self._offsets.get(k) != o for k, o in self._shown.items())
        if moved:
            remap = np.full(max(self._shown_states, 1), -1, np.int32)
            for k, old in self._shown.items():
                if k in self._offsets:
                    n = self._lru[k].num_states
                    remap[old:old + n] = np.arange(self._offsets[k], self._offsets[k] + n)
            if self._remap is not None:     # not taken since: compose
                prev = self._remap
                self._remap = np.where(prev >= 0, remap[np.clip(prev, 0, len(remap) - 1)], -1)
            else:
                self._remap = remap
        self._shown = dict(self._offsets)
        self._shown_states, self._shape = shape[0], shape

    def take_remap(self) -> Optional[np.ndarray]:
        """int32 [S_old]: the new global state of each state of the tables
        before the last rebuild (-1: its automaton was evicted), or None when
        no resident automaton moved; returned once."""
        remap, self._remap = self._remap, None
        return remap

    def _live_words(self) -> np.ndarray:
        self._words[:] = 0
        for j, matcher in self.live.items():
            matcher.fill(self._words, j)
        return self._words.view(np.uint32)


@jax.jit
def remap_states(state: jax.Array, remap: jax.Array) -> jax.Array:
    """Rows' grammar states after the pool's tables were compacted
    (`GrammarPool.take_remap`): device states through `remap` (past its
    end: -1), unconstrained and host-masked rows unchanged."""
    inside = (state >= 0) & (state < remap.shape[0])
    moved = remap[jnp.clip(state, 0, remap.shape[0] - 1)]
    return jnp.where(state >= 0, jnp.where(inside, moved, -1), state)


__all__ = ["DEFAULT_GRAMMAR_CACHE_BYTES", "MAX_TABLE_BYTES", "CompiledConstraint", "Grammar", "GrammarCompiler", "GrammarPool",
           "HostGrammar", "HostMatcher", "build_vocabulary", "constraint_regex", "escape_literal",
           "closed_objects", "grammar_from_index", "host_grammar_text", "remap_states", "token_bytes"]
