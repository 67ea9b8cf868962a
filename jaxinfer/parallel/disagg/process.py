"""Disaggregation across processes: prefill worker processes and one decode
process, joined by `jax.distributed`, the KV pulled with
`jax.experimental.transfer`.

The decode process is JAX process 0: it hosts the coordination service,
runs the `DisaggScheduler` (the router: it picks a prefill worker per
request, receives the KV, streams the results) and supervises the workers
(`ProcessPrefillClient`): it starts them, sees them exit
(`subprocess.Popen.poll`), fails the one request a dead worker was
prefilling, queues the ones it had not started for its restarted
successor, and restarts it (`max_restarts` times, then reports it down).
Workers join with `jax_enable_recoverability`, so one dying does not take
the job down, and a restarted worker reconnects with the same process id.
A worker whose coordinator is gone exits: JAX terminates a serving one
(its error poll fails), and every worker watches its parent, so none
outlives the decode process. The worker process's side is `process_worker`.

Heartbeats: every process's coordination agent sends them from a thread
of its own; a process not heard from for `heartbeat_s` seconds (stopped,
swapped out, its host paused) is declared dead by the service, and the agent of the stalled process, once it runs again, aborts
it ("Terminating process because the JAX distributed service detected
fatal errors ... heartbeat timeout"). A stalled worker is then restarted;
a stalled decode process aborts the whole engine. Worker death is seen by
`Popen.poll`, not by heartbeats, so a long timeout costs no detection
speed: `DEFAULT_HEARTBEAT_S` (docs/disaggregation.md, "Heartbeats").

Control messages go through the coordination service's key-value store
(small pickled values under `jaxinfer/p{worker}/{incarnation}/`; every
process is started by this module, so the peers are trusted):

    req/{seq}      decode -> worker   (request id, Request), seq = 0, 1, ...
    cancel/{rid}   decode -> worker   the request was aborted: skip it
    started/{seq}  worker -> decode   its prefill has begun (it fails if the worker dies)
    done/{seq}     worker -> decode   PrefillResult: a Ticket, or an error
    ack/{key}      decode -> worker   the KV under ticket `key` was pulled: free it
    held           worker -> decode   how many offered trees it still holds
    address, ready worker -> decode   its transfer server; up and serving
    stop           decode -> worker   exit
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from jaxinfer.parallel.disagg.scheduler import PrefillResult
from jaxinfer.serving.request import Request
from jaxinfer.parallel import sharding
from jaxinfer.parallel.disagg.transfer import PullTransport

NAMESPACE = "jaxinfer"
# Seconds a process may go unheard before the coordination service declares it
# dead and aborts it. 10 s aborted engines whose processes were stalled that
# long (a stopped or swapped-out process); a worker's death is seen by process
# polling instead, so a minute costs no detection speed. JAX's own default is 100 s.
DEFAULT_HEARTBEAT_S = 60


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """How to start one model worker (a prefill process, or the decode side).

    Attributes:
      source: a model for `sharding.load_llm` (name, .gguf path, HF folder); or
      factory: "module:function" returning (config, params, tokenizer),
        for models built in code (tests).
      tp: tensor-parallel size (devices of this process; on CPU forced with
        `--xla_force_host_platform_device_count`).
      dtype: params and KV-cache dtype name.
      llm_kwargs: `LLM` keyword arguments (max_seq_len, decode_chunk,
        prefill_chunk_size, min_prompt_bucket, ...); both sides must
        agree on the buckets.
      cpus: CPU cores to pin the process to (`os.sched_setaffinity`), or None.
      host: address of the transfer server.
      stall_on_prompt_len: fault injection for tests: a worker sleeps
        `stall_s` seconds in the middle of prefilling a prompt of exactly
        this many tokens (so a test can kill it mid-request), 0 = never.
    """

    source: str = ""
    factory: str = ""
    tp: int = 1
    dtype: str = "float32"
    llm_kwargs: tuple = ()
    cpus: Optional[tuple[int, ...]] = None
    host: str = "127.0.0.1"
    stall_on_prompt_len: int = 0
    stall_s: float = 0.0

    def kwargs(self) -> dict:
        return dict(self.llm_kwargs)


def build_llm(spec: WorkerSpec, devices=None):
    """The `LLM` a spec describes, on a tp mesh of this process's devices."""

    mesh = sharding.make_mesh(spec.tp, devices=devices)
    if spec.factory:
        module, function = spec.factory.split(":")
        config, params, tokenizer = getattr(importlib.import_module(module), function)()
        return sharding.tensor_parallel_llm(config, params, tokenizer, mesh, **spec.kwargs())
    return sharding.load_llm(spec.source, mesh, dtype=spec.dtype, progress=False, **spec.kwargs())


