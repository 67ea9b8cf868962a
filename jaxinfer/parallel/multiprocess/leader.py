"""Process 0 of the job: an `LLM` whose runners send every program call to
the followers before running it.

The seam is the runner's program call (`ModelRunner.programs(fn, *args)`:
admission, the ragged step, the decode loop): each argument is either the
runner's own device state (params, KV cache, row state, stop rule, draft
params: every process holds its shard of the same arrays) or host input
computed for this call (the step's token batch and block tables, the
admitted rows' budgets, PRNG keys and prompt ids, decode slots). Process 0
sends the host inputs as numpy (the rows that changed since the runner's
last call of the program, `codec`) with the names of the state arguments; a
follower (`follower.follow`) runs the same program on its own state and
keeps the new KV cache and row state, as the runner does. Everything the
runner decides on the host (buckets, seeds drawn for unseeded requests,
grammar states) is decided once, here.

Not across processes (refused with a clear error): structured output (its
automata's device tables are built on the host per runner), page
export/import (disaggregation), update_weights, sleep / wake_up, and
programs called outside a runner (`LLM.score`, `prompt_logprobs`).
"""

from __future__ import annotations

import weakref
from typing import Optional

import jax
import numpy as np

from jaxinfer.config import SchedulerConfig
from jaxinfer.parallel.multiprocess.codec import HostCodec
from jaxinfer.parallel.multiprocess.job import Job
from jaxinfer.parallel.sharding import MeshPrograms, state_sharding
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.runner import ModelRunner

# The runner attributes a program may take as device state (sent by name).
STATE = ("params", "cache", "rows", "stop", "draft_params")
# Static arguments that are the runner's own attributes (sent by name).
STATIC = ("config", "backend", "spec")

_NOT_ACROSS = "is not supported with a model across processes (num_processes > 1)"


def globalize(args, mesh, plan):
    """`args` with every leaf that is not yet an array of the whole job (host
    inputs, a KV pool or row state just allocated in this process) made one
    from this process's copy, on its `state_sharding` (replicated for host
    inputs), without communicating: every process holds the same value.
    (`jax.device_put` would compare the copies across processes, a
    collective per leaf, and refuses committed arrays.)"""
    def one(x, target):
        if x is None or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):     # PRNG keys: their words
            data = np.asarray(jax.random.key_data(x))
            words = jax.make_array_from_callback(data.shape, target, lambda index: data[index])
            return jax.random.wrap_key_data(words, impl=jax.random.key_impl(x))
        data = np.asarray(x)
        return jax.make_array_from_callback(data.shape, target, lambda index: data[index])
    return jax.tree_util.tree_map(one, args, state_sharding(args, mesh, plan))


def keep_global(runner, sent_args, args) -> None:
    """Store the job-wide copies of the runner's state arguments back on the
    runner, so that each is made once (`globalize`)."""
    for (kind, name), value in zip(sent_args, args):
        if kind == "state" and getattr(runner, name) is not value:
            setattr(runner, name, value)


class LeaderPrograms(MeshPrograms):
    """Process 0's `MeshPrograms`: its programs run only through a
    `LeaderRunner` (which sends them to the followers first); a direct call
    would wait forever for the other processes.

    Raises (on a direct call):
      RuntimeError: naming the program.
    """

    def __call__(self, fn, *args, **static):
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} {_NOT_ACROSS}: only the serving "
                           "scheduler's programs run on every process")

    def run(self, fn, *args, **static):
        return MeshPrograms.__call__(self, fn, *args, **static)


