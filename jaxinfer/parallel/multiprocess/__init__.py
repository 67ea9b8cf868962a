"""One model across processes: tensor parallelism over a mesh that spans the
processes of a `jax.distributed` job (CPU collectives through gloo; the same
programs use NCCL on GPUs and ICI on TPUs).

JAX's multi-controller model: every process runs the same compiled programs
on its shard. Process 0 runs the scheduler (and `jaxinfer serve`'s HTTP
server) and sends each program call's host inputs to the others through
the coordination service's key-value store; they replay the call.

    job.py        JobSettings (checked before any work), initialize, the mesh, the Channel, Job
    liveness.py   followers' beats, process 0's check between steps
    leader.py     process 0: LeaderLLM / LeaderRunner, whose program calls are sent first
    follower.py   the other processes: follow(llm, job) replays them
    launch.py     N local processes of one command, for testing

    job, mesh = multiprocess.join(JobSettings("10.0.0.1:1234", 2, rank), tp=2)
    llm = multiprocess.job_llm(job, mesh, config, params, tokenizer, max_seq_len=1024)
    if job.leader: ... llm.generate(...) / serve ...; job.stop()
    else: multiprocess.follow(llm, job)

A process that dies stops the job: its peers' next collective fails
(gloo sees the connection closed), process 0 fails the requests in flight
and its engine stops with a `JobError` naming the cause. A follower whose
process 0 (the coordination service's host) is gone is ended by JAX's
coordination client within a second, or raises a `JobError` when its
collective fails first. Tasks join as recoverable, so the coordination
service does not abort process 0 when a follower dies. A process that
stalls without dying (stopped, swapped out) holds its peers in their
collective until gloo's own timeout; between steps, and for a follower
that died while nothing ran, process 0 fails the job once a follower's
beat (`liveness`) has stopped for heartbeat_s seconds.
"""

from __future__ import annotations

from jaxinfer.parallel.multiprocess.follower import follow
from jaxinfer.parallel.multiprocess.job import Job, JobError, JobSettings, initialize, job_mesh
from jaxinfer.parallel.multiprocess.leader import LeaderLLM, LeaderPrograms, LeaderRunner
from jaxinfer.parallel.multiprocess.liveness import Liveness
from jaxinfer.parallel.sharding import tensor_parallel_llm
from jaxinfer.serving.llm import LLM


def join(settings: JobSettings, tp: int):
    """Check `settings` for a mesh of `tp` devices, join the job
    (`initialize`) and return (Job, the job's mesh). Call before anything
    touches JAX's backend in this process.

    Raises:
      ValueError: bad settings (`JobSettings.check`), before any work; a tp
        that is not the job's device count (`job_mesh`).
      JobError: the job could not be joined in time.
    """
    settings.check(tp)
    initialize(settings)
    mesh, job = job_mesh(tp), Job(settings)
    watch(job)
    return job, mesh


def watch(job: Job, every_s: float = 1.0) -> None:
    """Start this process's `Liveness` thread (until `Job.stop`): a follower
    beats; process 0 fails the job (`Job.fail`) once a follower has not been
    heard from for heartbeat_s seconds."""
    n = job.settings.num_processes

    def stalled(found):
        ranks = ", ".join(f"process {rank} for {seconds:.0f} s" for rank, seconds in found)
        job.fail(JobError(f"the tensor-parallel job of {n} processes stopped: not heard from "
                          f"{ranks} (gone, stopped or hung)"))

    Liveness(n, job.settings.process_id, job.settings.heartbeat_s, every_s).start(
        stalled, stop=job.stopped)


def job_llm(job: Job, mesh, config, params, tokenizer, **llm_kwargs) -> LLM:
    """`sharding.tensor_parallel_llm` on the job's mesh: on process 0 a
    `LeaderLLM` (its runners run on every process), elsewhere a plain
    tensor-parallel `LLM` for `follow`. Every process must build it from
    the same model and settings.

    Args:
      params: raw or unpacked prepared params (as `shard_params`).
      llm_kwargs: as for `LLM` (cache_config, scheduler_config, max_seq_len, ...).
    """
    if not job.leader:
        return tensor_parallel_llm(config, params, tokenizer, mesh, **llm_kwargs)
    llm = tensor_parallel_llm(config, params, tokenizer, mesh, llm_class=LeaderLLM,
                              programs_class=LeaderPrograms, **llm_kwargs)
    llm.job = job
    return llm


__all__ = ["Job", "JobError", "JobSettings", "LeaderLLM", "LeaderPrograms", "LeaderRunner",
           "Liveness", "follow", "initialize", "job_llm", "job_mesh", "join", "watch"]
