"""The device side of serving: one model's compiled step over a paged KV
cache of `max_num_seqs` slots.

    admit(admissions)                    new requests' rows and cached lengths (`step.admit`)
    step(segments, block_tables)         one ragged forward over a token bucket (`step.step`)
    decode(slots, block_tables, n)       n decoding steps in one lax.scan (`step.decode_loop`)
    fetch(dispatched)                    device outputs -> numpy, on the host
    read_pages / write_pages             pages out of / into the pool (disaggregation)

The scheduler (`jaxinfer.serving.scheduler`) decides what runs and owns the
pages (`serving.pages.KVPageManager`: block tables are sent with each call);
this module only runs it. Shapes: a step's T tokens are padded to the
smallest token bucket (powers of two up to `token_budget`) that holds them
and its segments to R = min(T, max_num_seqs); a decode loop's rows to a
power of two, or to the rows of the loop its batch began in (`loop_rows`).
Those buckets are the compile plan (`compile_plan`), which
warm-up (`warm`, a `serving.warmup.WarmUp`) and dispatch share.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import paged
from jaxinfer.cache.layouts import LAYOUTS, resolve_layout
from jaxinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxinfer.engine import step as engine_step
from jaxinfer.engine.ragged import AttentionBackend, choose_backend
from jaxinfer.sampling.arrays import to_device
from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving import chunking
from jaxinfer.serving.buckets import bucket_for, power_of_two_buckets
from jaxinfer.serving.grammar_rows import GrammarRows
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.request import Request
from jaxinfer.serving.rows import TokenRules, row_inputs
from jaxinfer.serving.warmup import WarmUp
from jaxinfer.speculative import DraftConfig, NgramConfig, SpecConfig

# The smallest token bucket. A padded token costs as much as a real one in
# the quantized matmuls (dequantizing and multiplying bound them at a few
# rows), so one decoding row runs at width 1; the deterministic mode keeps 2:
# XLA compiles a one-token step into other code, and with width-1 steps tiny
# Gemma 3's lone row (float32 weights) got log-probs 1 ulp off those it gets
# among others (tests/serving/test_deterministic.py), though the matmul
# kernels compute only the live row in either. Not narrowed down further;
# the bfloat16 weights' kernel, once blamed, now sums a lone row as any other.
MIN_TOKEN_BUCKET = 1
DETERMINISTIC_MIN_TOKEN_BUCKET = 2

# Allocates the KV page pools (`ModelRunner.cache`).
_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-kv-pool")

# Rows one admission program writes (more admissions take several calls).
ADMIT_ROWS = 8

# Log-prob counts are compiled for these values only (a request asking for
# n alternatives runs with the next one and keeps its n).
LOGPROB_BUCKETS = (0, 1, 2, 4, 8, 20)


def loop_rows(num_rows: int, max_num_seqs: int, at_least: int = 0) -> int:
    """R, the rows a decode loop of `num_rows` rows runs at: the smallest
    power of two that holds them (at most `max_num_seqs`), or `at_least`
    when that is more (the scheduler keeps a batch's tail in the batch's
    loop: padded rows cost no matmul work, a new loop costs a compile)."""
    return max(min(1 << (num_rows - 1).bit_length(), max_num_seqs), at_least)


def logprob_bucket(n: Optional[int]) -> int:
    """The static `num_logprobs` for a request wanting n alternatives (-1: none)."""
    return -1 if n is None else bucket_for(n, LOGPROB_BUCKETS)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One slot's share of a step.

    Attributes:
      slot: the slot.
      tokens: a prompt chunk's ids (at the slot's current length); empty for
        a decoding row, whose token (and drafts) come from the device.
      sample: the row samples after this segment (a decoding row, or a
        prompt's last chunk).
      max_drafts: a decoding row's cap on drafted tokens this step.
    """

    slot: int
    tokens: tuple[int, ...] = ()
    sample: bool = True
    max_drafts: int = 0

    @property
    def decode(self) -> bool:
        return not self.tokens


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request taking a slot: its tokens generated before a preemption
    (prefilled again after the prompt), and the tokens its slot's cache
    already holds from the prefix cache."""

    slot: int
    request: Request
    generated: tuple[int, ...] = ()
    cached: int = 0


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """Device outputs not fetched yet, and how many steps they hold."""

    out: StepOutput
    steps: int


class ModelRunner(GrammarRows):
    """Runs one model's step over a paged KV cache for the scheduler.

    Args:
      config: ModelConfig; params: prepared params.
      cache_config: the KV cache (`config.CacheConfig`) with num_pages set
        (`LLM.pool_config`): max_seq_len tokens per slot, the pool of
        num_pages pages of page_size tokens, dtype (None: float32) and
        kv_cache_dtype, and its layout (`cache.LAYOUTS`; a draft model
        without what the layout needs gets "paged").
      scheduler_config: `config.SchedulerConfig`: max_num_seqs slots, and
        max_num_batched_tokens, the most tokens one step runs (its largest
        token bucket).
      tokens: the stop rule, vocabulary limit and grammar compiler
        (`rows.TokenRules`; its grammars None: structured requests are refused).
      speculative: a `SpecConfig` (n-gram or draft-model proposals verified
        in the step) or None.
      programs: the `ProgramCache` to compile through.
      backend: the attention backend (default `choose_backend(dtype)`).
    Raises:
      ValueError: num_pages unset; an unknown layout, or one the model does
        not fit (`cache.resolve_layout`).
    """

    def __init__(self, config: ModelConfig, params: dict, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, *, tokens: TokenRules = TokenRules(),
                 speculative: Optional[SpecConfig] = None, programs: Optional[ProgramCache] = None,
                 backend: Optional[AttentionBackend] = None):
        if cache_config.num_pages is None:
            raise ValueError("cache_config.num_pages must be set for a runner (LLM.pool_config)")
        cache_config = cache_config.replace(dtype=cache_config.dtype or "float32")
        self.layout, self.cache_config = resolve_layout(cache_config, config)
        self.scheduler_config = scheduler_config
        self.config, self.params = config, params
        self.controls = None      # the LLM's `serving.control.Controls` (set by `LLM.runner`)
        self.max_num_seqs, self.max_seq_len = scheduler_config.max_num_seqs, cache_config.max_seq_len
        self.page_size, self.num_pages = cache_config.page_size, cache_config.num_pages
        self.pages_per_seq = cache_config.pages_per_seq
        self.programs = programs or ProgramCache()
        self.backend = backend or choose_backend(jnp.dtype(cache_config.dtype))
        self.stop = tokens.device()
        self.grammars = tokens.grammars
        self._init_grammar_rows(config.vocab_size, (-1,) + LOGPROB_BUCKETS)   # `grammar_rows`
        self.speculative = speculative
        self.spec = self._spec(speculative)
        self.draft_params = speculative.draft.params if isinstance(self.spec, DraftConfig) else None
        self.width = 1 + (self.spec.k if self.spec else 0)
        smallest = DETERMINISTIC_MIN_TOKEN_BUCKET if config.deterministic else MIN_TOKEN_BUCKET
        budget = scheduler_config.max_num_batched_tokens
        self.token_buckets = power_of_two_buckets(min(smallest, budget), budget)
        # The pool is zero-filled on a thread (about a second of CPU per GiB, outside
        # the GIL), so it overlaps the warm-up's compiles: they need its shapes only.
        self._cache_shape = jax.eval_shape(self._init_caches)
        self.reset()
        self.decode_steps = 0     # decoding steps dispatched
        # Token buckets a step may use: all of them (compiled on first use),
        # or, once `warmup` ran, those compiled so far (`warm.ready_buckets`; larger ones pad).
        self.warm = WarmUp(self.compile_plan, self.programs)

    @property
    def params(self):
        """The prepared params the programs run on; replaced whole
        (`LLM.update_weights`), never changed in place."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        # The compile plans lower from the params' shapes only, so that plans kept
        # for later (a background warm-up) hold no reference to replaced weights.
        self._params = value
        self._params_shape = None if value is None else jax.tree.map(_abstract, value)

    def free_cache(self) -> None:
        """Delete the KV pool's device arrays now (`LLM.sleep`); `reset`
        allocates a new one of the same shapes."""
        cache, self._cache, self._cache_future = self.cache, None, None
        for x in jax.tree.leaves(cache):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()

    @property
    def cache(self):
        """The KV cache pytree (`cache.paged.PagedKVCache`); the first read
        after `reset` waits for the pool's allocation."""
        if self._cache_future is not None:
            self._cache, self._cache_future = self._cache_future.result(), None
        return self._cache

    @cache.setter
    def cache(self, value) -> None:
        self._cache, self._cache_future = value, None

    def reset(self) -> None:
        """Empty device state: a zeroed KV cache (the draft's too; allocated
        on a thread, see `cache`) and idle rows, as at construction; what the
        slots held is gone (after a failed step: `serving.faults.fail_step`)."""
        self.cache = None
        self._cache_future = _ALLOCATOR.submit(self._init_caches)
        self.grammar_pool.release_all()     # the new rows run no automaton
        self.rows = engine_step.new_rows(row_inputs(
            [Request((0,), max_new_tokens=1)] * self.max_num_seqs, self.config.vocab_size,
            self.max_seq_len))
        if self.growth is not None:     # compiles once: rows' states move without a compile
            self.growth.compile_remap(self.grammar_pool.limit[0], self.rows.grammar)

    def _init_caches(self):
        cache = self._init_cache(self.config)
        if self.draft_params is not None:
            cache = cache.replace(draft=self._init_cache(self.spec.config, True))
        return cache

    def _init_cache(self, config: ModelConfig, draft: bool = False):
        """An empty cache of this runner's layout for `config` (the target,
        or the draft: "paged" where the draft lacks what the layout needs,
        e.g. sliding layers for "paged_ring"); a step writes at most the
        token budget plus k drafts per slot."""
        layout = self.layout if not draft or self.layout.fits(config) else LAYOUTS["paged"]
        return layout.init(config, self.cache_config, self.max_num_seqs,
                           self.token_budget + self.width - 1)

    @staticmethod
    def _spec(spec: Optional[SpecConfig]):
        """The step's static proposer settings: NgramConfig, DraftConfig or None."""
        if spec is None:
            return None
        if spec.method == "draft":
            return DraftConfig(spec.num_speculative_tokens, spec.draft.config)
        return NgramConfig(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)

    @property
    def token_budget(self) -> int:
        return self.token_buckets[-1]

    def segment_width(self, segment: Segment) -> int:
        """Tokens `segment` takes in a step: its prompt chunk, or 1 + k."""
        return self.width if segment.decode else len(segment.tokens)

    def chunk_cost(self, start: int, length: int) -> float:
        """`serving.chunking.chunk_cost` of this runner's model."""
        return chunking.chunk_cost(self.config, start, length)

    # --- dispatch ------------------------------------------------------------------------

    def admit(self, admissions: Sequence[Admission]) -> None:
        """Dispatch the rows of newly admitted requests, `admit_rows` per call
        (padded: one program whatever the count)."""
        for i in range(0, len(admissions), self.admit_rows):
            self._admit(admissions[i:i + self.admit_rows])

    def _admit(self, admissions: Sequence[Admission]) -> None:
        a = self.admit_rows
        pad = [admissions[0].request] * (a - len(admissions))
        inputs = row_inputs([x.request for x in admissions] + pad, self.config.vocab_size,
                            self.max_seq_len, [x.generated for x in admissions] + [()] * len(pad),
                            self._grammar_states(admissions) + [-1] * len(pad))
        slots = np.full(a, self.max_num_seqs, np.int32)
        slots[:len(admissions)] = [x.slot for x in admissions]
        lengths = np.zeros(a, np.int32)
        lengths[:len(admissions)] = [x.cached for x in admissions]
        self.cache, self.rows = self.programs(engine_step.admit, self.cache, self.rows,
                                              to_device(slots), inputs, to_device(lengths))

    def step_shape(self, num_tokens: int) -> tuple[int, int]:
        """(T, R): the token bucket of a step of `num_tokens` tokens and its segments.

        Raises:
          ValueError: more tokens than `token_budget`.
        """
        t = bucket_for(num_tokens, self.warm.ready_buckets or self.token_buckets)
        return t, min(t, self.max_num_seqs)

    @property
    def admit_rows(self) -> int:
        """Rows one admission call writes (ADMIT_ROWS, at most the slots)."""
        return min(ADMIT_ROWS, self.max_num_seqs)

    def host_batch(self, segments: Sequence[Segment], block_tables: np.ndarray) -> engine_step.StepBatch:
        """The `StepBatch` of `segments` (at most one per slot), padded to its bucket."""
        t, r = self.step_shape(sum(self.segment_width(s) for s in segments))
        tokens, token_seg = np.zeros(t, np.int32), np.full(t, r, np.int32)
        slot, start, length = (np.full(r, self.max_num_seqs, np.int32), np.zeros(r, np.int32),
                               np.zeros(r, np.int32))
        decode, sample, drafts = np.zeros(r, bool), np.zeros(r, bool), np.zeros(r, np.int32)
        pos = 0
        for i, s in enumerate(segments):
            n = self.segment_width(s)
            tokens[pos:pos + len(s.tokens)] = s.tokens
            token_seg[pos:pos + n] = i
            slot[i], start[i], length[i] = s.slot, pos, n
            decode[i], sample[i], drafts[i] = s.decode, s.sample, s.max_drafts
            pos += n
        return engine_step.StepBatch(*map(to_device, (tokens, token_seg, slot, start, length, decode,
                                                        sample, drafts, block_tables)))

    def step(self, segments: Sequence[Segment], block_tables: np.ndarray,
             num_logprobs: int = -1) -> Dispatched:
        """Dispatch one step (not waiting for it); outputs [1, R, W] per segment order."""
        batch = self.host_batch(segments, block_tables)
        self.cache, self.rows, out = self.programs(
            engine_step.step, self.params, self.cache, self.rows, batch, self.stop,
            self.draft_params, config=self.config, backend=self.backend, num_logprobs=num_logprobs, spec=self.spec)
        self.decode_steps += any(s.decode for s in segments)
        return Dispatched(out, 1)

    def decode(self, slots: Sequence[int], block_tables: np.ndarray, num_steps: int,
               max_drafts: Optional[Sequence[int]] = None, num_logprobs: int = -1,
               rows: int = 0) -> Dispatched:
        """Dispatch `num_steps` decoding steps of `slots` in one scan over R =
        `loop_rows(len(slots), max_num_seqs, rows)` rows. Outputs
        [num_steps, R, W], rows in `slots` order.

        Raises:
          ValueError: more slots or `rows` than max_num_seqs.
        """
        if max(len(slots), rows) > self.max_num_seqs:
            raise ValueError(f"a decode loop of {len(slots)} slots cannot run at {rows} rows "
                             f"(max_num_seqs {self.max_num_seqs})")
        r = loop_rows(len(slots), self.max_num_seqs, rows)
        padded = np.full(r, self.max_num_seqs, np.int32)
        padded[:len(slots)] = slots
        caps = np.zeros(r, np.int32)
        caps[:len(slots)] = max_drafts if max_drafts is not None else 0
        self.cache, self.rows, out = self.programs(
            engine_step.decode_loop, self.params, self.cache, self.rows, to_device(padded),
            to_device(block_tables), to_device(caps), self.stop, self.draft_params,
            config=self.config,
            backend=self.backend, num_steps=num_steps, num_logprobs=num_logprobs, spec=self.spec)
        self.decode_steps += num_steps
        return Dispatched(out, num_steps)

    def read_pages(self, pages: Sequence[int], from_repeat: int = 1):
        """The contents of `pages` (page id num_pages: zeros) in every layer,
        every field, with KV heads stored `from_repeat` times de-duplicated
        (`cache.paged.export_pages`; dispatched, not waited for)."""
        return self.programs(paged.export_pages, self.cache, to_device(pages, np.int32),
                             from_repeat=from_repeat)

    def write_pages(self, pages: Sequence[int], data, to_repeat: int = 1) -> None:
        """Store `data` (`read_pages` of another runner of the same model and
        page size) in `pages` (num_pages: dropped), each KV head stored
        `to_repeat` times (`cache.paged.import_pages`).

        Raises:
          ValueError: data that does not fit the pool (nothing is written).
        """
        self.cache = self.programs(paged.import_pages, self.cache,
                                   to_device(pages, np.int32), data, to_repeat=to_repeat)

    def fetch(self, dispatched: Dispatched) -> StepOutput:
        """Device outputs -> numpy (blocks until computed), with a leading
        steps axis: token [steps, R, W] (NO_TOKEN where a row emitted fewer
        than W), done [steps, R], log-probs [steps, R, W(, n)], drafted /
        accepted [steps, R]."""
        host = jax.device_get(dispatched.out)
        if dispatched.steps == 1:
            host = StepOutput(*(None if x is None else x[None] for x in host))
        return host

    def warmup(self, num_logprobs: Sequence[int] = (-1,), background: bool = False,
               log=lambda msg: None) -> int:
        """Compile this runner's `compile_plan` ahead of time (`WarmUp.warmup`
        of `warm`, which then holds the ready buckets and the background
        compiles). Returns the programs compiled."""
        return self.warm.warmup(num_logprobs, background, log)

    def stop_compiling(self) -> None:
        """Compile nothing more in the background (the warm-up's other token
        buckets, the grammar tables' growth): each stops after the program
        under way, not waited for. For a runner whose engine has stopped."""
        self.warm.stop_compiling(wait=False)
        if self.growth is not None:
            self.growth.stop()

    # --- the compile plan ----------------------------------------------------------------

    def compile_plan(self, num_logprobs: Sequence[int] = (-1,), stop=None) -> list[tuple]:
        """Every program serving runs, as (function, abstract args, static args):
        the step for each token bucket (largest first), and admission. Warm-up
        compiles exactly these; dispatch compiles nothing else except other
        log-prob counts, decode loops (`decode_plan`) and the step for larger
        grammar tables (`grammar_rows`). `stop`: the stop rule to compile
        the step for (default the runner's)."""
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        abstract = lambda tree: jax.tree_util.tree_map(shape, tree)
        cache, rows = self._cache_shape, abstract(self.rows)
        tables = jax.ShapeDtypeStruct((self.max_num_seqs, self.pages_per_seq), jnp.int32)
        plan = []
        for t in reversed(self.token_buckets):
            segments = [Segment(0, (0,) * t)]
            batch = abstract(self.host_batch(segments, np.zeros(tables.shape, np.int32)))
            for n in num_logprobs:
                plan.append((engine_step.step,
                             (self._params_shape, cache, rows, batch, stop or self.stop,
                              self.draft_params),
                             dict(config=self.config, backend=self.backend, num_logprobs=n,
                                  spec=self.spec)))
        a = self.admit_rows
        inputs = abstract(row_inputs([Request((0,), max_new_tokens=1)] * a, self.config.vocab_size,
                                     self.max_seq_len))
        one = jax.ShapeDtypeStruct((a,), jnp.int32)
        plan.append((engine_step.admit, (cache, rows, one, inputs, one), {}))
        return plan

    def decode_plan(self, rows: int, num_steps: int, num_logprobs: int = -1) -> tuple:
        """The decode loop of `rows` (a power of two) slots and `num_steps` steps, as
        (function, abstract args, static args)."""
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        abstract = lambda tree: jax.tree_util.tree_map(shape, tree)
        one = jax.ShapeDtypeStruct((rows,), jnp.int32)
        tables = jax.ShapeDtypeStruct((self.max_num_seqs, self.pages_per_seq), jnp.int32)
        return (engine_step.decode_loop,
                (self._params_shape, self._cache_shape, abstract(self.rows), one, tables, one, self.stop,
                 self.draft_params),
                dict(config=self.config, backend=self.backend, num_steps=num_steps,
                     num_logprobs=num_logprobs, spec=self.spec))

    def has_decode_loop(self, rows: int, num_steps: int, num_logprobs: int = -1) -> bool:
        """Whether the decode loop for `rows` slots is compiled (dispatch uses
        a loop only once it is: compiling one never delays a request)."""
        fn, args, static = self.decode_plan(rows, num_steps, num_logprobs)
        return self.programs.has(fn, *args, **static)


def _abstract(x):
    """A param leaf's `jax.ShapeDtypeStruct`, with its sharding when it is a jax.Array."""
    sharding = x.sharding if isinstance(x, jax.Array) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


__all__ = ["Admission", "Dispatched", "LOGPROB_BUCKETS", "ModelRunner", "NO_TOKEN", "Segment",
           "logprob_bucket", "loop_rows"]
