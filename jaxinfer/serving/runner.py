"""The device side of serving: one model's compiled programs over a decode
state of `max_num_seqs` slots.

    begin(request)          a PrefillJob with its own one-row cache
    prefill(job, budget)    one chunk of the prompt through `engine.extend`,
                            the last one through `engine.start` (first token)
    insert(job, slot)       `engine.insert`: the prefilled row into a decode slot
    decode(occupied, ...)   `engine.decode_chunk` over every slot (asynchronous)
    fetch(outputs)          device outputs -> numpy, on the host

The scheduler (`jaxinfer.serving.scheduler`) decides what runs; this module only runs
it and keeps the shapes to a few buckets. The cache of the decode state is
sized to a cache bucket that covers every occupied slot through the chunks
dispatched so far plus the next one, and grown before a chunk that would
overflow it.

Paged KV (`page_size` set): the full-attention layers' K/V live in one pool
of `num_pages` pages (`cache.init_paged_cache`) owned by the decode state,
and the host (`paging.PagePool`) decides which pages each request holds:

    begin     the prompt's longest cached prefix (prefix caching: full pages
              only, and never the page of the last prompt token, whose logits
              are needed) plus fresh pages for the rest of the prompt
    prefill   the job's one-row cache borrows the pools (`cache.with_pools`)
              for each call and hands them back; a hit prefills only the rest
    insert    the job's pages become the slot's; its full pages are registered
    decode    each occupied slot first gets the pages its next chunk can write
    release   finished / aborted / preempted: full pages of known tokens are
              registered, every page unreferenced

Block tables live on the host and are sent with each call. Every program
that touches the pools takes them from the previous one, so device work on
the pools runs in dispatch order: a page freed while a dispatched chunk still
writes into it is written before any later owner's prefill touches it, and a
registered (full) page is never written again (writes go to positions at or
beyond a row's length). The scheduler asks `pages_short` before each decode
chunk and preempts until it is 0, and admits a request only when
`can_begin` says its pages (and the running rows' next chunk) fit.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import kv as kv_cache
from jaxinfer.engine import phases as engine
from jaxinfer import sampling
from jaxinfer.speculative import verify as speculative
from jaxinfer.speculative.verify import SpecConfig
from jaxinfer.serving.buckets import Buckets, bucket_for
from jaxinfer.cache.kv import init_cache, init_paged_cache, pages_per_seq
from jaxinfer.config import ModelConfig
from jaxinfer.serving.pages import PagePool, PoolExhaustedError, page_hashes
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.request import Request

# Log-prob counts are compiled for these values only (a request asking for
# n alternatives runs with the next one and keeps its n).
LOGPROB_BUCKETS = (0, 1, 2, 4, 8, 20)


def logprob_bucket(n: Optional[int]) -> int:
    """The static `num_logprobs` for a request wanting n alternatives (-1: none)."""
    return -1 if n is None else bucket_for(n, LOGPROB_BUCKETS)


def row_inputs(requests: Sequence[Request], vocab_size: int, history: int,
               generated: Optional[Sequence[Sequence[int]]] = None) -> engine.RowInputs:
    """`engine.start`'s per-row inputs for requests (one row each): budgets,
    min_tokens, ignore_eos, the prompt's token set and ids (in a history of
    `history` positions, >= each prompt + max_new_tokens), PRNG keys,
    sampling arrays. `generated`: per request, the tokens it generated before
    it was preempted (its row resumes after them; default none)."""
    generated = generated or [()] * len(requests)
    seen = np.zeros((len(requests), vocab_size), bool)
    counts = np.zeros((len(requests), vocab_size), np.int32)
    ids = np.zeros((len(requests), history), np.int32)
    lengths = []
    for row, (r, done) in enumerate(zip(requests, generated)):
        seq = list(r.prompt_ids) + list(done)
        seen[row, seq] = True
        np.add.at(counts[row], list(done), 1)
        ids[row, :len(seq)] = seq
        lengths.append(len(seq))
    return engine.RowInputs(
        max_new_tokens=jnp.array([r.max_new_tokens for r in requests], jnp.int32),
        min_tokens=jnp.array([r.min_tokens for r in requests], jnp.int32),
        ignore_eos=jnp.array([r.ignore_eos for r in requests]), seen=jnp.asarray(seen),
        history=jnp.asarray(ids), history_len=jnp.array(lengths, jnp.int32),
        keys=sampling.row_keys([r.sampling.seed for r in requests]),
        sampling=sampling.stack_params([r.sampling for r in requests]),
        num_generated=jnp.array([len(d) for d in generated], jnp.int32), counts=jnp.asarray(counts))


def stop_tokens(stop_token_ids: Sequence[int], eos_token_ids: Sequence[int]) -> engine.StopTokens:
    """The device's stop rule: every id in either set ends a row, EOS ones
    unless the row has ignore_eos (-1 pads an empty set)."""
    ids = sorted(set(stop_token_ids) | set(eos_token_ids)) or [-1]
    return engine.StopTokens(jnp.asarray(np.array(ids, np.int32)),
                             jnp.asarray(np.isin(ids, list(eos_token_ids))))


@dataclasses.dataclass
class PrefillJob:
    """A request being prefilled: its own one-row cache and progress.

    Attributes:
      request: the Request; ids: the tokens to prefill (the prompt, then the
        tokens generated before a preemption; None: the prompt); done: tokens
        already in the cache.
      prefix: after the last chunk, the one-row DecodeState to insert.
      first: after the last chunk, the first token's StepOutput with [1, 1]
        leaves (one step, one row), on the device.
      pages: paged KV: the pages the job holds (its cached prefix first);
        cached: prompt tokens served from the prefix cache; hashes: the
        chained hashes of ids' full pages (prefix caching on).
    """

    request: Request
    cache: object
    inputs: engine.RowInputs
    ids: Optional[tuple] = None       # None: the request's prompt
    draft_cache: object = None
    done: int = 0
    prefix: Optional[engine.DecodeState] = None
    first: Optional[tuple] = None
    pages: list = dataclasses.field(default_factory=list)
    cached: int = 0
    hashes: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.ids is None:
            self.ids = tuple(self.request.prompt_ids)

    @property
    def remaining(self) -> int:
        return len(self.ids) - self.done


class ModelRunner:
    """Runs one model's programs for the scheduler.

    Args:
      config: ModelConfig; params: prepared params.
      max_num_seqs: decode slots (a fixed batch: free slots cost their share
        of each batched step).
      buckets: the `Buckets` policy (max_seq_len, prompt and cache buckets).
      decode_chunk: decode steps per compiled chunk.
      prefill_chunk_size: the longest piece of a prompt one call prefills
        (None: whole prompts).
      stop_token_ids / eos_token_ids: ids that end a row (EOS ones unless the
        request has ignore_eos).
      cache_dtype: KV-cache dtype; programs: the `ProgramCache` to compile through.
      speculative: a `SpecConfig`, or None for plain decoding.
      kv_cache_dtype: None (cache_dtype) or a `cache.KV_CACHE_DTYPES` name
        ("int8": codes plus a scale per token per kv head).
      page_size: tokens per KV page for a paged cache (see the module
        docstring), or None for one dense buffer per slot.
      num_pages: pages in the pool (paged only; default: max_num_seqs full
        sequences, the dense worst case).
      prefix_caching: share full pages of equal prefixes between requests
        (paged only). Off for models with sliding-window layers (their rings
        cannot be restored from pages) and with a draft model (its own cache
        would miss the prefix).
    Raises:
      ValueError: page_size or num_pages < 1.
    """

    def __init__(self, config: ModelConfig, params: dict, *, max_num_seqs: int, buckets: Buckets,
                 decode_chunk: int, prefill_chunk_size: Optional[int],
                 stop_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                 cache_dtype=jnp.float32, programs: Optional[ProgramCache] = None,
                 speculative: Optional[SpecConfig] = None, kv_cache_dtype: Optional[str] = None,
                 page_size: Optional[int] = None, num_pages: Optional[int] = None,
                 prefix_caching: bool = True):
        self.config, self.params = config, params
        self.max_num_seqs = int(max_num_seqs)
        self.buckets = buckets
        self.decode_chunk = int(decode_chunk)
        self.prefill_chunk_size = prefill_chunk_size
        self.cache_dtype = cache_dtype
        self.programs = programs or ProgramCache()
        self.stop = stop_tokens(stop_token_ids, eos_token_ids)
        self.state: Optional[engine.DecodeState] = None
        self.speculative = speculative
        self.kv_cache_dtype = kv_cache_dtype
        self.ring_extra = speculative.num_speculative_tokens if speculative else 0
        self.min_capacity = 0  # the decode state's cache never gets smaller than this (benchmarks)
        # each slot's cache length after the chunks fetched so far, and the most
        # each dispatched, unfetched chunk can add (sizing the cache)
        self._length = np.zeros(self.max_num_seqs, np.int64)
        self._inflight: list = []
        self.decode_steps = 0  # decode steps dispatched
        self.row_chunks = collections.Counter()   # rows -> plain chunks run on fewer rows than slots
        self.page_size = page_size
        self.kv_pages: Optional[PagePool] = None
        self.prefix_caching = False
        if page_size is not None:
            if page_size < 1 or (num_pages is not None and num_pages < 1):
                raise ValueError(f"page_size and num_pages must be >= 1, got {page_size}, {num_pages}")
            self.max_pages = pages_per_seq(self.max_seq_len, page_size)  # block-table entries per row
            self.kv_pages = PagePool(num_pages or self.max_num_seqs * self.max_pages, page_size)
            self.prefix_caching = bool(prefix_caching and not config.sliding_layers
                                       and self._draft is None)
            self._tables = np.full((self.max_num_seqs, self.max_pages), self.kv_pages.num_pages, np.int32)
            self._slot_pages: list[list[int]] = [[] for _ in range(self.max_num_seqs)]
            self._slot_salt: list[Optional[str]] = [None] * self.max_num_seqs

    @property
    def max_seq_len(self) -> int:
        return self.buckets.max_seq_len

    @property
    def paged(self) -> bool:
        return self.kv_pages is not None

    # --- prefill -------------------------------------------------------------------------

    def begin(self, request: Request, generated: Sequence[int] = ()) -> PrefillJob:
        """A job for `request` (validated by the scheduler): its one-row cache
        and device inputs; `generated`: the tokens it generated before it was
        preempted (they are prefilled after the prompt). Nothing runs yet.

        Raises:
          PoolExhaustedError: paged, and the pool cannot supply the prompt's
            pages (`can_begin` says so beforehand).
        """
        ids = tuple(request.prompt_ids) + tuple(generated)
        inputs = row_inputs([request], self.config.vocab_size, self.max_seq_len, [generated])
        draft = self._draft
        if self.paged:
            job = self._begin_paged(request, ids, inputs, bool(generated))
            size = job.cache.max_seq_len
        else:
            p = len(ids)
            whole = self.prefill_chunk_size is None or p <= self.prefill_chunk_size
            fresh_bucket = self.buckets.prompt_bucket(p) if whole else 0
            size = self.buckets.cache_bucket(max(fresh_bucket, p + self.decode_chunk))
            job = PrefillJob(request, self._cache(self.config, 1, size), inputs, ids)
        job.draft_cache = None if draft is None else self._cache(draft.config, 1, size)
        return job

    def _begin_paged(self, request: Request, ids: tuple, inputs, resumed: bool) -> PrefillJob:
        pool, ps = self.kv_pages, self.page_size
        hashes = page_hashes(ids, ps, request.cache_salt) if self.prefix_caching else []
        hit = pool.lookup(hashes[:(len(ids) - 1) // ps])   # the last token's page is recomputed
        try:
            pages = hit + pool.allocate(pages_per_seq(len(ids), ps) - len(hit))
        except PoolExhaustedError:
            pool.release(hit)
            raise
        cached = len(hit) * ps
        if self.prefix_caching and not resumed:
            pool.count_lookup(len(ids), cached)
        table = np.full((1, self.max_pages), pool.num_pages, np.int32)   # P: no page
        table[0, :len(pages)] = pages
        cache = self._job_cache(pools=False).replace(block_tables=jnp.asarray(table),
                                                     lengths=jnp.array([cached], jnp.int32))
        return PrefillJob(request, cache, inputs, ids, done=cached, pages=pages, cached=cached,
                          hashes=hashes)

    @property
    def _draft(self):
        spec = self.speculative
        return spec.draft if spec is not None and spec.method == "draft" else None

    def piece(self, job: PrefillJob) -> int:
        """Prompt tokens the next `prefill(job)` call runs: the whole prompt
        when it fits `prefill_chunk_size` (or chunking is off), else the next
        piece of at most `prefill_chunk_size`."""
        limit = self.prefill_chunk_size
        if limit is None:
            return job.remaining
        if job.done == 0 and len(job.ids) <= limit:
            return len(job.ids)
        return min(job.remaining, limit)

    def prefill(self, job: PrefillJob) -> int:
        """Run the next piece of `job`'s prompt (`piece`). Returns its tokens.
        A whole prompt is padded to its prompt bucket and prefilled on an
        empty cache; the pieces of a longer one are always padded to
        `prefill_chunk_size` (one program width) and extend the cache, except
        the last piece after a prefix-cache hit, padded to its prompt bucket.
        The last piece also samples the first token (`job.prefix`, `job.first`)."""
        ids = job.ids
        n = self.piece(job)
        whole = n == len(ids)
        hit_end = job.cached and n == job.remaining
        width = self.buckets.prompt_bucket(n) if whole or hit_end else self.prefill_chunk_size
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = ids[job.done:job.done + n]
        tokens, lengths = jnp.asarray(tokens), jnp.array([n], jnp.int32)
        last = job.done + n == len(ids)
        draft = self._draft
        if draft is not None:   # the draft model reads the prompt too
            phase = engine.prefill if whole else engine.extend
            _, job.draft_cache = self.programs(phase, draft.params, job.draft_cache, tokens, lengths,
                                               config=draft.config)
        cache = self._attach(job.cache)
        if last:
            prefix, out = self.programs(
                engine.start, self.params, cache, tokens, lengths, job.inputs, self.stop,
                config=self.config, num_logprobs=logprob_bucket(job.request.logprobs),
                fresh=whole)
            job.first = out._replace(**{f: x[None] for f, x in out._asdict().items() if x is not None})
            job.prefix = prefix.replace(cache=self._detach(prefix.cache), draft=job.draft_cache)
            job.cache = job.draft_cache = None
        else:
            _, cache = self.programs(engine.extend, self.params, cache, tokens, lengths,
                                     config=self.config)
            job.cache = self._detach(cache)
        job.done += n
        return n

    def _attach(self, cache):
        """A paged one-row cache with the decode state's pools (created on
        first use); a dense one as it is."""
        if not self.paged:
            return cache
        self._fit(0)
        return kv_cache.with_pools(cache, self.state.cache)

    def _detach(self, cache):
        """Give a paged one-row cache's (updated) pools back to the decode
        state; returns the cache without them (dense: as it is)."""
        if not self.paged:
            return cache
        self.state = self.state.replace(cache=kv_cache.with_pools(self.state.cache, cache))
        return kv_cache.without_pools(cache)

    # --- the decode state ----------------------------------------------------------------

    def _empty_state(self, size: int) -> engine.DecodeState:
        """A decode state of max_num_seqs free (done) slots with a cache of `size`."""
        b, v = self.max_num_seqs, self.config.vocab_size
        rows = engine.RowState(
            tokens=jnp.zeros((b,), jnp.int32), done=jnp.ones((b,), bool),
            num_generated=jnp.zeros((b,), jnp.int32), max_new_tokens=jnp.ones((b,), jnp.int32),
            min_tokens=jnp.zeros((b,), jnp.int32), ignore_eos=jnp.zeros((b,), bool),
            seen=jnp.zeros((b, v), bool), counts=jnp.zeros((b, v), jnp.int32),
            history=jnp.zeros((b, self.max_seq_len), jnp.int32),
            history_len=jnp.zeros((b,), jnp.int32),
            keys=sampling.row_keys([0] * b),
            sampling=sampling.stack_params([sampling.SamplingParams(temperature=0.0)] * b))
        if self.paged:
            cache = init_paged_cache(self.config, b, size, self.kv_pages.num_pages, self.page_size,
                                     self.cache_dtype, ring_extra=self.ring_extra,
                                     kv_cache_dtype=self.kv_cache_dtype)
        else:
            cache = self._cache(self.config, b, size)
        draft = self._draft
        draft_cache = None if draft is None else self._cache(draft.config, b, size)
        return engine.DecodeState(cache, rows, draft_cache)

    def _cache(self, config: ModelConfig, batch: int, size: int):
        """A dense cache (the target's without paging, the draft model's always)."""
        return init_cache(config, batch, size, self.cache_dtype, ring_extra=self.ring_extra,
                          kv_cache_dtype=self.kv_cache_dtype)

    def _job_cache(self, pools: bool):
        """A paged one-row cache of max_seq_len positions (every job's shape),
        with the pool's shapes (pools=True, for compiling) or none."""
        return init_paged_cache(self.config, 1, self.max_seq_len,
                                self.kv_pages.num_pages if pools else 0, self.page_size,
                                self.cache_dtype, ring_extra=self.ring_extra,
                                kv_cache_dtype=self.kv_cache_dtype)

    def _fit(self, needed: int) -> None:
        """Grow the decode state's cache to the bucket of `needed` positions
        when it is smaller (it never shrinks: every size change would be one
        more program, and the CPU decode kernel reads only the visible span)."""
        size = max(self.buckets.cache_bucket(needed), self.min_capacity)
        if self.state is None:
            self.state = self._empty_state(size)
        elif size > self.state.cache.max_seq_len:
            self.state = self.programs(engine.resize_state, self.state, max_seq_len=size)

    def insert(self, job: PrefillJob, slot: int, occupied: np.ndarray) -> None:
        """Put a prefilled job's row into decode slot `slot`.

        Args:
          occupied: bool [max_num_seqs], the slots holding running requests
            (this one excluded), for sizing the cache.
        """
        p = len(job.ids)
        self._fit(max(int(self._bounds(occupied).max(initial=0)), p) + self._chunk_growth())
        self.state = self.programs(engine.insert, self.state, job.prefix,
                                   jnp.asarray(slot, jnp.int32))
        self._length[slot] = p
        for _, growth in self._inflight:   # chunks in flight ran this slot for its previous occupant
            growth[slot] = 0
        if self.paged:
            if self._slot_pages[slot]:
                raise RuntimeError(f"slot {slot} still holds pages: release it before inserting")
            self._slot_pages[slot], job.pages = job.pages, []
            self._slot_salt[slot] = job.request.cache_salt
            self._tables[slot] = self.kv_pages.num_pages
            self._tables[slot, :len(self._slot_pages[slot])] = self._slot_pages[slot]
            for page, h in zip(self._slot_pages[slot], job.hashes):   # the prompt's full pages
                self.kv_pages.register(page, h)

    def _chunk_growth(self) -> int:
        """The most positions one decode chunk can write past a row's length."""
        return self.decode_chunk * (self.ring_extra + 1)

    def _bounds(self, occupied: np.ndarray) -> np.ndarray:
        """Upper bounds of the occupied slots' cache lengths after every
        dispatched chunk (0 for the others)."""
        pending = sum((np.maximum(g, 0) for _, g in self._inflight), np.zeros_like(self._length))
        return np.where(occupied, np.minimum(self._length + pending, self.max_seq_len), 0)

    # --- pages ---------------------------------------------------------------------------

    def _pages_wanted(self, occupied: np.ndarray) -> np.ndarray:
        """Pages each occupied slot lacks for the next decode chunk."""
        ends = np.minimum(self._bounds(occupied) + self._chunk_growth(), self.max_seq_len)
        have = np.array([len(p) for p in self._slot_pages])
        return np.where(occupied, np.maximum(-(-ends // self.page_size) - have, 0), 0)

    def pages_short(self, occupied: np.ndarray) -> int:
        """Pages missing for the next decode chunk of the `occupied` slots
        (0 when the pool can supply them, and always without paging)."""
        if not self.paged:
            return 0
        return max(0, int(self._pages_wanted(occupied).sum()) - self.kv_pages.num_available)

    def check_fits(self, num_tokens: int) -> None:
        """Raise ValueError when a request of `num_tokens` positions (prompt +
        max_new_tokens) would need more pages than the whole pool, with the
        next decode chunk's headroom (never without paging)."""
        if not self.paged:
            return
        need = pages_per_seq(min(num_tokens + self._chunk_growth(), self.max_seq_len), self.page_size)
        if need > self.kv_pages.num_pages:
            raise ValueError(f"a request of {num_tokens} tokens needs {need} KV pages of "
                             f"{self.page_size} tokens, more than the pool's {self.kv_pages.num_pages}; "
                             "shorten it or raise num_pages / kv_cache_memory")

    def can_begin(self, request: Request, occupied: np.ndarray, generated: Sequence[int] = ()) -> bool:
        """Whether the pool can take `request` now (always without paging):
        its prompt's pages beyond a cached prefix, plus the next decode chunk
        of every occupied slot and of this one, without preempting anyone."""
        if not self.paged:
            return True
        ids = tuple(request.prompt_ids) + tuple(generated)
        pool, ps = self.kv_pages, self.page_size
        hit, unreferenced = 0, 0
        if self.prefix_caching:
            hit, unreferenced = pool.peek(page_hashes(ids, ps, request.cache_salt)[:(len(ids) - 1) // ps])
        own = pages_per_seq(min(len(ids) + self._chunk_growth(), self.max_seq_len), ps) - hit
        return own + int(self._pages_wanted(occupied).sum()) <= pool.num_available - unreferenced

    def release(self, slot: int, written_ids: Sequence[int] = ()) -> None:
        """Free a slot's pages (finished, aborted or preempted). With prefix
        caching, the full pages of `written_ids` (the tokens whose K/V the
        slot's cache holds, in order: the prompt, then every generated token
        but the last) are registered first, so later requests can share them."""
        if not self.paged:
            return
        pages = self._slot_pages[slot]
        if self.prefix_caching:
            for page, h in zip(pages, page_hashes(written_ids, self.page_size, self._slot_salt[slot])):
                self.kv_pages.register(page, h)
        self.kv_pages.release(pages)
        self._slot_pages[slot] = []
        self._tables[slot] = self.kv_pages.num_pages

    def discard(self, job: PrefillJob) -> None:
        """Free the pages of a job that will not be inserted (aborted or preempted)."""
        if self.paged:
            self.kv_pages.release(job.pages)
            job.pages = []

    def _grow_pages(self, occupied: np.ndarray) -> None:
        """Give every occupied slot the pages its next decode chunk can write,
        and send the block tables to the decode state.

        Raises:
          PoolExhaustedError: the pool cannot (the scheduler preempts first).
        """
        wanted = self._pages_wanted(occupied)
        new = self.kv_pages.allocate(int(wanted.sum()))
        for slot in np.flatnonzero(wanted):
            pages, new = new[:wanted[slot]], new[wanted[slot]:]
            start = len(self._slot_pages[slot])
            self._slot_pages[slot] += pages
            self._tables[slot, start:start + len(pages)] = pages
        m = self.state.cache.block_tables.shape[1]
        self.state = self.state.replace(cache=self.state.cache.replace(
            block_tables=jnp.asarray(self._tables[:, :m])))

    def decode(self, occupied: np.ndarray, num_logprobs: int = -1,
               max_drafts: Optional[np.ndarray] = None):
        """Dispatch one decode chunk over all slots; slots not `occupied`
        (bool [max_num_seqs]) are marked done first. A plain chunk runs on
        the first `_row_bucket(occupied)` rows only when that program was
        compiled by `warmup` (the outputs keep their [steps, max_num_seqs]
        shapes). With speculation and a
        `max_drafts` (int [max_num_seqs], each slot's cap of proposed tokens
        per round) above 0 for some occupied slot, the chunk is
        `decode_chunk` proposal + verification rounds instead of steps.
        Returns the chunk's device outputs without waiting (see `fetch`).

        Raises:
          PoolExhaustedError: paged, and the pool cannot give the occupied
            slots the pages of this chunk (`pages_short` > 0).
        """
        growth = self._chunk_growth()
        self._fit(int(self._bounds(occupied).max(initial=0)) + growth)
        if self.paged:
            self._grow_pages(occupied)
        finished = jnp.asarray(~occupied)
        spec = (self.speculative is not None and max_drafts is not None
                and bool(np.any(np.where(occupied, max_drafts, 0) > 0)))
        draft = self._draft
        if draft is not None:   # the draft's cache must follow every step: always speculate
            caps = np.ones(self.max_num_seqs, np.int32) if max_drafts is None else max_drafts
            self.state, out = self.programs(
                speculative.draft_chunk, self.params, draft.params, self.state, self.stop, finished,
                jnp.asarray(np.maximum(caps, 1).astype(np.int32)), config=self.config,
                draft_config=draft.config, num_steps=self.decode_chunk,
                k=self.speculative.num_speculative_tokens, num_logprobs=num_logprobs)
        elif spec:
            cfg = self.speculative
            self.state, out = self.programs(
                speculative.ngram_chunk, self.params, self.state, self.stop, finished,
                jnp.asarray(np.asarray(max_drafts, np.int32)), config=self.config,
                num_steps=self.decode_chunk, k=cfg.num_speculative_tokens, ngram_min=cfg.ngram_min,
                ngram_max=cfg.ngram_max, num_logprobs=num_logprobs)
        else:
            kwargs = dict(config=self.config, num_steps=self.decode_chunk, num_logprobs=num_logprobs)
            rows = self._row_bucket(occupied)
            if rows < self.max_num_seqs and self.programs.has(
                    engine.decode_chunk_rows, self.params, self.state, self.stop, finished, rows=rows,
                    **kwargs):
                self.state, out = self.programs(engine.decode_chunk_rows, self.params, self.state,
                                                self.stop, finished, rows=rows, **kwargs)
                self.row_chunks[rows] += 1
            else:
                self.state, out = self.programs(engine.decode_chunk, self.params, self.state, self.stop,
                                                finished, **kwargs)
            growth = self.decode_chunk
        self.decode_steps += self.decode_chunk
        self._inflight.append((out, np.where(occupied, growth, 0)))
        return out

    def fetch(self, out) -> engine.StepOutput:
        """Device outputs of `decode` or a job's `first` -> numpy (blocks
        until they are computed), as a StepOutput with [steps, rows] leaves:
        a speculative chunk's rounds are laid out one token per step
        (NO_TOKEN where a round emitted fewer than k + 1), with `drafted`,
        `accepted` and `rounds` ([rows] totals) set."""
        host = jax.device_get(out)
        if self._inflight and self._inflight[0][0] is out:
            _, growth = self._inflight.pop(0)
            emitted = (host.token >= 0)      # [steps, B] or, speculative, [steps, B, k + 1]
            emitted = emitted.reshape(emitted.shape[0], self.max_num_seqs, -1).sum(axis=(0, 2))
            self._length += np.where(growth > 0, emitted, 0)
        if not isinstance(host, speculative.SpecOutput):
            return host
        steps, b, width = host.token.shape
        flat = lambda x: None if x is None else np.swapaxes(x, 1, 2).reshape(
            (steps * width, b) + x.shape[3:])
        return engine.StepOutput(
            flat(host.token), np.repeat(host.done, width, axis=0), flat(host.logprob),
            flat(host.top_ids), flat(host.top_logprobs), drafted=host.drafted.sum(0),
            accepted=host.accepted.sum(0), rounds=(host.drafted > 0).sum(0))

    # --- ahead-of-time compilation ------------------------------------------------------------

    def warmup(self, max_prompt_len: Optional[int] = None, num_logprobs: Sequence[int] = (-1,)) -> int:
        """Compile, ahead of time and without running anything, every program
        serving prompts of up to `max_prompt_len` tokens (default
        max_seq_len - 1) can need, so that no request waits for a compile:
        `start` for each whole-prompt bucket and its prefix cache sizes,
        `extend` / `start` for the pieces of chunked prompts, the decode chunk
        (speculative too, when on; dense, also on 1, 2, 4, ... rows below
        max_num_seqs, which `decode` uses only once compiled) and `insert`
        for each decode cache bucket,
        and every cache growth. Log-prob counts other than `num_logprobs`
        still compile on first use. Returns the programs compiled now.
        """
        before = self.programs.num_compiles
        limit = self.max_seq_len - 1 if max_prompt_len is None else min(max_prompt_len,
                                                                        self.max_seq_len - 1)
        prefixes = self._warm_prefills(limit, num_logprobs)
        smallest = self.buckets.cache_bucket(1 + self._chunk_growth())
        sizes = [c for c in self.buckets.cache if smallest <= c]
        for size in sizes:
            state = jax.eval_shape(lambda size=size: self._empty_state(size))
            for n in num_logprobs:
                self._compile_decode(state, n)
            for prefix in prefixes:
                c = prefix.cache.max_seq_len
                if self.paged or c <= size or c in sizes:
                    self.programs.compiled(engine.insert, state, prefix,
                                           jax.ShapeDtypeStruct((), jnp.int32))
            for bigger in (c for c in sizes if c > size):
                self.programs.compiled(engine.resize_state, state, max_seq_len=bigger)
        return self.programs.num_compiles - before

    def _warm_prefills(self, limit: int, num_logprobs: Sequence[int]) -> list:
        """Compile the prefill programs for prompts of 1 .. limit tokens (and,
        with prefix caching, the last pieces after a hit); returns the
        abstract prefix states they make (one per cache size)."""
        chunk = self.prefill_chunk_size
        whole = limit if chunk is None else min(chunk, limit)
        request = Request([0], max_new_tokens=1)
        inputs = row_inputs([request], self.config.vocab_size, self.max_seq_len)
        one = jax.ShapeDtypeStruct((1,), jnp.int32)
        prefixes = {}
        low = 1
        for width in self.buckets.prompt:                 # whole prompts: fresh prefill
            if low > whole:
                break
            for p in {low, min(width, whole)}:
                size = self._job_size(self.buckets.cache_bucket(max(width, p + self.decode_chunk)))
                prefixes[size] = self._compile_start(width, size, inputs, one, True, num_logprobs)
            low = width + 1
        if whole < limit:                                 # chunked prompts: fixed-width pieces
            for size in sorted({self._job_size(self.buckets.cache_bucket(p + self.decode_chunk))
                                for p in range(whole + 1, limit + 1)}):
                tokens = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
                self.programs.compiled(engine.extend, self.params, self._job_shape(size), tokens, one,
                                       config=self.config)
                self._compile_draft_prefill(engine.extend, chunk, size)
                prefixes[size] = self._compile_start(chunk, size, inputs, one, False, num_logprobs)
        if self.prefix_caching:   # the last piece after a hit: up to `whole` tokens in its bucket
            size, widest = self._job_size(0), self.buckets.prompt_bucket(whole)
            for width in (w for w in self.buckets.prompt if w <= widest):
                prefixes[size] = self._compile_start(width, size, inputs, one, False, num_logprobs)
        return list(prefixes.values())

    def _job_size(self, size: int) -> int:
        """The capacity of a prefill job's cache for a dense `size` (paged: every job's)."""
        return pages_per_seq(self.max_seq_len, self.page_size) * self.page_size if self.paged else size

    def _job_shape(self, size: int):
        """The abstract one-row cache a prefill call runs on (paged: with the pools)."""
        if self.paged:
            return jax.eval_shape(lambda: self._job_cache(pools=True))
        return jax.eval_shape(lambda: self._cache(self.config, 1, size))

    def _compile_start(self, width, size, inputs, one, fresh, num_logprobs):
        cache = self._job_shape(size)
        tokens = jax.ShapeDtypeStruct((1, width), jnp.int32)
        if fresh:
            self._compile_draft_prefill(engine.prefill, width, size)
        for n in num_logprobs:
            self.programs.compiled(engine.start, self.params, cache, tokens, one, inputs, self.stop,
                                   config=self.config, num_logprobs=n, fresh=fresh)
        prefix = jax.eval_shape(lambda c: engine.start(self.params, c, tokens, one, inputs, self.stop,
                                                       config=self.config, fresh=fresh)[0], cache)
        if self.paged:
            prefix = prefix.replace(cache=jax.eval_shape(kv_cache.without_pools, prefix.cache))
        draft = self._draft
        if draft is not None:
            prefix = prefix.replace(draft=jax.eval_shape(lambda: self._cache(draft.config, 1, size)))
        return prefix

    def _compile_draft_prefill(self, phase, width, size) -> None:
        draft = self._draft
        if draft is None:
            return
        cache = jax.eval_shape(lambda: self._cache(draft.config, 1, size))
        self.programs.compiled(phase, draft.params, cache, jax.ShapeDtypeStruct((1, width), jnp.int32),
                               jax.ShapeDtypeStruct((1,), jnp.int32), config=draft.config)

    def _row_bucket(self, occupied: np.ndarray) -> int:
        """The rows a plain decode chunk computes: the smallest power of two
        (at most max_num_seqs) above the highest occupied slot. Admission
        takes the lowest free slot, so a lightly loaded server decodes a
        few rows rather than all its slots."""
        top = int(np.flatnonzero(occupied).max(initial=0)) + 1
        return min(1 << (top - 1).bit_length(), self.max_num_seqs)

    def _row_buckets(self) -> list[int]:
        """The row counts below max_num_seqs that `warmup` compiles (dense, no draft model)."""
        if self.paged or self._draft is not None:
            return []
        return [1 << i for i in range(self.max_num_seqs.bit_length()) if 1 << i < self.max_num_seqs]

    def _compile_decode(self, state, num_logprobs: int) -> None:
        finished = jax.ShapeDtypeStruct((self.max_num_seqs,), bool)
        self.programs.compiled(engine.decode_chunk, self.params, state, self.stop, finished,
                               config=self.config, num_steps=self.decode_chunk,
                               num_logprobs=num_logprobs)
        for rows in self._row_buckets():   # used only once compiled: plain runs never compile them
            self.programs.compiled(engine.decode_chunk_rows, self.params, state, self.stop, finished,
                                   config=self.config, num_steps=self.decode_chunk,
                                   num_logprobs=num_logprobs, rows=rows)
        spec = self.speculative
        if spec is None:
            return
        caps = jax.ShapeDtypeStruct((self.max_num_seqs,), jnp.int32)
        k = spec.num_speculative_tokens
        if self._draft is not None:
            self.programs.compiled(speculative.draft_chunk, self.params, self._draft.params, state,
                                   self.stop, finished, caps, config=self.config,
                                   draft_config=self._draft.config, num_steps=self.decode_chunk, k=k,
                                   num_logprobs=num_logprobs)
        else:
            self.programs.compiled(speculative.ngram_chunk, self.params, state, self.stop, finished,
                                   caps, config=self.config, num_steps=self.decode_chunk, k=k,
                                   ngram_min=spec.ngram_min, ngram_max=spec.ngram_max,
                                   num_logprobs=num_logprobs)

    @property
    def cache_capacity(self) -> int:
        """Positions per slot of the decode state's cache (0 before the first request)."""
        return 0 if self.state is None else self.state.cache.max_seq_len
