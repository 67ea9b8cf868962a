"""The job of processes one model spans: its settings (checked before any
work), joining it (`jax.distributed` with CPU collectives through gloo),
its mesh, and the channel that carries each program call's host inputs
from process 0 to the others (the coordination service's key-value store).

Channel keys (pickled values; every process of the job runs jaxinfer's
own code, so the peers are trusted):

    jaxinfer/tp/{rank}/{seq}   process 0 -> process rank   the seq-th message
    jaxinfer/tp/bye/{rank}     process rank -> process 0   it left after "stop"

Each follower deletes a message once read, so the store holds at most the
messages not yet read.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import threading
from typing import Optional

from jaxinfer.parallel.disagg.process import DEFAULT_HEARTBEAT_S
from jaxinfer.parallel.plan import make_mesh

PREFIX = "jaxinfer/tp"
POLL_MS = 1000        # a follower's wait for its next message, per try


class JobError(RuntimeError):
    """The job cannot go on: a process of it is gone or a collective failed."""


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """How one process joins the job (JAX's multi-process model: one command
    per process, the same except `process_id`).

    Attributes:
      coordinator: "host:port" of the coordination service, which process 0
        hosts (it binds the port on every interface).
      num_processes: processes in the job, >= 1.
      process_id: this process's rank in [0, num_processes); 0 runs the
        scheduler (and the HTTP server), the others follow.
      heartbeat_s: a process not heard from this long is declared dead
        (`jax.distributed` heartbeat timeout), >= 1.
      init_timeout_s: how long joining waits for every process, >= 1.
    """

    coordinator: str
    num_processes: int
    process_id: int
    heartbeat_s: int = DEFAULT_HEARTBEAT_S
    init_timeout_s: int = 300

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.coordinator.rpartition(":")
        return host.strip("[]"), int(port)

    def check(self, tp: int) -> None:
        """Raise ValueError, before any work, for settings that cannot make a
        job of `tp` devices: a coordinator that is not host:port with a port
        in [1, 65535], a host that does not resolve, a coordinator port
        already in use on process 0's host, num_processes < 1, a process_id
        outside [0, num_processes), tp not a multiple of num_processes, or
        timeouts below 1 s."""
        for name in ("num_processes", "process_id", "heartbeat_s", "init_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id}")
        if self.heartbeat_s < 1 or self.init_timeout_s < 1:
            raise ValueError(f"heartbeat_s and init_timeout_s must be >= 1 (seconds), got "
                             f"{self.heartbeat_s} and {self.init_timeout_s}")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp % self.num_processes:
            raise ValueError(f"tp must be a multiple of num_processes={self.num_processes} (every "
                             f"process holds tp / num_processes devices of the mesh), got {tp!r}")
        text = self.coordinator if isinstance(self.coordinator, str) else ""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"coordinator must be host:port with a port in [1, 65535], got "
                             f"{self.coordinator!r}")
        host = host.strip("[]")
        try:
            socket.getaddrinfo(host, int(port))
        except OSError as e:
            raise ValueError(f"coordinator {self.coordinator!r}: host {host!r} does not resolve "
                             f"({e})") from None
        if self.process_id == 0:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                try:
                    s.bind(("", int(port)))
                except OSError as e:
                    raise ValueError(f"coordinator {self.coordinator!r}: process 0 hosts the "
                                     f"coordination service on port {port}, which this host "
                                     f"cannot bind ({e.strerror or e})") from None


def initialize(settings: JobSettings) -> None:
    """Join the job: CPU collectives through gloo, recoverable tasks (one
    process dying does not abort the others; they report it), then
    `jax.distributed.initialize`, which waits for every process. Call
    before anything touches JAX's backend in this process.

    Raises:
      JobError: the job could not be joined within init_timeout_s (an
        unreachable coordinator, a process that never came).
      RuntimeError: JAX's backend is already up in this process.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    try:
        jax.distributed.initialize(settings.coordinator, num_processes=settings.num_processes,
                                   process_id=settings.process_id,
                                   initialization_timeout=settings.init_timeout_s,
                                   heartbeat_timeout_seconds=settings.heartbeat_s)
    except Exception as e:  # noqa: BLE001 - JAX raises XlaRuntimeError with a gRPC status
        raise JobError(f"process {settings.process_id} could not join the job of "
                       f"{settings.num_processes} processes at {settings.coordinator} within "
                       f"{settings.init_timeout_s} s: {e}") from e


def job_mesh(tp: int):
    """The ("dp", "tp") mesh of tp = every device of the job (`plan.make_mesh`
    over `jax.devices()`, which lists them process by process).

    Raises:
      ValueError: tp is not the job's device count.
    """
    import jax

    if tp != jax.device_count():
        raise ValueError(f"tp={tp} must be the job's device count, {jax.device_count()} "
                         f"({jax.process_count()} processes x {jax.local_device_count()} devices; "
                         "on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N per process)")
    return make_mesh(tp, devices=jax.devices())


