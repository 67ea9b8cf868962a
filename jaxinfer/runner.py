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

from jaxinfer import engine, sampling
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


def row_inputs(requests: Sequence[Request], vocab_size: int) -> engine.RowInputs:
    """`engine.start`'s per-row inputs for requests (one row each): budgets,
    min_tokens, ignore_eos, the prompt's token set, PRNG keys, sampling arrays."""
    seen = np.zeros((len(requests), vocab_size), bool)
    for row, r in enumerate(requests):
        seen[row, list(r.prompt_ids)] = True
    return engine.RowInputs(
        max_new_tokens=jnp.array([r.max_new_tokens for r in requests], jnp.int32),
        min_tokens=jnp.array([r.min_tokens for r in requests], jnp.int32),
        ignore_eos=jnp.array([r.ignore_eos for r in requests]), seen=jnp.asarray(seen),
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
    """

    def __init__(self, config: ModelConfig, params: dict, *, max_num_seqs: int, buckets: Buckets,
                 decode_chunk: int, prefill_chunk_size: Optional[int],
                 stop_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                 cache_dtype=jnp.float32, programs: Optional[ProgramCache] = None):
        self.config, self.params = config, params
        self.max_num_seqs = int(max_num_seqs)
        self.buckets = buckets
        self.decode_chunk = int(decode_chunk)
        self.prefill_chunk_size = prefill_chunk_size
        self.cache_dtype = cache_dtype
        self.programs = programs or ProgramCache()
        self.stop = stop_tokens(stop_token_ids, eos_token_ids)
        self.state: Optional[engine.DecodeState] = None
        self.min_capacity = 0  # the decode state's cache never gets smaller than this (benchmarks)
        self._length_bound = np.zeros(self.max_num_seqs, np.int64)  # cache length after dispatched work
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
        cache = init_cache(self.config, 1, size, self.cache_dtype)
        return PrefillJob(request, cache, row_inputs([request], self.config.vocab_size))

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
        if last:
            job.prefix, out = self.programs(
                engine.start, self.params, job.cache, tokens, lengths, job.inputs, self.stop,
                config=self.config, num_logprobs=logprob_bucket(job.request.logprobs),
                fresh=job.done == 0)
            job.first = out._replace(**{f: x[None] for f, x in out._asdict().items() if x is not None})
            job.cache = None
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
            keys=sampling.row_keys([0] * b),
            sampling=sampling.stack_params([sampling.SamplingParams(temperature=0.0)] * b))
        return engine.DecodeState(init_cache(self.config, b, size, self.cache_dtype), rows)

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
        bounds = np.where(occupied, self._length_bound, 0)
        self._fit(max(int(bounds.max(initial=0)), p) + self.decode_chunk)
        self.state = self.programs(engine.insert, self.state, job.prefix,
                                   jnp.asarray(slot, jnp.int32))
        self._length_bound[slot] = p

    def decode(self, occupied: np.ndarray, num_logprobs: int = -1) -> engine.StepOutput:
        """Dispatch one decode chunk over all slots; slots not `occupied`
        (bool [max_num_seqs]) are marked done first. Returns the chunk's
        device outputs ([decode_chunk, max_num_seqs] leaves) without waiting."""
        bounds = np.where(occupied, self._length_bound, 0)
        self._fit(int(bounds.max(initial=0)) + self.decode_chunk)
        self.state, out = self.programs(engine.decode_chunk, self.params, self.state, self.stop,
                                        jnp.asarray(~occupied), config=self.config, num_steps=self.decode_chunk,
                                        num_logprobs=num_logprobs)
        self.decode_steps += self.decode_chunk
        self._length_bound = np.where(
            occupied, np.minimum(self._length_bound + self.decode_chunk, self.max_seq_len), 0)
        return out

    @staticmethod
    def fetch(out: engine.StepOutput) -> engine.StepOutput:
        """Device outputs of `decode` or a job's `first` -> numpy (blocks
        until they are computed)."""
        return jax.device_get(out)

    @property
    def cache_capacity(self) -> int:
        """Positions per slot of the decode state's cache (0 before the first request)."""
        return 0 if self.state is None else self.state.cache.max_seq_len