def configure_host(num_devices: int, cpus: Optional[Sequence[int]] = None) -> None:
    """Before JAX starts its backend in this process: pin it to `cpus` and
    give the CPU backend `num_devices` devices.

    Raises:
      RuntimeError: JAX's backend is already initialized (too late).
    """
    import jax

    if cpus:
        os.sched_setaffinity(0, set(cpus))
    jax.config.update("jax_num_cpu_devices", int(num_devices))   # raises once the backend is up


def _kv():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized in this process")
    return client


def _try_get(client, key: str) -> Optional[bytes]:
    try:
        return client.key_value_try_get_bytes(key)
    except Exception as e:  # noqa: BLE001 - NOT_FOUND is the expected miss
        if "NOT_FOUND" in str(e):
            return None
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the decode side: router and supervisor ----------------------------------------------------


@dataclasses.dataclass
class _Worker:
    index: int
    spec: WorkerSpec
    proc: Optional[subprocess.Popen] = None
    incarnation: int = 0
    state: str = "starting"       # starting | up | restarting | down
    address: str = ""
    started_at: float = 0.0
    next_req: int = 0
    next_done: int = 0
    sent: dict = dataclasses.field(default_factory=dict)      # seq -> (request id, Request)
    backlog: list = dataclasses.field(default_factory=list)   # (request id, Request) not sent yet
    restarts: int = 0
    last_exit: Optional[int] = None
    log_path: str = ""

    @property
    def ns(self) -> str:
        return f"{NAMESPACE}/p{self.index}/{self.incarnation}"

    @property
    def load(self) -> int:
        return len(self.sent) + len(self.backlog)


