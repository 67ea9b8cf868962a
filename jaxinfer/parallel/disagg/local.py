"""Disaggregation in one process: prefill workers on their own device sets
(one thread each), the decode worker on another; the KV moves with
`jax.device_put` (`LocalTransport`).

    client = ThreadPrefillClient([llm_on_mesh_a], LocalTransport())
    scheduler = make_scheduler(decode_llm_on_mesh_b, client, max_num_seqs=8)   # disagg
"""

from __future__ import annotations

import queue
import threading
from typing import Sequence

from jaxinfer.parallel.disagg.scheduler import PrefillResult
from jaxinfer.parallel.disagg.transfer import LocalTransport
from jaxinfer.parallel.disagg.worker import PrefillWorker
from jaxinfer.serving.request import Request


class ThreadPrefillClient:
    """`PrefillClient` over in-process workers, one thread per `LLM` (each on
    its own mesh). The router sends a request to the worker with the fewest
    queued requests.

    Args:
      llms: one `LLM` per prefill worker.
      transport: the `LocalTransport` they offer through (default: a new one).
    """

    def __init__(self, llms: Sequence, transport: LocalTransport | None = None):
        self._transport = transport or LocalTransport()
        self.workers = [PrefillWorker(llm, self._transport, i) for i, llm in enumerate(llms)]
        self._queues = [queue.Queue() for _ in self.workers]
        self._results: queue.Queue = queue.Queue()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"jaxinfer-prefill-{i}") for i in range(len(self.workers))]
        for t in self._threads:
            t.start()

    def transport(self) -> LocalTransport:
        return self._transport

    def submit(self, request_id: int, request: Request) -> None:
        i = min(range(len(self._queues)), key=lambda j: self._queues[j].qsize())
        self._queues[i].put((request_id, request))

    def poll(self) -> list[PrefillResult]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def release(self, result: PrefillResult) -> None:
        if result.ticket is not None:
            self._transport.release(result.ticket)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker threads (each finishes the request it is on)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout_s)

    def _serve(self, i: int) -> None:
        worker, q = self.workers[i], self._queues[i]
        while True:
            while True:                      # take what arrived; wait only when idle
                try:
                    item = q.get_nowait() if worker.busy else q.get()
                except queue.Empty:
                    break
                if item is None:
                    return
                worker.add(*item)
            with self._lock:
                for rid in [r for r in self._cancelled if worker.cancel(r)]:
                    self._cancelled.discard(rid)
            for result in worker.step():
                self._results.put(result)
