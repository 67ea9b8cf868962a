"""`jaxinfer serve` with tp > 1 or num_processes > 1: the model sharded over
this process's devices, or over the devices of a job of processes
(`parallel.multiprocess`): one command per process, the same but for
process_id,

    jaxinfer serve --config C tp=2 coordinator=10.0.0.1:1234 num_processes=2 process_id=0
    jaxinfer serve --config C tp=2 coordinator=10.0.0.1:1234 num_processes=2 process_id=1

Process 0 serves HTTP; the others run its steps until it stops (exit 0) or
is gone (JAX's coordination client ends them with status 134 and its
message, or a failed collective with status 1 and a `JobError`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

import jax.numpy as jnp

from jaxinfer.parallel import multiprocess, sharding
from jaxinfer.parallel.disagg.process import DEFAULT_HEARTBEAT_S
from jaxinfer.parallel.multiprocess import Job, JobError, JobSettings
from jaxinfer.serving.loading import load_model


def job_settings(cfg, heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> Optional[JobSettings]:
    """The `JobSettings` of a `GenerationConfig` and serve's --heartbeat-s
    (None: one process), checked (ValueError for bad coordinator settings,
    before any work)."""
    if cfg.num_processes == 1:
        return None
    settings = JobSettings(cfg.coordinator, cfg.num_processes, cfg.process_id, heartbeat_s)
    settings.check(cfg.tp)
    return settings


def sharded_llm(cfg, progress=None, heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> tuple:
    """(LLM, Job or None) for a config with tp > 1 or num_processes > 1: the
    job joined first (`multiprocess.join`), then the model read as raw
    params and sharded (`sharding.tensor_parallel_llm` /
    `multiprocess.job_llm`) with the config's cache, scheduler and serving
    settings.

    Raises:
      ValueError: bad job settings (before any work), too few devices.
      JobError: the job could not be joined.
    """
    settings = job_settings(cfg, heartbeat_s)
    job = None
    if settings is not None:
        job, mesh = multiprocess.join(settings, cfg.tp)
    else:
        mesh = sharding.make_mesh(cfg.tp)
    config, params, tokenizer = load_model(cfg.model, jnp.dtype(cfg.dtype), progress=progress)
    kwargs = dict(cache_config=cfg.cache, scheduler_config=cfg.scheduler,
                  deterministic=cfg.deterministic, grammar_cache_bytes=cfg.grammar_cache_bytes,
                  chat_template=cfg.chat_template)
    if job is None:
        llm = sharding.tensor_parallel_llm(config, params, tokenizer, mesh, **kwargs)
    else:
        llm = multiprocess.job_llm(job, mesh, config, params, tokenizer, **kwargs)
    llm.programs.max_programs = cfg.max_programs
    return llm, job


def follow(llm, job: Job, log) -> int:
    """A process other than 0: run process 0's steps until it stops the job
    (returns 0) or is gone (returns 1, the reason logged)."""
    log(f"process {job.settings.process_id} of {job.settings.num_processes} (pid {os.getpid()}): "
        "following process 0")
    try:
        calls = multiprocess.follow(llm, job)
    except JobError as e:
        log(f"error: {e}")
        return 1
    job.channel.say_bye()
    log(f"process 0 stopped the job after {calls} steps")
    return 0


def watch(job: Job, engine, server, log, every_s: float = 0.2) -> list:
    """Process 0: a thread that stops `server` (uvicorn's) once the job or
    the engine thread failed; returns a list that then holds the error."""
    failed = []

    def run():
        while not server.should_exit:
            error = job.error or engine.error
            if error is not None:
                log(f"error: {error}; stopping the server")
                failed.append(error)
                server.should_exit = True
                return
            time.sleep(every_s)

    threading.Thread(target=run, name="jaxinfer-job-watch", daemon=True).start()
    return failed


def leave(job: Job, code: int) -> None:
    """End this process of the job with exit status `code`: process 0 stops
    the job first (`Job.stop`) and returns when `code` is 0; otherwise (a
    failed job: its engine thread may still wait in a collective) and for a
    follower the process exits at once, without disconnecting."""
    if job.leader:
        job.stop()
        if code == 0:
            return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["follow", "job_settings", "leave", "sharded_llm", "watch"]