class ProcessPrefillClient:
    """`PrefillClient` over prefill worker processes, which it starts and
    supervises from the decode process (module docstring).

    Usage, in the decode process before JAX starts its backend:

        client = ProcessPrefillClient([WorkerSpec(...)], decode_devices=1)
        client.initialize()          # jax.distributed: this process is process 0
        ... build the decode LLM and `make_scheduler(llm, client)` ...
        client.close()

    Args:
      specs: one `WorkerSpec` per prefill worker.
      max_restarts: restarts per worker before it is reported down.
      startup_timeout_s: a worker not ready this long after its start is
        killed and counted as failed.
      hold_timeout_s: a worker drops offered KV nobody pulled after this long.
      heartbeat_s: `jax.distributed` heartbeat timeout of every process of
        the job (module docstring): a process stalled longer than this is
        aborted (a worker is then restarted; the decode process takes the
        engine down).
      log_dir: where each worker's output goes (prefill-{i}-{incarnation}.log);
        default a new temporary folder, deleted by `close` when every log
        in it is empty.
    """

    def __init__(self, specs: Sequence[WorkerSpec], *, max_restarts: int = 3,
                 startup_timeout_s: float = 600.0, hold_timeout_s: float = 300.0,
                 heartbeat_s: int = DEFAULT_HEARTBEAT_S, log_dir: Optional[str] = None):
        if int(heartbeat_s) < 1:
            raise ValueError(f"heartbeat_s must be >= 1 (seconds), got {heartbeat_s}")
        self.workers = [_Worker(i, spec) for i, spec in enumerate(specs)]
        self.max_restarts, self.startup_timeout_s = max_restarts, startup_timeout_s
        self.hold_timeout_s, self.heartbeat_s = hold_timeout_s, heartbeat_s
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="jaxinfer-prefill-")
        self.coordinator = f"127.0.0.1:{_free_port()}"
        self._transport = None
        self._failed: list[PrefillResult] = []
        self._origin: dict[int, tuple[str, _Worker]] = {}    # request id -> (namespace, worker)
        for w in self.workers:
            self._spawn(w)

    # --- lifecycle --------------------------------------------------------------------------

    def _spawn(self, w: _Worker) -> None:
        cfg = {"spec": dataclasses.asdict(w.spec), "coordinator": self.coordinator,
               "num_processes": len(self.workers) + 1, "process_id": w.index + 1,
               "worker": w.index, "namespace": w.ns, "init_timeout_s": int(self.startup_timeout_s),
               "heartbeat_s": int(self.heartbeat_s), "hold_timeout_s": self.hold_timeout_s,
               "parent_pid": os.getpid()}
        w.log_path = os.path.join(self.log_dir, f"prefill-{w.index}-{w.incarnation}.log")
        cpus = w.spec.cpus
        with open(w.log_path, "wb") as log:
            w.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxinfer.parallel.disagg.process_worker", json.dumps(cfg)],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                preexec_fn=(lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None)
        w.state, w.started_at, w.address = "starting", time.monotonic(), ""
        w.next_req = w.next_done = 0

    def initialize(self) -> None:
        """Join the job as process 0 (hosting the coordination service; waits
        for every worker to connect), then start this process's transfer
        server. Call before anything else touches JAX's backend."""
        import jax


        jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(self.coordinator, num_processes=len(self.workers) + 1,
                                   process_id=0, initialization_timeout=int(self.startup_timeout_s),
                                   heartbeat_timeout_seconds=int(self.heartbeat_s))
        self._transport = PullTransport(self.workers[0].spec.host if self.workers else "127.0.0.1")

    def transport(self):
        return self._transport

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every worker is up (or down for good).

        Raises:
          TimeoutError: a worker is still starting after timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while any(w.state in ("starting", "restarting") for w in self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill workers not ready after {timeout_s:.0f} s: "
                                   f"{[w.state for w in self.workers]}; logs in {self.log_dir}")
            self._failed += self._supervise()
            time.sleep(0.05)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers: asked (when the job is up), then terminated, then killed."""
        from jax._src import distributed

        client = distributed.global_state.client
        for w in self.workers:
            if client is not None and w.proc is not None and w.proc.poll() is None:
                client.key_value_set(f"{w.ns}/stop", "1", allow_overwrite=True)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.terminate()
                try:
                    w.proc.wait(5)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait(5)
        self._remove_empty_logs()

    def _remove_empty_logs(self) -> None:
        """Delete the log folder this client made when every log in it is
        empty (a folder given as log_dir, or any output, stays)."""
        if not self._own_log_dir or not os.path.isdir(self.log_dir):
            return
        names = os.listdir(self.log_dir)
        if all(os.path.getsize(os.path.join(self.log_dir, n)) == 0 for n in names):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def health(self) -> list[dict]:
        """Per worker: index, pid, state (starting / up / restarting / down),
        restarts, requests outstanding, KV trees it holds, last exit code, log."""
        out = []
        for w in self.workers:
            held = _try_get(_kv(), f"{w.ns}/held") if w.state == "up" else None
            out.append({"worker": w.index, "pid": w.proc.pid if w.proc else None, "state": w.state,
                        "restarts": w.restarts, "outstanding": w.load,
                        "held": int(held) if held is not None else None,
                        "last_exit": w.last_exit, "log": w.log_path})
        return out

    # --- PrefillClient ----------------------------------------------------------------------

    def submit(self, request_id: int, request: Request) -> None:
        alive = [w for w in self.workers if w.state != "down"]
        if not alive:
            self._failed.append(PrefillResult(request_id, error="no prefill worker is running "
                                              "(all exceeded their restarts)"))
            return
        w = min(alive, key=lambda w: (w.state != "up", w.load))
        w.backlog.append((request_id, request))
        if w.state == "up":
            self._flush(w)

    def _flush(self, w: _Worker) -> None:
        client = _kv()
        for rid, request in w.backlog:
            client.key_value_set_bytes(f"{w.ns}/req/{w.next_req}", pickle.dumps((rid, request)))
            w.sent[w.next_req] = (rid, request)
            w.next_req += 1
        w.backlog = []

    def poll(self) -> list[PrefillResult]:
        out, self._failed = self._failed + self._supervise(), []
        client = _kv()
        for w in self.workers:
            while w.state == "up" and w.next_done in w.sent:
                raw = _try_get(client, f"{w.ns}/done/{w.next_done}")
                if raw is None:
                    break
                result = pickle.loads(raw)
                client.key_value_delete(f"{w.ns}/done/{w.next_done}")
                del w.sent[w.next_done]
                w.next_done += 1
                if result.ticket is not None:
                    self._origin[result.request_id] = (w.ns, w)
                out.append(result)
        return out

    def cancel(self, request_id: int) -> None:
        for w in self.workers:
            w.backlog = [(r, q) for r, q in w.backlog if r != request_id]
            if request_id in [r for r, _ in w.sent.values()] and w.state == "up":
                _kv().key_value_set(f"{w.ns}/cancel/{request_id}", "1", allow_overwrite=True)

    def release(self, result: PrefillResult) -> None:
        origin = self._origin.pop(result.request_id, None)
        if origin is None or result.ticket is None:
            return
        ns, w = origin
        if ns == w.ns and w.state == "up":
            _kv().key_value_set(f"{ns}/ack/{result.ticket.key}", "1", allow_overwrite=True)

    # --- supervision ------------------------------------------------------------------------

    def _supervise(self) -> list[PrefillResult]:
        """Start-up, exits and restarts; returns failures to report."""
        failed = []
        for w in self.workers:
            if w.state == "down":
                continue
            code = w.proc.poll()
            if code is None and w.state in ("starting", "restarting"):
                if _try_get(_kv(), f"{w.ns}/ready") is not None:
                    w.address = _try_get(_kv(), f"{w.ns}/address").decode()
                    w.state = "up"
                    self._flush(w)
                elif time.monotonic() - w.started_at > self.startup_timeout_s:
                    w.proc.kill()
                    code = w.proc.wait(10)
            if code is not None:
                failed += self._on_exit(w, code)
        return failed

    def _on_exit(self, w: _Worker, code: int) -> list[PrefillResult]:
        client = _kv()
        failed, requeue = [], []
        for seq, (rid, request) in sorted(w.sent.items()):
            started = _try_get(client, f"{w.ns}/started/{seq}") is not None
            if started and _try_get(client, f"{w.ns}/done/{seq}") is None:
                failed.append(PrefillResult(rid, worker=w.index, error=(
                    f"prefill worker {w.index} (pid {w.proc.pid}) exited with code {code} while "
                    "prefilling this request")))
            else:       # not started (or answered but not yet polled: prefill it again)
                requeue.append((rid, request))
        w.sent, w.last_exit = {}, code
        if w.address and self._transport is not None:
            self._transport.forget(w.address)
        client.key_value_delete(w.ns)
        if w.restarts >= self.max_restarts:
            w.state = "down"
            for rid, _ in requeue + w.backlog:
                failed.append(PrefillResult(rid, worker=w.index, error=(
                    f"prefill worker {w.index} is down (exited with code {code}, "
                    f"{w.restarts} restarts)")))
            w.backlog = []
            return failed
        w.restarts += 1
        w.incarnation += 1
        w.backlog = requeue + w.backlog
        self._spawn(w)
        w.state = "restarting"
        return failed

