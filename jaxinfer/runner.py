"""The device side of serving: one model's compiled programs over a decode
state of `max_num_seqs` slots.

    begin(request)          a PrefillJob with its own one-row cache
    prefill(job, budget)    one chunk of the prompt through `engine.extend`,
                            the last one through `engine.start` (first token)
    insert(job, slot)       `engine.insert`: the prefilled row into a decode slot
    decode(occupied, ...)   `engine.decode_chunk` over every slot (asynchronous)
    fetch(outputs)          device outputs -> numpy, on the host

The scheduler (`jaxinfer.scheduler`) decides what runs; this module only runs
it and keeps the shapes to a few buckets. The cache of the decode state is
sized to a cache bucket that covers every occupied slot through the chunks
dispatched so far plus the next one, grown before a chunk that would
overflow it and shrunk when the long rows have left.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import engine, sampling, speculative
from jaxinfer.speculative import SpecConfig
from jaxinfer.buckets import Buckets, bucket_for
from jaxinfer.cache import init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.programs import ProgramCache
from jaxinfer.request import Request

# Log-prob counts are compiled for these values only (a request asking for
# n alternatives runs with the next one and keeps its n).
LOGPROB_BUCKETS = (0, 1, 2, 4, 8, 20)


def logprob_bucket(n: Optional[int]) -> int:
    """The static `num_logprobs` for a request wanting n alternatives (-1: none)."""
    return -1 if n is None else bucket_for(n, LOGPROB_BUCKETS)


def row_inputs(requests: Sequence[Request], vocab_size: int, history: int) -> engine.RowInputs:
    """`engine.start`'s per-row inputs for requests (one row each): budgets,
    min_tokens, ignore_eos, the prompt's token set and ids (in a history of
    `history` positions, >= each prompt + max_new_tokens), PRNG keys,
    sampling arrays."""
    seen = np.zeros((len(requests), vocab_size), bool)
    ids = np.zeros((len(requests), history), np.int32)
    for row, r in enumerate(requests):
        seen[row, list(r.prompt_ids)] = True
        ids[row, :len(r.prompt_ids)] = r.prompt_ids
    return engine.RowInputs(
        max_new_tokens=jnp.array([r.max_new_tokens for r in requests], jnp.int32),
        min_tokens=jnp.array([r.min_tokens for r in requests], jnp.int32),
        ignore_eos=jnp.array([r.ignore_eos for r in requests]), seen=jnp.asarray(seen),
        history=jnp.asarray(ids),
        history_len=jnp.array([len(r.prompt_ids) for r in requests], jnp.int32),
        keys=sampling.row_keys([r.sampling.seed for r in requests]),
        sampling=sampling.stack_params([r.sampling for r in requests]))


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
      request: the Request; done: prompt tokens already in the cache.
      prefix: after the last chunk, the one-row DecodeState to insert.
      first: after the last chunk, the first token's StepOutput with [1, 1]
        leaves (one step, one row), on the device.
    """

    request: Request
    cache: object
    inputs: engine.RowInputs
    draft_cache: object = None
    done: int = 0
    prefix: Optional[engine.DecodeState] = None
    first: Optional[tuple] = None

    @property
    def remaining(self) -> int:
        return len(self.request.prompt_ids) - self.done


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
    """

    def __init__(self, config: ModelConfig, params: dict, *, max_num_seqs: int, buckets: Buckets,
                 decode_chunk: int, prefill_chunk_size: Optional[int],
                 stop_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                 cache_dtype=jnp.float32, programs: Optional[ProgramCache] = None,
                 speculative: Optional[SpecConfig] = None):
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
        self.ring_extra = speculative.num_speculative_tokens if speculative else 0
        self.min_capacity = 0  # the decode state's cache never gets smaller than this (benchmarks)
        # each slot's cache length after the chunks fetched so far, and the most
        # each dispatched, unfetched chunk can add (sizing the cache)
        self._length = np.zeros(self.max_num_seqs, np.int64)
        self._inflight: list = []
        self.decode_steps = 0  # decode steps dispatched

    @property
    def max_seq_len(self) -> int:
        return self.buckets.max_seq_len

    # --- prefill -------------------------------------------------------------------------

    def begin(self, request: Request) -> PrefillJob:
        """A job for `request` (validated by the scheduler): its one-row cache
        and device inputs. Nothing runs yet."""
        p = len(request.prompt_ids)
        whole = self.prefill_chunk_size is None or p <= self.prefill_chunk_size
        fresh_bucket = self.buckets.prompt_bucket(p) if whole else 0
        size = self.buckets.cache_bucket(max(fresh_bucket, p + self.decode_chunk))
        cache = init_cache(self.config, 1, size, self.cache_dtype, ring_extra=self.ring_extra)
        draft = self._draft
        draft_cache = None if draft is None else init_cache(
            draft.config, 1, size, self.cache_dtype, ring_extra=self.ring_extra)
        return PrefillJob(request, cache, row_inputs([request], self.config.vocab_size,
                                                     self.max_seq_len), draft_cache=draft_cache)

    @property
    def _draft(self):
        spec = self.speculative
        return spec.draft if spec is not None and spec.method == "draft" else None

    def prefill(self, job: PrefillJob, budget: int) -> int:
        """Run the next piece of `job`'s prompt: at most `budget` tokens (at
        least one), at most `prefill_chunk_size`. Returns the tokens run. The
        last piece also samples the first token (`job.prefix`, `job.first`)."""
        ids = job.request.prompt_ids
        limit = self.prefill_chunk_size or len(ids)
        n = min(job.remaining, max(budget, 1), limit)
        if job.done == 0 and n == len(ids):           # the whole prompt: prefill on an empty cache
            width = self.buckets.prompt_bucket(n)
        else:
            width = min(self.buckets.prompt_bucket(n), limit)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = ids[job.done:job.done + n]
        tokens, lengths = jnp.asarray(tokens), jnp.array([n], jnp.int32)
        last = job.done + n == len(ids)
        draft = self._draft
        if draft is not None:   # the draft model reads the prompt too
            phase = engine.prefill if job.done == 0 and n == len(ids) else engine.extend
            _, job.draft_cache = self.programs(phase, draft.params, job.draft_cache, tokens, lengths,
                                               config=draft.config)
        if last:
            job.prefix, out = self.programs(
                engine.start, self.params, job.cache, tokens, lengths, job.inputs, self.stop,
                config=self.config, num_logprobs=logprob_bucket(job.request.logprobs),
                fresh=job.done == 0)
            job.first = out._replace(**{f: x[None] for f, x in out._asdict().items() if x is not None})
            job.prefix = job.prefix.replace(draft=job.draft_cache)
            job.cache = job.draft_cache = None
        else:
            _, job.cache = self.programs(engine.extend, self.params, job.cache, tokens, lengths,
                                         config=self.config)
        job.done += n
        return n

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
        cache = init_cache(self.config, b, size, self.cache_dtype, ring_extra=self.ring_extra)
        draft = self._draft
        draft_cache = None if draft is None else init_cache(
            draft.config, b, size, self.cache_dtype, ring_extra=self.ring_extra)
        return engine.DecodeState(cache, rows, draft_cache)

    def _fit(self, needed: int) -> None:
        """Size the decode state's cache to the bucket of `needed` positions:
        grow when it is too small, shrink when it is over twice too large."""
        size = max(self.buckets.cache_bucket(needed), self.min_capacity)
        if self.state is None:
            self.state = self._empty_state(size)
            return
        current = self.state.cache.max_seq_len
        if size > current or 2 * size <= current:
            self.state = self.programs(engine.resize_state, self.state, max_seq_len=size)

    def insert(self, job: PrefillJob, slot: int, occupied: np.ndarray) -> None:
        """Put a prefilled job's row into decode slot `slot`.

        Args:
          occupied: bool [max_num_seqs], the slots holding running requests
            (this one excluded), for sizing the cache.
        """
        p = len(job.request.prompt_ids)
        self._fit(max(int(self._bounds(occupied).max(initial=0)), p) + self._chunk_growth())
        self.state = self.programs(engine.insert, self.state, job.prefix,
                                   jnp.asarray(slot, jnp.int32))
        self._length[slot] = p
        for _, growth in self._inflight:   # chunks in flight ran this slot for its previous occupant
            growth[slot] = 0

    def _chunk_growth(self) -> int:
        """The most positions one decode chunk can write past a row's length."""
        return self.decode_chunk * (self.ring_extra + 1)

    def _bounds(self, occupied: np.ndarray) -> np.ndarray:
        """Upper bounds of the occupied slots' cache lengths after every
        dispatched chunk (0 for the others)."""
        pending = sum((np.maximum(g, 0) for _, g in self._inflight), np.zeros_like(self._length))
        return np.where(occupied, np.minimum(self._length + pending, self.max_seq_len), 0)

    def decode(self, occupied: np.ndarray, num_logprobs: int = -1,
               max_drafts: Optional[np.ndarray] = None):
        """Dispatch one decode chunk over all slots; slots not `occupied`
        (bool [max_num_seqs]) are marked done first. With speculation and a
        `max_drafts` (int [max_num_seqs], each slot's cap of proposed tokens
        per round) above 0 for some occupied slot, the chunk is
        `decode_chunk` proposal + verification rounds instead of steps.
        Returns the chunk's device outputs without waiting (see `fetch`)."""
        growth = self._chunk_growth()
        self._fit(int(self._bounds(occupied).max(initial=0)) + growth)
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
            self.state, out = self.programs(engine.decode_chunk, self.params, self.state, self.stop,
                                            finished, config=self.config, num_steps=self.decode_chunk,
                                            num_logprobs=num_logprobs)
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
            emitted = (host.token >= 0).reshape(-1, self.max_num_seqs).sum(axis=0)
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

    @property
    def cache_capacity(self) -> int:
        """Positions per slot of the decode state's cache (0 before the first request)."""
        return 0 if self.state is None else self.state.cache.max_seq_len
