"""A prefill worker: prefill requests on its own runner and offer each
result (the pages of its prompt, its first token and that token's
log-probs) to the decode worker through a transport.

`PrefillWorker` is the device work, shared by the in-process workers
(`local.ThreadPrefillClient`, one thread per device set) and the worker
processes (`process_worker`). It runs the serving step (`ModelRunner.step`)
over a few slots and a page pool of its own: every step holds one chunk
of at most `prefill_chunk_size` tokens of each request it is prefilling
(chunked prefill, all of them in one ragged forward), so a short prompt
that arrives while a long one is prefilled finishes after its own chunks,
not after the long prompt. A request's last chunk samples its first token
in the same step, exactly as the colocated scheduler's does.

Then the worker reads the request's pages (`ModelRunner.read_pages`, padded
to a power-of-two page count so the decode side compiles few programs, KV
heads de-duplicated when its plan repeats them), offers

    {"pages": (LayerKV, ...) [n, K, ...], "length": prompt tokens,
     "token": the first token, "logprob", "top_ids", "top_logprobs": its log-probs}

and frees its slot and pages (the offered copy is the transport's).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer.parallel.disagg.scheduler import PrefillResult
from jaxinfer.serving.pages import KVPageManager
from jaxinfer.serving.request import Request
from jaxinfer.serving.runner import Admission, Segment, logprob_bucket


@dataclasses.dataclass
class _Job:
    request_id: int
    request: Request
    slot: Optional[int] = None
    done: int = 0
    compute_s: float = 0.0

    @property
    def remaining(self) -> int:
        return len(self.request.prompt_ids) - self.done


def padded_pages(pages, num_pages: int) -> np.ndarray:
    """`pages` padded with `num_pages` ("no page") to a power-of-two count."""
    out = np.full(1 << max(len(pages) - 1, 0).bit_length(), num_pages, np.int32)
    out[:len(pages)] = pages
    return out


class PrefillWorker:
    """Prefills requests on `llm`'s mesh with the serving step, then offers
    each result (module docstring).

        worker.add(request_id, request)      # queued; bad requests answer at once
        results = worker.step()              # one chunk of every request in a slot

    Args:
      llm: an `LLM` whose programs run on this worker's mesh (`sharding.load_llm`
        or `tensor_parallel_llm`); its scheduler config's `prefill_chunk_size`
        is the chunk size (None: the runner's whole token budget).
      transport: `LocalTransport` or `PullTransport`.
      worker_id: reported with each result.
      max_num_seqs: requests prefilled at once (the runner's slots).
    Raises:
      ValueError: `llm`'s cache layout has no page transfers (`cache.LAYOUTS`:
        "paged_ring"), before anything is allocated.
    """

    def __init__(self, llm, transport, worker_id: int = 0, max_num_seqs: int = 4):
        self.llm, self.transport, self.worker_id = llm, transport, worker_id
        llm.layout.require("page_transfer", "disaggregated prefill (a KV page transfer)")
        plan = getattr(llm, "sharding_plan", None)
        self.kv_repeat = plan.kv_repeat if plan is not None else 1
        if self.kv_repeat != 1:
            llm.layout.require("tp_relayout", f"sending pages whose KV heads are stored "
                                              f"{self.kv_repeat} times (another TP degree)")
        self.runner = llm.runner(max_num_seqs)
        r = self.runner
        self.pages = KVPageManager(r.num_pages, r.page_size, r.max_num_seqs, r.pages_per_seq,
                                   prefix_caching=False)
        self.chunk = min(llm.scheduler_config.prefill_chunk_size or r.token_budget, r.token_budget)
        mesh = getattr(llm.programs, "mesh", None)
        self.device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
        self.jobs: collections.deque[_Job] = collections.deque()     # queued, no slot yet
        self.slots: list[Optional[_Job]] = [None] * r.max_num_seqs
        self._admits: list[Admission] = []
        self._answers: list[PrefillResult] = []

    def add(self, request_id: int, request: Request) -> None:
        """Queue a request (a bad one is answered with an error by the next `step`)."""
        try:
            self._check(request)
            self.jobs.append(_Job(request_id, request))
        except Exception as e:  # noqa: BLE001 - reported to the request's client
            self._answers.append(self._error(request_id, e))

    def cancel(self, request_id: int) -> bool:
        """Drop a queued or partly prefilled request; False if it is not here."""
        kept = [j for j in self.jobs if j.request_id != request_id]
        found = len(kept) != len(self.jobs)
        self.jobs = collections.deque(kept)
        for job in self.active:
            if job.request_id == request_id:
                self._free(job)
                found = True
        return found

    @property
    def active(self) -> list[_Job]:
        """Requests in a slot, oldest first."""
        return sorted((j for j in self.slots if j is not None), key=lambda j: j.request_id)

    @property
    def busy(self) -> bool:
        return bool(self.jobs or self._answers or any(self.slots))

    def request_ids(self) -> list[int]:
        """Every request here: queued or being prefilled."""
        return [j.request_id for j in self.jobs] + [j.request_id for j in self.active]

    def starting(self) -> list[int]:
        """Seat queued requests in free slots while the pool holds their
        whole prompts (host bookkeeping only); returns the ids the next
        `step` prefills."""
        while self.jobs and None in self.slots:
            job, slot = self.jobs[0], self.slots.index(None)
            n = len(job.request.prompt_ids)
            if self.pages.shortfall({slot: n}):
                break
            self.pages.grow(slot, n)
            self.jobs.popleft()
            job.slot, self.slots[slot] = slot, job
            self._admits.append(Admission(slot, job.request))
        return [j.request_id for j in self.active]

    def step(self) -> list[PrefillResult]:
        """One step: a chunk of every request in a slot (newly seated ones
        first admitted); returns the results finished by this call."""
        out, self._answers = self._answers, []
        self.starting()
        segments, owners, budget = [], [], self.runner.token_budget
        for job in self.active:
            n = min(job.remaining, self.chunk, budget)
            if n <= 0:
                break
            ids = job.request.prompt_ids[job.done:job.done + n]
            job.done += n
            budget -= n
            segments.append(Segment(job.slot, ids, sample=not job.remaining))
            owners.append(job)
        if not segments:
            return out
        t0 = time.perf_counter()
        try:
            admits, self._admits = self._admits, []
            self.runner.admit(admits)
            wanted = [j.request.logprobs for j in owners if j.request.logprobs is not None]
            num_logprobs = logprob_bucket(max(wanted)) if wanted else -1
            host = self.runner.fetch(self.runner.step(segments, self.pages.tables, num_logprobs))
        except Exception as e:  # noqa: BLE001 - this step's requests fail, the worker goes on
            for job in owners:
                self._free(job)
                out.append(self._error(job.request_id, e))
            return out
        elapsed = time.perf_counter() - t0
        for i, job in enumerate(owners):
            job.compute_s += elapsed
            if not job.remaining:
                out.append(self._offer(job, host, i))
        return out

    def _offer(self, job: _Job, host, i: int) -> PrefillResult:
        """Read the finished request's pages and offer them with its first token; free its slot."""
        t0 = time.perf_counter()
        try:
            n = len(job.request.prompt_ids)
            pages = self.pages.tables[job.slot, :self.pages.pages_for(n)]
            data = self.runner.read_pages(padded_pages(pages, self.runner.num_pages), self.kv_repeat)
            payload = {"pages": data, "length": np.int32(n), "token": np.int32(host.token[0, i, 0])}
            if host.logprob is not None and job.request.logprobs is not None:
                payload.update(logprob=host.logprob[0, i, 0], top_ids=host.top_ids[0, i, 0],
                               top_logprobs=host.top_logprobs[0, i, 0])
            jax.block_until_ready(data)            # prefill_s: this request's own device time
            job.compute_s += time.perf_counter() - t0
            ticket = self.transport.offer(payload, self.device)
        except Exception as e:  # noqa: BLE001 - that request fails, the worker goes on
            return self._error(job.request_id, e)
        finally:
            self._free(job)
        return PrefillResult(job.request_id, ticket=ticket, prefill_s=job.compute_s,
                             worker=self.worker_id)

    def _free(self, job: _Job) -> None:
        if job.slot is not None:
            self.pages.release(job.slot)
            self.slots[job.slot] = None
            self._admits = [a for a in self._admits if a.slot != job.slot]
            job.slot = None

    def prefill(self, request_id: int, request: Request) -> PrefillResult:
        """Prefill one request to the end (others queued go on too)."""
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
        if self.pages.pages_for(n) > self.runner.num_pages:
            raise ValueError(f"a prompt of {n} tokens needs {self.pages.pages_for(n)} KV pages; "
                             f"this worker's pool has {self.runner.num_pages}")
