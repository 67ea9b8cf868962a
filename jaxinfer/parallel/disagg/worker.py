"""A prefill worker: prefill requests on its own runner and offer each
result (its one-row `DecodeState` and first token) to the decode worker
through a transport.

`PrefillWorker` is the device work, shared by the in-process workers
(`local.ThreadPrefillClient`, one thread per device set) and the worker
processes (`process`). Prompts run in pieces of `prefill_chunk_size`
tokens, one piece per job in turn (round robin), so a short prompt that
arrives while a long one is being prefilled waits for at most one piece,
not for the whole long prompt (chunked prefill, as the colocated scheduler
interleaves prompt pieces with decode chunks).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax

from jaxinfer.parallel.disagg.scheduler import PrefillResult
from jaxinfer.serving.request import Request
from jaxinfer.parallel.sharding import kv_heads_for


@dataclasses.dataclass
class _Job:
    request_id: int
    job: object
    compute_s: float = 0.0


class PrefillWorker:
    """Prefills requests on `llm`'s mesh with the colocated engine's own
    `ModelRunner.begin / prefill` (same buckets, same pieces, same first
    token), then offers the result.

        worker.add(request_id, request)      # queued; bad requests answer at once
        results = worker.step()              # one piece of the next job (round robin)

    Args:
      llm: an `LLM` whose programs run on this worker's mesh (`sharding.load_llm`
        or `tensor_parallel_llm`); its `prefill_chunk_size` is the piece size
        (None: whole prompts).
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
        self.jobs: collections.deque[_Job] = collections.deque()
        self._answers: list[PrefillResult] = []

    def add(self, request_id: int, request: Request) -> None:
        """Queue a request (a bad one is answered with an error by the next `step`)."""
        try:
            self._check(request)
            self.jobs.append(_Job(request_id, self.runner.begin(request)))
        except Exception as e:  # noqa: BLE001 - reported to the request's client
            self._answers.append(self._error(request_id, e))

    def cancel(self, request_id: int) -> bool:
        """Drop a queued or partly prefilled request; False if it is not here."""
        kept = [j for j in self.jobs if j.request_id != request_id]
        found = len(kept) != len(self.jobs)
        self.jobs = collections.deque(kept)
        return found

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self._answers)

    def step(self) -> list[PrefillResult]:
        """Run one piece of the first job (which then goes to the back unless
        it is done); returns the results finished by this call."""
        out, self._answers = self._answers, []
        if not self.jobs:
            return out
        item = self.jobs.popleft()
        t0 = time.perf_counter()
        try:
            job = item.job
            self.runner.prefill(job)       # one piece: at most prefill_chunk_size
            if job.remaining:
                jax.block_until_ready(job.cache)
                item.compute_s += time.perf_counter() - t0
                self.jobs.append(item)
                return out
            prefix = job.prefix.replace(cache=kv_heads_for(job.prefix.cache, self.kv_repeat, 1))
            jax.block_until_ready((prefix, job.first))   # prefill_s: this job's own device time
            item.compute_s += time.perf_counter() - t0
            device = self.device or next(iter(prefix.cache.lengths.devices()))
            ticket = self.transport.offer((prefix, job.first), device)
        except Exception as e:  # noqa: BLE001 - that request fails, the worker goes on
            return out + [self._error(item.request_id, e)]
        return out + [PrefillResult(item.request_id, ticket=ticket, prefill_s=item.compute_s,
                                    worker=self.worker_id)]

    def prefill(self, request_id: int, request: Request) -> PrefillResult:
        """Prefill one request to the end (nothing else queued)."""
        self.add(request_id, request)
        while True:
            for result in self.step():
                if result.request_id == request_id:
                    return result

    def _error(self, request_id: int, e: Exception) -> PrefillResult:
        return PrefillResult(request_id, error=f"prefill worker {self.worker_id}: "
                             f"{type(e).__name__}: {e}", worker=self.worker_id)

    def _check(self, request: Request) -> None:
        n, limit = len(request.prompt_ids), self.runner.max_seq_len
        if n == 0 or n + request.max_new_tokens > limit:
            raise ValueError(f"prompt length {n} + max_new_tokens {request.max_new_tokens} does "
                             f"not fit max_seq_len {limit}")
