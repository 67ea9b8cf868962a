"""A process of the job other than 0: it holds its shard of the model and of
every runner's device state, and runs each program process 0 sends
(`leader` module docstring) until told to stop.

Messages (each with the ids of runners process 0 dropped since the last):

    ("runner", id, SchedulerConfig)     build a runner like process 0's (`LLM.runner`)
    ("reset", id)                       its `ModelRunner.reset`
    ("warmup", id, num_logprobs)        compile its plan in the background
    ("call", id, (module, name), args, static)
                                        run program module.name: args are ("state",
                                        runner attribute) or ("host", numpy tree as
                                        `codec.HostCodec` encoded it);
                                        static ("attr", None) is the runner's own
    ("stop",)                           leave
"""

from __future__ import annotations

import importlib
import threading
from typing import Optional

from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.parallel.multiprocess.codec import HostCodec
from jaxinfer.parallel.multiprocess.job import Job, JobError
from jaxinfer.parallel.multiprocess.leader import STATE, STATIC, globalize, keep_global
from jaxinfer.sampling.rows import RowState


def follow(llm, job: Job, stop: Optional[threading.Event] = None) -> int:
    """Run process 0's program calls on this process's shard of `llm` (a
    tensor-parallel `LLM` on the job's mesh, built as process 0's) until
    process 0 says stop (or `stop` is set). Returns the calls run.

    Raises:
      JobError: process 0 is gone, or a program failed (a collective with a
        process that is gone); the message names which.
      ValueError: a message this follower cannot run (a program outside
        jaxinfer, an unknown runner or state name).
    """
    runners, codecs, calls = {}, {}, 0
    while True:
        message = job.channel.receive(stop)
        if message is None:
            return calls
        dropped, body = message
        for runner_id in dropped:
            runners.pop(runner_id, None)
            codecs.pop(runner_id, None)
        kind = body[0]
        if kind == "stop":
            return calls
        if kind == "runner":
            _, runner_id, sched = body
            runners[runner_id] = llm.runner(sched.max_num_seqs, sched)
            codecs[runner_id] = HostCodec()
            continue
        runner = runners.get(body[1])
        if runner is None:
            raise ValueError(f"process 0 sent {kind!r} for runner {body[1]}, which this process "
                             "does not have")
        if kind == "reset":
            runner.reset()
        elif kind == "warmup":
            runner.warmup(body[2], background=True)
        elif kind == "call":
            try:
                _replay(runner, codecs[body[1]], *body[2:])
            except (ValueError, JobError):
                raise
            except Exception as e:  # noqa: BLE001 - XLA's errors: a collective failed
                raise JobError(f"process {job.settings.process_id}: a step failed (process 0 or "
                               f"another process of the job is gone): {type(e).__name__}: {e}"
                               ) from e
            calls += 1
        else:
            raise ValueError(f"unknown message {kind!r} from process 0")


def _replay(runner, codec: HostCodec, fn_ref, args, static) -> None:
    """Run one program call on `runner`'s state; keep its new KV cache and rows."""
    module, name = fn_ref
    if not module.startswith("jaxinfer."):
        raise ValueError(f"process 0 asked for program {module}.{name}, outside jaxinfer")
    fn = getattr(importlib.import_module(module), name)
    values = []
    for i, (kind, value) in enumerate(args):
        if kind == "state":
            if value not in STATE:
                raise ValueError(f"unknown runner state {value!r}")
            values.append(getattr(runner, value))
        else:
            values.append(codec.decode(name, i, value))
    kwargs = {}
    for key, (kind, value) in static.items():
        if kind == "attr" and key not in STATIC:
            raise ValueError(f"unknown runner attribute {key!r}")
        kwargs[key] = getattr(runner, key) if kind == "attr" else value
    programs = runner.programs
    values = globalize(tuple(values), programs.mesh, programs.plan)
    keep_global(runner, args, values)
    out = programs(fn, *values, **kwargs)
    for x in out if type(out) is tuple else (out,):
        if isinstance(x, PagedKVCache):
            runner.cache = x
        elif isinstance(x, RowState):
            runner.rows = x


__all__ = ["follow"]
