"""The device side of a runner's structured output: `GrammarPool`, the
automata its rows use in one set of device tables, a byte-capped LRU
(`grammar_cache_bytes`), and `remap_states`, which moves the rows' states
when the pool compacts its tables (see docs/structured.md)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config.sampling import DEFAULT_GRAMMAR_CACHE_BYTES
from jaxinfer.sampling.arrays import to_device
from jaxinfer.sampling.host_grammar import HostMatcher
from jaxinfer.sampling.structured import (MIN_EDGES, MIN_LIVE_ROWS, MIN_STATES, GrammarTables,
                                          _pow2, pad_tables)

if TYPE_CHECKING:
    from jaxinfer.sampling.grammar import Grammar


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
    MIN_LIVE_ROWS; `live_rows` rows from the start).

    A pool with a `limit` (the largest padded (S, E) the compiled step
    takes now; see `grow`) never builds tables past it, and always builds
    tables (empty ones before the first automaton): an automaton that needs
    more evicts within the limit, or is refused like one over the cap, and
    `wanted` names the shape it needed (within the cap) until `grow` allows it.

    Args:
      vocab_size: the model's V (the masks' width: ceil(V / 32) words).
      max_bytes: the cap on the padded device tables (live rows apart); an
        automaton whose tables cannot fit it alone is never added.
      live_rows: host-masked rows the tables hold before any doubling (a
        runner passes its slots: one live row per slot at most).
      limit: True: start limited to the smallest tables (`limit`); False: none.
    """

    def __init__(self, vocab_size: int, max_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 live_rows: int = MIN_LIVE_ROWS, limit: bool = False):
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
        self._words = np.zeros((max(int(live_rows), 1), self._width), np.int32)
        self.limit: Optional[tuple[int, int]] = self._padded(0, 0) if limit else None
        self.wanted: Optional[tuple[int, int]] = None

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

    def _fits(self, states: int, edges: int, limited: bool = True) -> bool:
        shape = self._padded(states, edges)
        inside = (not limited or self.limit is None
                  or (shape[0] <= self.limit[0] and shape[1] <= self.limit[1]))
        return inside and self.table_bytes(*shape) <= self.max_bytes

    def _want(self, need: tuple[int, int]) -> None:
        """Note that tables of padded shape `need` were needed past the limit
        (`wanted`: the limit and every such need, while within the cap)."""
        wanted = tuple(max(x) for x in zip(need, self.limit, self.wanted or need))
        if self.table_bytes(*wanted) <= self.max_bytes:
            self.wanted = wanted

    def grow(self, shape: tuple[int, int]) -> None:
        """Let the tables take padded (S, E) = `shape` from the next `tables()`
        (the step is compiled for it; within the cap); `wanted` is cleared
        when `shape` holds it."""
        self.limit = (max(shape[0], self.limit[0]), max(shape[1], self.limit[1]))
        if self.wanted is not None and all(w <= m for w, m in zip(self.wanted, self.limit)):
            self.wanted = None
        self._tables = None

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
        if self.limit is not None:
            self._want(self._padded(states, edges))
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
        if self.limit is not None:      # the one shape the step is compiled for
            return self.limit
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
        if not self._lru and not self.live and self._tables is None and self.limit is None:
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


__all__ = ["GrammarPool", "remap_states"]
