"""`ProgramCache` keeps at most `max_programs` compiled programs alive:
the least recently used is evicted, its code unmapped, and it compiles
again when next needed; serving runs unchanged under a small cap."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, GenerationConfig, SchedulerConfig
from jaxinfer.config.generation import DEFAULT_MAX_PROGRAMS
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.request import Request
from jaxinfer.serving.runner import ModelRunner
from jaxinfer.serving.scheduler import Scheduler
from serving_runs import ids, run
from tiny import TINY_LLAMA, random_params

from jaxinfer import models


@jax.jit
def _f(x):
    return jnp.sin(x) * 2.0 + jnp.cumsum(x, axis=0)


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _arg(n):
    return jax.ShapeDtypeStruct((n, 8), jnp.float32)


def test_default_cap_and_bad_caps():
    assert ProgramCache().max_programs == DEFAULT_MAX_PROGRAMS == 512
    assert GenerationConfig().max_programs == 512
    assert GenerationConfig.load(None, ("max_programs=null",)).max_programs is None
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="max_programs must be >= 1"):
            ProgramCache(bad)
    with pytest.raises(ValueError, match="max_programs must be >= 1 or null, got 0"):
        GenerationConfig.load(None, ("max_programs=0",))


def test_least_recently_used_is_evicted_and_recompiled():
    cache = ProgramCache(max_programs=2)
    a, b = cache.compiled(_f, _arg(1)), cache.compiled(_f, _arg(2))
    assert cache.compiled(_f, _arg(1)) is a            # a hit makes 1 the most recent
    cache.compiled(_f, _arg(3))                        # evicts 2, not 1
    assert (cache.num_programs, cache.num_compiles, cache.num_evictions) == (2, 3, 1)
    assert cache.has(_f, _arg(1)) and cache.has(_f, _arg(3)) and not cache.has(_f, _arg(2))
    b2 = cache.compiled(_f, _arg(2))                   # compiled again, evicts 1
    assert b2 is not b and cache.num_compiles == 4 and not cache.has(_f, _arg(1))
    x = jnp.arange(16, dtype=jnp.float32).reshape(2, 8)
    np.testing.assert_array_equal(np.asarray(cache(_f, x)), np.asarray(_f(x)))
    cache.max_programs = 1                             # lowering the cap evicts at once
    assert cache.num_programs == 1 and cache.num_evictions == 3
    cache.max_programs = None
    for n in range(1, 6):
        cache.compiled(_f, _arg(n))
    assert cache.num_programs == 5


def test_compiling_past_the_cap_keeps_the_memory_maps_bounded():
    """40 distinct shapes under a cap of 4: 4 programs stay alive, and the
    process's memory maps grow by far less than 36 more programs' worth
    (measured: the maps 8 kept programs add)."""
    busy = [t.name for t in threading.enumerate() if t.name == "jaxinfer-compile"]
    assert not busy, f"background compiles would add maps under the measurement: {busy}"
    jax.clear_caches()
    gc.collect()
    kept, before = ProgramCache(max_programs=None), _maps()
    for n in range(100, 108):
        kept.compiled(_f, _arg(n))
    per_program = (_maps() - before) / 8
    assert per_program >= 4, per_program               # each program maps its code

    capped = ProgramCache(max_programs=4)
    for n in range(1, 5):
        capped.compiled(_f, _arg(n))
    gc.collect()
    start = _maps()
    for n in range(5, 41):
        capped.compiled(_f, _arg(n))
    gc.collect()
    assert (capped.num_programs, capped.num_compiles, capped.num_evictions) == (4, 40, 36)
    grown = _maps() - start
    assert grown < 4 * per_program, (grown, per_program)    # vs ~36 * per_program uncapped
    del kept
    jax.clear_caches()


@pytest.mark.slow
def test_serving_under_a_cap_of_two_programs_gives_the_same_tokens():
    """A runner with 4 token buckets plus admission (5 programs) under a
    cap of 2 evicts and recompiles as prompts of different lengths come,
    and generates what an uncapped runner does."""
    params = models.family("llama").prepare(random_params(TINY_LLAMA), TINY_LLAMA)

    def serve(max_programs):
        programs = ProgramCache(max_programs=max_programs)
        cache = CacheConfig(max_seq_len=48, page_size=4, num_pages=24)
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, decode_chunk=1,
                                 prefill_chunk_size=None)
        runner = ModelRunner(TINY_LLAMA, params, cache, config, programs=programs)
        sched = Scheduler(runner, config, cache)
        reqs = [Request(tuple(ids(n, TINY_LLAMA.vocab_size, n)), max_new_tokens=4)
                for n in (30, 3, 13, 6)]
        out = [tokens for tokens, _ in run(sched, reqs, arrive=[0, 0, 3, 6])]
        return out, programs

    want, free = serve(None)
    got, capped = serve(2)
    assert got == want and all(len(t) == 4 for t in got)
    assert capped.num_programs == 2 and free.num_programs == free.num_compiles >= 4
    assert capped.num_compiles > free.num_compiles       # evicted programs compiled again
