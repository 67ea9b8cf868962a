"""The disaggregated engine behind the colocated server's interface.

`DisaggEngine` is an `EngineThread` (submit / events / abort / stop, a
bounded waiting queue) whose scheduler is a `DisaggScheduler`; it adds
`health()` (the prefill workers' states) and closes its prefill client on
`stop()`. A server built on `EngineThread` takes it unchanged; the one new
event is `FailedOutput` (finish_reason "error", `.error` the reason), the
last event of a request whose prefill worker died or whose KV transfer
failed.

    engine = start_process_engine([WorkerSpec(source="smollm2-135m-instruct", cpus=(0,))],
                                  WorkerSpec(source="smollm2-135m-instruct", cpus=(1,)),
                                  max_num_seqs=8)
    handle = engine.submit(Request(prompt_ids, max_new_tokens=64))
    for event in handle: ...
    engine.health()   # {"decode": {...}, "prefill": [{"worker": 0, "state": "up", ...}]}
    engine.stop()
"""

from __future__ import annotations

from typing import Optional, Sequence

from jaxinfer.parallel.disagg import make_scheduler
from jaxinfer.parallel.disagg.scheduler import DisaggScheduler
from jaxinfer.serving.thread import EngineThread
from jaxinfer.parallel.disagg.process import ProcessPrefillClient, build_llm, configure_host


class DisaggEngine(EngineThread):
    """`EngineThread` over a `DisaggScheduler` and its prefill client."""

    def __init__(self, scheduler: DisaggScheduler, client, **kwargs):
        super().__init__(scheduler, **kwargs)
        self.client = client

    def health(self) -> dict:
        """{"ok": the engine thread runs and some prefill worker is up (or
        starting), "decode": running / waiting / in-flight counts,
        "prefill": per worker (processes) or per thread}."""
        s = self.scheduler
        workers = self.client.health() if hasattr(self.client, "health") else [
            {"worker": i, "state": "up"} for i in range(len(getattr(self.client, "workers", [])))]
        up = any(w["state"] in ("up", "starting", "restarting") for w in workers)
        return {"ok": self.running and up,
                "decode": {"running": s.num_running, "waiting": self.num_waiting(),
                           "slots": len(s.slots), **s.num_in_flight},
                "prefill": workers}

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        self.client.close()


def start_process_engine(prefill: Sequence, decode, *, max_num_seqs: int = 8,
                         transfer_timeout_s: float = 60.0,
                         max_waiting_requests: Optional[int] = None, start: bool = True,
                         **client_kwargs) -> DisaggEngine:
    """Start prefill worker processes and make this process the decode
    worker (and router, and supervisor); returns the engine, its thread
    running unless `start` is False (the HTTP server starts it itself).

    Must run before JAX starts its backend in this process (it sets this
    process's device count and CPU affinity from `decode`).

    Args:
      prefill: one `process.WorkerSpec` per prefill worker process.
      decode: the `WorkerSpec` of this process (its model must be the same).
      max_num_seqs: decode slots.
      transfer_timeout_s: per-request limit of a KV transfer.
      client_kwargs: for `ProcessPrefillClient` (max_restarts, startup_timeout_s, ...).
    """

    configure_host(decode.tp, decode.cpus)
    client = ProcessPrefillClient(prefill, **client_kwargs)
    try:
        client.initialize()
        import jax

        llm = build_llm(decode, jax.local_devices()[:decode.tp])
        client.wait_ready()
        scheduler = make_scheduler(llm, client, max_num_seqs, transfer_timeout_s=transfer_timeout_s)
    except BaseException:
        client.close(timeout_s=5.0)       # no worker outlives a failed start
        raise
    engine = DisaggEngine(scheduler, client, max_waiting_requests=max_waiting_requests)
    engine.llm = llm
    return engine.start() if start else engine
