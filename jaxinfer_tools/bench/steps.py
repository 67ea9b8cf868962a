"""The serving step, driven directly for timing (`serving.runner.ModelRunner`,
no scheduler): the benches' prefill and decode cells.

    runner = new_runner(config, params, slots=B, max_seq_len=S, pool_tokens=n)
    tables = slot_tables(runner)              # each slot its own pages, shuffled
    run_prompts(runner, tables, prompts)      # admission, prompt chunks in token-budget steps
    fill_slots(runner, tables, context)       # every slot holding `context` positions
    timed(runner.programs, lambda: runner.fetch(runner.decode(slots, tables, k)))

The bench owns the block tables here (no `KVPageManager`): the pool is split
evenly between the slots, each slot's pages in shuffled order (a pool some
time into serving is fragmented), and entries past a slot's pages hold P
("no page"), as the scheduler's tables do for pages not allocated yet. On
CPU with float32 pools a step's attention is the C++ ragged kernel, which
reads a slot's pages up to each query's position; the XLA path (other
backends, int8 pools) gathers every entry of a slot's table per query, so
there a runner's `max_seq_len` is part of what a cell measures: the cells
state it.

Rows are greedy, `ignore_eos`, with no stop token: a row generates until its
`max_new_tokens`, so a timed step never finds its rows done.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import CacheConfig, Request, SamplingParams, SchedulerConfig
from jaxinfer.testing import Admission, ModelRunner, ProgramCache, Segment, paged
from jaxinfer_tools.bench.common import random_prompts

GREEDY = SamplingParams(temperature=0.0)


def new_runner(config, params: dict, *, slots: int, max_seq_len: int, pool_tokens: int,
               page_size: int = 16, token_budget: int = 512, dtype=jnp.float32,
               kv_cache_dtype: Optional[str] = None,
               programs: Optional[ProgramCache] = None) -> ModelRunner:
    """A `ModelRunner` of `slots` slots of `max_seq_len` positions whose pool
    holds `pool_tokens` positions per slot (rounded up to whole pages), with
    no stop tokens; `params` prepared (`weights.prepare.prepare_params`)."""
    pages = slots * -(-pool_tokens // page_size)
    cache = CacheConfig(max_seq_len=max_seq_len, dtype=jnp.dtype(dtype).name,
                        kv_cache_dtype=kv_cache_dtype, page_size=page_size, num_pages=pages)
    return ModelRunner(config, params, cache, SchedulerConfig(slots, token_budget),
                       programs=programs)


def slot_tables(runner: ModelRunner, seed: int = 0) -> np.ndarray:
    """int32 [S, M] block tables: the pool's P pages split evenly between the
    S slots (min(M, P // S) each) in a shuffled order, P past each slot's share."""
    s, m, p = runner.max_num_seqs, runner.pages_per_seq, runner.num_pages
    share = min(m, p // s)
    tables = np.full((s, m), p, np.int32)
    tables[:, :share] = np.random.default_rng(seed).permutation(p)[:s * share].reshape(s, share)
    return tables


def pack_prompts(lengths: Sequence[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Prompt chunks packed into steps of at most `budget` tokens, first come
    first served (as the scheduler fills a budget with prompts): each step is
    a list of (prompt index, start, stop) token ranges.

    Raises:
      ValueError: budget < 1.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    steps, step, room = [], [], budget
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(n - start, room)
            step.append((i, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                steps.append(step)
                step, room = [], budget
    if step:
        steps.append(step)
    return steps


def admit_rows(runner: ModelRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               cached: int = 0) -> None:
    """Admit prompt i into slot i (greedy, ignore_eos), `cached` of its
    positions already in the slot's pages (`ModelRunner.admit`)."""
    runner.admit([Admission(i, Request(tuple(p), GREEDY, max_new_tokens, ignore_eos=True),
                            cached=cached) for i, p in enumerate(prompts)])


def prefill_steps(runner: ModelRunner, tables: np.ndarray, prompts: Sequence[Sequence[int]]):
    """Dispatch the steps that prefill `prompts` in slots 0, 1, ... (admitted
    already): `pack_prompts` in the runner's token budget, each prompt's last
    chunk sampling its first token in the same step. Returns the last step's
    fetched outputs: once they are on the host, every first token is."""
    out = None
    for step in pack_prompts([len(p) for p in prompts], runner.token_budget):
        out = runner.step([Segment(i, tuple(prompts[i][a:b]), sample=b == len(prompts[i]))
                           for i, a, b in step], tables)
    return runner.fetch(out)


def run_prompts(runner: ModelRunner, tables: np.ndarray, prompts: Sequence[Sequence[int]],
                max_new_tokens: int = 1):
    """Admit `prompts` into slots 0, 1, ... (`admit_rows`), then
    `prefill_steps`; returns its outputs."""
    admit_rows(runner, prompts, max_new_tokens)
    return prefill_steps(runner, tables, prompts)


def fill_slots(runner: ModelRunner, tables: np.ndarray, context: int, seed: int = 0) -> list[int]:
    """Make every slot hold `context` positions of one random prompt: it is
    prefilled through steps in slot 0, its pages copied into every other
    slot's own pages (`cache.paged.read_pages` / `write_pages`), then every
    slot is admitted afresh with `cached=context` (decoding rows whose next
    token goes to position `context`, budget up to max_seq_len; `reset_slots`
    puts them back there: decoding never writes their first `context`
    positions). Returns the prompt.

    Raises:
      ValueError: context outside [1, max_seq_len), or beyond a slot's pages.
    """
    if not 1 <= context < runner.max_seq_len:
        raise ValueError(f"context must be in [1, {runner.max_seq_len}), got {context}")
    n = -(-context // runner.page_size)
    if (tables[:, :n] >= runner.num_pages).any():
        raise ValueError(f"{context} positions need {n} pages per slot; the tables give fewer")
    [prompt] = random_prompts(runner.config.vocab_size, 1, context, seed).tolist()
    admit_rows(runner, [prompt] * runner.max_num_seqs, 1)   # the admission `reset_slots` reruns
    prefill_steps(runner, tables, [prompt])
    if runner.max_num_seqs > 1:
        data = paged.read_pages(runner.cache, jnp.asarray(tables[0, :n]))
        rest = runner.max_num_seqs - 1
        tiled = jax.tree_util.tree_map(lambda x: jnp.tile(x, (rest,) + (1,) * (x.ndim - 1)), data)
        runner.cache = paged.write_pages(runner.cache, jnp.asarray(tables[1:, :n].reshape(-1)), tiled)
    reset_slots(runner, prompt)
    return prompt


def reset_slots(runner: ModelRunner, prompt: Sequence[int]) -> None:
    """Admit every slot afresh as a decoding row of `prompt`, whose
    len(prompt) positions its pages already hold (`fill_slots`); returns
    once the admission is computed, so a timer started next times only what
    follows."""
    context = len(prompt)
    admit_rows(runner, [prompt] * runner.max_num_seqs, runner.max_seq_len - context, cached=context)
    jax.block_until_ready(runner.cache)


def decode_segments(runner: ModelRunner) -> list[Segment]:
    """One decoding segment per slot: a step in which every row decodes."""
    return [Segment(s) for s in range(runner.max_num_seqs)]


def timed(programs: ProgramCache, fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds, compile seconds) of `fn()`, which returns once its outputs
    are computed (fetched, or `block_until_ready`): wall seconds less the
    seconds `programs` spent compiling meanwhile."""
    c0, t0 = programs.compile_s, time.perf_counter()
    fn()
    compile_s = programs.compile_s - c0
    return time.perf_counter() - t0 - compile_s, compile_s
