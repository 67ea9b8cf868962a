"""A prefill worker: prefill one request at a time on its own runner and
offer the result (its one-row `DecodeState` and first token) to the decode
worker through a transport.

`PrefillWorker` is the device work, shared by the in-process workers
(`local.ThreadPrefillClient`, one thread per device set) and the worker
processes (`process`).
"""

from __future__ import annotations

import time

import jax

from jaxinfer.disagg.scheduler import PrefillResult
from jaxinfer.request import Request
from jaxinfer.sharding import kv_heads_for


class PrefillWorker:
    """Prefills requests on `llm`'s mesh with the colocated engine's own
    `ModelRunner.begin / prefill` (same buckets, same chunking, same first
    token), then offers the result.

    Args:
      llm: an `LLM` whose programs run on this worker's mesh (`sharding.load_llm`
        or `tensor_parallel_llm`).
      transport: `LocalTransport` or `PullTransport`.
      worker_id: reported with each result.
    """

    def __init__(self, llm, transport, worker_id: int = 0):
        self.llm, self.transport, self.worker_id = llm, transport, worker_id
        self.runner = llm.runner(1)
        plan = getattr(llm, "sharding_plan", None)
        self.kv_repeat = plan.kv_repeat if plan is not None else 1
        mesh = getattr(llm.programs, "mesh", None)
        self.device = mesh.devices.flat[0] if mesh is not None else None

    def prefill(self, request_id: int, request: Request) -> PrefillResult:
        """Prefill `request` and offer its KV; errors become an error result
        (the decode side fails that request only)."""
        t0 = time.perf_counter()
        try:
            self._check(request)
            job = self.runner.begin(request)
            while job.remaining:
                self.runner.prefill(job, 1 << 30)
            prefix = job.prefix.replace(cache=kv_heads_for(job.prefix.cache, self.kv_repeat, 1))
            jax.block_until_ready((prefix, job.first))    # prefill_s is the prefill's own time
            device = self.device or prefix.cache.lengths.devices().pop()
            ticket = self.transport.offer((prefix, job.first), device)
        except Exception as e:  # noqa: BLE001 - reported to the request's client, the worker goes on
            return PrefillResult(request_id, error=f"prefill worker {self.worker_id}: "
                                 f"{type(e).__name__}: {e}", worker=self.worker_id)
        return PrefillResult(request_id, ticket=ticket, prefill_s=time.perf_counter() - t0,
                             worker=self.worker_id)

    def _check(self, request: Request) -> None:
        n, limit = len(request.prompt_ids), self.runner.max_seq_len
        if n == 0 or n + request.max_new_tokens > limit:
            raise ValueError(f"prompt length {n} + max_new_tokens {request.max_new_tokens} does "
                             f"not fit max_seq_len {limit}")
