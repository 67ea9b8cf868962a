"""A runner's structured-output rows: the grammar pool's device tables the
step reads, the rows masked on the host, and the tables' growth
(`GrammarRows`, which `serving.runner.ModelRunner` inherits).

When the runner's `GrammarCompiler` builds in the background (`jaxinfer
serve`), the step never waits for a compile caused by schema traffic: the
tables exist from the start (empty, the pool's smallest shape, so warm-up
compiles the step for them), the live rows of host-masked requests are one
per slot, and the pool takes a larger table shape only once the step is
compiled for it (`TableGrowth`, on a thread). Until then an automaton that
needs more room evicts within the compiled shape or is masked on the host.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Optional, Sequence

import jax
import numpy as np

from jaxinfer.engine import step as engine_step
from jaxinfer.sampling.arrays import to_device
from jaxinfer.sampling.grammar import GrammarPool, HostGrammar, remap_states
from jaxinfer.sampling.structured import UNCONSTRAINED, GrammarTables, host_state
from jaxinfer.serving.programs import join_compiles
from jaxinfer.serving.request import Request


class GrammarRows:
    """The structured-output side of a runner (a mixin of `ModelRunner`,
    which sets grammars, stop, rows, programs, max_num_seqs and the compile
    plan; `_init_grammar_rows` sets the rest).

    Attributes:
      tables_from_start: whether a background-building compiler gives the
        runner tables from the start and grows them on a thread (module
        docstring); False for a runner whose programs must match another
        process's built without a compiler (`parallel.multiprocess`).
    """

    tables_from_start = True

    def _init_grammar_rows(self, vocab_size: int, logprob_counts: Sequence[int]) -> None:
        """Set grammar_pool, host_rows and growth (None unless the compiler
        builds in the background); `logprob_counts`: the step's possible
        num_logprobs values."""
        background = (self.grammars is not None and self.grammars.background
                      and self.tables_from_start)
        self.grammar_pool = GrammarPool(vocab_size, *(
            [self.grammars.cache_bytes] if self.grammars is not None else []),
            live_rows=self.max_num_seqs, limit=background)
        self.host_rows: dict[int, int] = {}   # slot -> live row of a host-masked request
        self.growth = TableGrowth(self, logprob_counts) if background else None
        if background:      # the step compiles for the first tables with the others
            self.stop = self.stop.replace(grammar=self.grammar_pool.tables())

    def check_structured(self, request: Request) -> None:
        """Compile a request's structured output (cached). Raises ValueError:
        an invalid constraint, or a runner without a `GrammarCompiler`."""
        if request.sampling.structured is not None:
            if self.grammars is None:
                raise ValueError("structured output needs a model with a tokenizer")
            self.grammars.compile(request.sampling.structured)

    def host_constrained(self, request: Request) -> bool:
        """Whether the request's constraint compiles to a host mask now
        (`grammar.HostGrammar`); `_grammar_states` decides again as it seats
        the row (`GrammarCompiler.background`: the tables may be built by then)."""
        spec = request.sampling.structured
        return spec is not None and isinstance(self.grammars.compile(spec), HostGrammar)

    def _grammar_states(self, admissions: Sequence) -> list[int]:
        """Each admitted row's grammar state (-1: none), after the tokens it
        generated before a preemption; the device tables follow. A
        host-masked request takes a live row (its slot's earlier one freed).
        An automaton the pool cannot hold beside those running rows use
        (`GrammarPool`, the grammar_cache_bytes cap, or the shape the step
        is compiled for) is masked on the host; when the pool evicted
        automata and compacted its tables, the running rows' states are
        moved with them (`remap_states`)."""
        if self.growth is not None:
            self.growth.apply()
        states, device = [UNCONSTRAINED] * len(admissions), []
        for i, x in enumerate(admissions):
            old = self.host_rows.pop(x.slot, None)
            if old is not None:
                self.grammar_pool.release(old)
            self.grammar_pool.release_slot(x.slot)
            spec = x.request.sampling.structured
            if spec is None:
                continue
            self.check_structured(x.request)
            grammar = self.grammars.compile(spec)
            pool = self.grammar_pool
            if not isinstance(grammar, HostGrammar) and pool.add(grammar, x.slot) is None:
                grammar = self.grammars.host_grammar(spec, "its automaton's tables do not fit the "
                                                     "grammar cache beside those of running rows")
            if isinstance(grammar, HostGrammar):
                self.host_rows[x.slot] = self.grammar_pool.acquire(grammar.matcher(x.generated))
                states[i] = host_state(self.host_rows[x.slot])
            else:
                device.append((i, grammar, x.generated))
        for i, grammar, generated in device:    # offsets as they are after every add
            states[i] = self.grammar_pool.offset(grammar) + grammar.walk(generated)
        self.stop = self.stop.replace(grammar=self.grammar_pool.tables())
        remap = self.grammar_pool.take_remap()
        if remap is not None and self.rows.grammar is not None:
            self.rows = self.rows.replace(grammar=remap_states(self.rows.grammar, to_device(remap)))
        if self.growth is not None:
            self.growth.start()
        return states

    def release_slot(self, slot: int) -> None:
        """`slot`'s request left (finished, aborted or preempted): its
        automaton may be evicted from the grammar pool."""
        self.grammar_pool.release_slot(slot)

    def advance_host_row(self, slot: int, tokens: Sequence[int]) -> None:
        """Feed a host-masked request's whole output so far to its parser
        (no-op for a slot without one). Raises ValueError: a token its
        grammar does not allow."""
        j = self.host_rows.get(slot)
        if j is not None:
            self.grammar_pool.live[j].advance(tokens)

    def sync_host_rows(self, slots) -> None:
        """Before a step: `slots` hold the host-masked requests; other slots'
        live rows are freed, and every parser's next-token mask goes to the
        device."""
        for slot in [s for s in self.host_rows if s not in slots]:
            self.grammar_pool.release(self.host_rows.pop(slot))
        if self.host_rows:
            self.stop = self.stop.replace(grammar=self.grammar_pool.tables())


class TableGrowth:
    """Compiles a runner's step for the grammar tables its pool wants
    (`GrammarPool.wanted`) on a daemon thread, one shape at a time, and then
    lets the pool take that shape (`GrammarPool.grow`), on the engine thread.

    The programs compiled: the step of every token bucket for each log-prob
    count the step is compiled for at the current shape, and `remap_states`
    for the new state count, at the lowest CPU priority. Decode loops are
    not (dispatch runs a loop only once it is compiled:
    `ModelRunner.has_decode_loop`).

    Attributes:
      num_growths: shapes the pool took so far.
      error: the exception a compile on the thread raised, or None; the
        pool then keeps its shape (new automata evict within it or are
        masked on the host) and no other growth starts.
    """

    def __init__(self, runner, logprob_counts: Sequence[int]):
        self.runner, self.logprob_counts = runner, tuple(logprob_counts)
        self._thread: Optional[threading.Thread] = None
        self._ready: Optional[tuple[int, int]] = None
        self.num_growths = 0
        self.error: Optional[BaseException] = None
        self._thread_started = False
        self._stop = threading.Event()

    def apply(self) -> None:
        """On the engine thread: a shape compiled since the last call becomes the pool's."""
        ready, self._ready = self._ready, None
        if ready is not None:
            self.runner.grammar_pool.grow(ready)
            self.num_growths += 1

    def start(self) -> None:
        """On the engine thread: compile the shape the pool wants, unless a
        compile is under way (the next call starts the one wanted then)."""
        wanted = self.runner.grammar_pool.wanted
        busy = self._thread is not None and self._thread.is_alive()
        if (wanted is None or busy or self._ready is not None or self.error is not None
                or self._stop.is_set()):
            return
        states = (self.runner.grammar_pool.limit[0], wanted[0])
        self._thread = threading.Thread(
            target=self._compile, args=(wanted, self.plan(wanted), states,
                                        self.runner.rows.grammar),
            daemon=True, name="jaxinfer-grammar-compile")
        if not self._thread_started:    # a thread killed inside XLA's compiler aborts the process
            atexit.register(_join, weakref.ref(self))
        self._thread_started = True
        self._thread.start()

    def plan(self, shape: tuple[int, int]) -> list[tuple]:
        """The step programs for tables of padded (S, E) = `shape`, as
        (function, abstract args, static args)."""
        runner = self.runner
        stop = runner.stop.replace(grammar=abstract_tables(runner.stop.grammar, shape))
        counts = sorted({static["num_logprobs"] for fn, args, static
                         in runner.compile_plan(self.logprob_counts)
                         if fn is engine_step.step and runner.programs.has(fn, *args, **static)})
        return [item for item in runner.compile_plan(counts or (-1,), stop=stop)
                if item[0] is engine_step.step]

    def _compile(self, shape: tuple[int, int], plan: list[tuple], states: Sequence[int],
                 rows: jax.Array) -> None:
        """Compile `plan` and `remap_states` from tables of each of `states`
        states (for rows' states like `rows`), then offer `shape`."""
        programs = self.runner.programs
        _lowest_priority()
        try:
            with programs.background():
                for fn, args, static in plan:
                    if self._stop.is_set():     # the pool keeps its shape
                        return
                    programs.compiled(fn, *args, **static)
                for n in states:
                    self.compile_remap(n, rows)
        except BaseException as e:   # noqa: BLE001 - kept in `error`; serving goes on
            self.error = e
            return
        self._ready = shape

    def compile_remap(self, states: int, rows: jax.Array) -> None:
        """Compile (and run once) `remap_states` for tables of `states` states
        and rows' states of the shape, dtype and placement of `rows` (the
        runner's after `reset`, then for the first tables' states)."""
        like = jax.device_put(np.zeros(rows.shape, rows.dtype), rows.sharding)
        remap = to_device(np.zeros(states, np.int32))
        jax.block_until_ready(remap_states(like, remap))

    def stop(self) -> None:
        """Compile nothing more: a compile under way ends after its current
        program (not offering its shape), and no other starts."""
        self._stop.set()

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Join the compile under way; True when none is left."""
        return join_compiles(self._thread, timeout_s)


def _lowest_priority() -> None:
    """Lower this thread's CPU priority (Linux: its own nice value, 19), so
    that the engine thread's steps run before its compiles."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def _join(growth: weakref.ref) -> None:
    """At exit: let a growth's compile under way finish."""
    if growth() is not None:
        growth().wait()


def abstract_tables(tables: GrammarTables, shape: tuple[int, int]) -> GrammarTables:
    """`jax.ShapeDtypeStruct`s of `tables` padded to (S, E) = `shape` (live rows as they are)."""
    states, edges = shape
    spec = lambda x, *dims: jax.ShapeDtypeStruct(dims, x.dtype)   # noqa: E731
    return GrammarTables(spec(tables.mask, states, tables.mask.shape[1]),
                         spec(tables.starts, states + 1), spec(tables.tokens, edges),
                         spec(tables.next, edges), spec(tables.live, *tables.live.shape))


__all__ = ["GrammarRows", "TableGrowth", "abstract_tables"]