def _client():
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized in this process")
    return distributed.global_state.client


class Channel:
    """Messages from process 0 to every other process, in order, through the
    coordination service's key-value store (module docstring). Process 0
    `send`s; the others `receive`."""

    def __init__(self, num_processes: int, process_id: int):
        self.num_processes, self.process_id = num_processes, process_id
        self._seq = 0
        self._lock = threading.Lock()

    def send(self, message) -> None:
        """Process 0: `message` (picklable) to every other process.

        Raises:
          JobError: the coordination service refused it.
        """
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        client = _client()
        with self._lock:
            try:
                for rank in range(1, self.num_processes):
                    client.key_value_set_bytes(f"{PREFIX}/{rank}/{self._seq}", data)
            except Exception as e:  # noqa: BLE001
                raise JobError(f"sending to the job's processes failed: {e}") from e
            self._seq += 1

    def receive(self, stop: Optional[threading.Event] = None):
        """A follower: the next message (waits for it; None once `stop` is set).

        Raises:
          JobError: the coordination service (process 0) is gone.
        """
        client, key = _client(), f"{PREFIX}/{self.process_id}/{self._seq}"
        while stop is None or not stop.is_set():
            try:
                data = client.blocking_key_value_get_bytes(key, POLL_MS)
            except Exception as e:  # noqa: BLE001
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                raise JobError(f"process {self.process_id} lost process 0 (the coordination "
                               f"service): {e}") from e
            client.key_value_delete(key)
            self._seq += 1
            return pickle.loads(data)
        return None

    def say_bye(self) -> None:
        """A follower, after "stop": tell process 0 it leaves."""
        _client().key_value_set(f"{PREFIX}/bye/{self.process_id}", "1")

    def wait_byes(self, timeout_s: float) -> list[int]:
        """Process 0: wait up to timeout_s for every follower's bye; returns
        the ranks not heard from."""
        client, missing = _client(), []
        for rank in range(1, self.num_processes):
            try:
                client.blocking_key_value_get(f"{PREFIX}/bye/{rank}", int(timeout_s * 1000))
            except Exception:  # noqa: BLE001 - gone or late: reported by rank
                missing.append(rank)
        return missing


class Job:
    """This process's place in the job: its settings, the channel, the first
    failure seen (after which nothing more is sent), and on process 0 the
    ids of its runners (`leader.LeaderRunner`) that were dropped, told to
    the followers with the next message.

    Args:
      settings: the `JobSettings` this process joined with (`initialize`).
    """

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self.channel = Channel(settings.num_processes, settings.process_id)
        self.error: Optional[JobError] = None
        self.stopped = threading.Event()        # set by `stop`: the liveness thread ends
        self._runner_ids = 0
        self._dropped: list[int] = []

    @property
    def leader(self) -> bool:
        return self.settings.process_id == 0

    def new_runner_id(self) -> int:
        self._runner_ids += 1
        return self._runner_ids

    def drop_runner(self, runner_id: int) -> None:
        """A runner of process 0 is gone (called from its finalizer: only
        queued, never sent from here)."""
        self._dropped.append(runner_id)

    def fail(self, error: BaseException) -> JobError:
        """Record the job's first failure; returns it (to raise) as a
        `JobError` that says the job stopped and why (a `JobError` given is
        kept as it is)."""
        if self.error is None and isinstance(error, JobError):
            self.error = error
        if self.error is None:
            n = self.settings.num_processes
            self.error = JobError(f"the tensor-parallel job of {n} processes stopped: a step "
                                  f"failed on process {self.settings.process_id} (another "
                                  f"process of the job is gone or unreachable): "
                                  f"{type(error).__name__}: {error}")
        return self.error

    def send(self, message) -> None:
        """Process 0: `message` to the followers, with the runners dropped since the last one.

        Raises:
          JobError: the job failed before, or fails now.
        """
        if self.error is not None:
            raise self.error
        dropped, self._dropped = self._dropped, []
        try:
            self.channel.send((dropped, message))
        except JobError as e:
            raise self.fail(e) from e

    def stop(self, timeout_s: float = 10.0) -> list[int]:
        """Process 0: tell the followers to leave (unless the job failed),
        wait up to timeout_s for each, then leave the job. Returns the ranks
        that did not say goodbye."""
        import jax

        self.stopped.set()
        missing = list(range(1, self.settings.num_processes))
        if self.error is None:
            try:
                self.send(("stop",))
                missing = self.channel.wait_byes(timeout_s)
            except JobError:
                pass
        if not missing:
            jax.distributed.shutdown()
        return missing


__all__ = ["Channel", "Job", "JobError", "JobSettings", "initialize", "job_mesh"]