class _Forward:
    """A `LeaderRunner`'s `programs`: each call goes to the followers, then
    runs here; everything else is the LLM's `LeaderPrograms`."""

    def __init__(self, runner: "LeaderRunner", programs: LeaderPrograms):
        self._runner, self._programs = weakref.proxy(runner), programs
        self._codec = HostCodec()

    def __getattr__(self, name):
        return getattr(self._programs, name)

    def __call__(self, fn, *args, **static):
        runner, job = self._runner, self._runner.job
        sent_args, encoded = [], []
        for i, a in enumerate(args):
            name = next((n for n in STATE if a is not None and a is getattr(runner, n)), None)
            sent_args.append(("state", name) if name else ("host", None))
            encoded.append(("state", name) if name else
                           ("host", self._codec.encode(fn.__name__, i, jax.device_get(a))))
        sent_static = {k: ("attr", None) if k in STATIC and v is getattr(runner, k)
                       else ("value", v) for k, v in static.items()}
        job.send(("call", runner.runner_id, (fn.__module__, fn.__name__), encoded, sent_static))
        try:
            args = globalize(args, self._programs.mesh, self._programs.plan)
            keep_global(runner, sent_args, args)
            return self._programs.run(fn, *args, **static)
        except Exception as e:  # noqa: BLE001 - a collective failed: the job cannot go on
            raise job.fail(e) from e


class LeaderRunner(ModelRunner):
    """A `ModelRunner` of process 0 (module docstring): its programs run on
    every process of `job`. A failed call or fetch stops the job: the
    error and every later `reset` raise `JobError`, so the engine thread
    fails its requests and stops.

    Args:
      job: this process's `Job` (process 0).
      runner_id: the followers' name for this runner.
      args, kwargs: as `ModelRunner`.
    """

    tables_from_start = False    # structured output is refused: no grammar tables (as followers)

    def __init__(self, job: Job, runner_id: int, *args, **kwargs):
        self.job = None                      # ModelRunner.__init__'s reset is not sent
        super().__init__(*args, **kwargs)
        self.job, self.runner_id = job, runner_id
        self.programs = _Forward(self, self.programs)
        weakref.finalize(self, job.drop_runner, runner_id)

    def reset(self) -> None:
        if self.job is not None:
            self.job.send(("reset", self.runner_id))     # raises the job's error once it failed
        super().reset()

    def warmup(self, num_logprobs=(-1,), background: bool = False, log=lambda msg: None) -> int:
        self.job.send(("warmup", self.runner_id, tuple(num_logprobs)))
        return super().warmup(num_logprobs, background, log)

    def fetch(self, dispatched):
        try:
            return super().fetch(dispatched)
        except Exception as e:  # noqa: BLE001 - the step's collectives failed
            raise self.job.fail(e) from e

    def check_structured(self, request) -> None:
        if request.sampling.structured is not None:
            raise ValueError(f"structured output {_NOT_ACROSS}")

    def read_pages(self, *args, **kwargs):
        raise NotImplementedError(f"reading KV pages {_NOT_ACROSS}")

    def write_pages(self, *args, **kwargs):
        raise NotImplementedError(f"writing KV pages {_NOT_ACROSS}")


class LeaderLLM(LLM):
    """Process 0's `LLM` (module docstring): `generate`, `stream` and the
    scheduler (the HTTP server's) run on every process of `job`, set after
    construction (`multiprocess.job_llm`)."""

    job: Optional[Job] = None

    def runner(self, max_num_seqs: int, scheduler_config: Optional[SchedulerConfig] = None
               ) -> LeaderRunner:
        sched = (scheduler_config or self.scheduler_config).replace(max_num_seqs=max_num_seqs)
        runner_id = self.job.new_runner_id()
        self.job.send(("runner", runner_id, sched))
        runner = LeaderRunner(self.job, runner_id, self.config, self.params,
                              self.pool_config(sched), sched, tokens=self.tokens,
                              speculative=self.speculative, programs=self.programs,
                              backend=self.backend)
        runner.controls = self.controls
        self._runners.add(runner)
        return runner

    def update_weights(self, params) -> None:
        raise NotImplementedError(f"update_weights {_NOT_ACROSS}")

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError(f"sleep {_NOT_ACROSS}")

    def wake_up(self) -> None:
        raise NotImplementedError(f"wake_up {_NOT_ACROSS}")


__all__ = ["LeaderLLM", "LeaderPrograms", "LeaderRunner", "STATE", "STATIC", "globalize",
           "keep_global"]
