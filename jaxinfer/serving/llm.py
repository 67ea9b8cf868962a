"""The host API: load a model once, then generate, stream or score.

    llm = LLM.load("smollm2-135m-instruct")
    [c] = llm.generate(["What is the capital of France?"], chat=True, max_new_tokens=32)
    for piece in llm.stream("Once upon a time", max_new_tokens=64): print(piece, end="")

All input checks happen here, on the host, before any device work: JAX clamps
out-of-range indices and slice starts silently, so lengths and ids are checked
before they reach a compiled program.

`generate` and `stream` run on the serving engine: a `Scheduler` (continuous
batching over `max_num_seqs` slots, chunked prefill) driving a `ModelRunner`,
on the calling thread. Compiled shapes: `serving.runner`, `serving.buckets`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Generator, Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxinfer import models
from jaxinfer.serving.buckets import Buckets, batch_bucket
from jaxinfer.serving.control import Controls
from jaxinfer.serving import update as weights_update
from jaxinfer.serving.deterministic import check_deterministic
from jaxinfer.cache.layouts import pool_pages, resolve_layout
from jaxinfer.engine.ragged import choose_backend, serving_dtypes
from jaxinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxinfer.serving.loading import load_model, speculative_config
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.progress import Progress
from jaxinfer.sampling.grammar import GrammarCompiler
from jaxinfer.serving import live, offline, prompts as prompts_module
from jaxinfer.serving.offline import Completion
from jaxinfer.serving.prompts import PromptLogprob
from jaxinfer.serving.request import MAX_LOGPROBS, Request, RequestOutput
from jaxinfer.serving.rows import TokenRules
from jaxinfer.serving.runner import ModelRunner
from jaxinfer.speculative import SpecConfig, as_spec_config
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.settings import split_settings
from jaxinfer.serving.stats import RunStats
from jaxinfer.tokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer.chat import template_hook, with_chat_template

Prompt = Union[str, Sequence[int], Sequence[dict]]


class LLM:
    """A loaded model: config, params, tokenizer and compiled programs.

    Args:
      config: ModelConfig.
      params: params pytree (jax arrays), as loaded or prepared; kept
        prepared by the model family (`models.family(config.arch).prepare`,
        `weights.prepare.prepare_params` for the built-in families), the
        layout the compiled phases run on.
      tokenizer: a `jaxinfer.tokenizer.tokenizer.Tokenizer`, or None to accept token-id
        prompts only.
      cache_config: the KV cache (`config.CacheConfig`: max_seq_len in [2,
        the model's context length], kv_cache_dtype, page pool, prefix
        caching, layout of `cache.LAYOUTS`); None: the defaults. Its dtype
        None becomes the params' dtype; prefix_caching None, what the
        layout supports.
      scheduler_config: slots, token budget, chunk sizes, policy
        (`config.SchedulerConfig`); None: the defaults. `generate` decodes
        min(len(prompts), max_num_seqs) rows at once (a batch bucket).
      speculative: a `speculative.SpecConfig` for speculative decoding, the
        string "ngram" (`SpecConfig("ngram")`), or None.
      stop_token_ids: extra ids that end a request (the tokenizer's EOS set is
        always included).
      settings: keyword settings over the two configs (max_seq_len=...,
        max_num_seqs=..., layout=...), and the LLM's own (deterministic,
        min_prompt_bucket, grammar_cache_bytes, chat_template: a Jinja file
        replacing the template of a copy of the tokenizer); each is
        described in `serving.settings`.
    Raises:
      ValueError: max_seq_len outside [2, the model's context length], a
        config field out of range (naming it), no model family registered
        as config.arch, a layout that does not fit the model or refuses
        prefix_caching=True (`cache.resolve_layout`), deterministic=True
        where it cannot hold (`check_deterministic`), speculative "draft"
        or another string (`speculative.as_spec_config`); all before any
        work.
      TypeError: speculative neither a SpecConfig, a string nor None; an
        unknown keyword setting.
    """

    def __init__(self, config: ModelConfig, params: dict, tokenizer=None, *,
                 cache_config: Optional[CacheConfig] = None,
                 scheduler_config: Optional[SchedulerConfig] = None,
                 speculative: Union[SpecConfig, str, None] = None,
                 stop_token_ids: Sequence[int] = (), **settings):
        cache, sched, own = split_settings(cache_config, scheduler_config, settings)
        family = models.family(config.arch)      # an unregistered arch fails before params are read
        if not 2 <= cache.max_seq_len <= config.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [2, {config.max_position_embeddings}] (the "
                             f"model's context length), got {cache.max_seq_len}")
        self.layout, cache = resolve_layout(cache, config)
        speculative = as_spec_config(speculative)
        self.cache_dtype = _params_dtype(params)
        self.cache_config = cache.replace(dtype=cache.dtype or jnp.dtype(self.cache_dtype).name)
        self.scheduler_config = sched
        self.step_tokens = sched.max_num_batched_tokens + (
            speculative.num_speculative_tokens if speculative else 0)
        self.ring_pages = self.layout.ring_pages(config, cache, self.step_tokens)   # R per slot
        self.config = config = config.replace(deterministic=bool(own["deterministic"]))
        self.params = family.prepare(params, config)
        if own["chat_template"] is not None:
            tokenizer = with_chat_template(tokenizer, own["chat_template"])
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size,
                                        cache_bytes=own["grammar_cache_bytes"]) if tokenizer else None
        self.max_seq_len = cache.max_seq_len
        self.buckets = Buckets.create(self.max_seq_len, own["min_prompt_bucket"])
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids)) if tokenizer is not None else ()
        self.stop_token_ids = tuple(sorted(set(self.eos_token_ids) | set(stop_token_ids)))
        self.speculative = speculative
        self.backend = choose_backend(self.cache_dtype)
        if own["deterministic"]:
            check_deterministic(config, self.params, self.backend,
                                cache.kv_cache_dtype or self.cache_dtype, sched.max_num_batched_tokens)
        self.programs = ProgramCache()
        self.last_stats = RunStats()
        self._scheduler: Optional[Scheduler] = None
        # Live weights (`update_weights`), pausing and sleeping (`serving.control`): the
        # runners and schedulers built from this LLM, swapped, paused and freed together.
        self.controls = Controls()
        self._runners: weakref.WeakSet = weakref.WeakSet()
        self._schedulers: weakref.WeakSet = weakref.WeakSet()
        self._admin = threading.RLock()
        self._params_shape = weights_update.abstract(self.params)
        self.weights_format, self.activations = weights_update.weights_format(self.params)
        self._paused_by_sleep = False
        # raw params -> serving params for `update_weights` where the family's `prepare`
        # does not make them (a tensor-parallel LLM's per-shard layout); None: it does.
        self.prepare_update = None

    # Read-only views of the two configs' fields most callers want.
    max_num_seqs = property(lambda self: self.scheduler_config.max_num_seqs)
    decode_chunk = property(lambda self: self.scheduler_config.decode_chunk)
    prefill_chunk_size = property(lambda self: self.scheduler_config.prefill_chunk_size)
    token_budget = property(lambda self: self.scheduler_config.max_num_batched_tokens)
    page_size = property(lambda self: self.cache_config.page_size)

    @classmethod
    def load(cls, source: str, *, dtype: str = "float32", weights: str = "float32",
             activations: str = "float32", progress=None, load_cache: Optional[bool] = None,
             **kwargs) -> "LLM":
        """Load a named model, a `.gguf` file or a Hugging Face folder.

        Args:
          source: e.g. "smollm2-135m-instruct", "/path/model.gguf", "/path/hf_folder",
            or a Python factory "python:path/to/file.py:function" (`serving.loading`).
          dtype: parameter and KV-cache dtype name ("float32", "bfloat16", "float16");
            where the C++ CPU kernels run, "bfloat16" serves float32 activations
            over bfloat16 weights (`engine.ragged.serving_dtypes`, one logged line).
          weights: matmul weight format, one of `weights.prepare.WEIGHT_FORMATS`.
          activations: what 4-bit matmuls multiply, "float32" or "int8" (as
            `config.GenerationConfig.activations`).
          progress: a `jaxinfer.progress.Progress`, or True / False; None shows
            download/load bars and compile lines when stderr is a terminal.
          load_cache: keep prepared params in the load cache
            (`jaxinfer.checkpoint.prepared`); None: unless `JAXINFER_LOAD_CACHE=0`.
          kwargs: passed to `LLM(...)` (cache_config, scheduler_config,
            speculative, stop_token_ids, and keyword settings: max_seq_len,
            max_num_seqs, ...; `serving.settings`).
        Raises:
          ModelSourceError: the model file cannot be found or fetched.
          CheckpointError: a tensor is missing or has the wrong shape.
          RuntimeError: activations "int8" without the AVX512-VNNI or AVX2 kernel.
        """
        progress = Progress.resolve(progress)
        dtype, weights = serving_dtypes(jnp.dtype(dtype).name, weights)
        template = kwargs.pop("chat_template", None)
        before = template_hook(template) if template is not None else None
        config, params, tokenizer = load_model(source, dtype=jnp.dtype(dtype), prepared=True,
                                               cache=load_cache, progress=progress, weights=weights,
                                               activations=activations, before_weights=before)
        kwargs.setdefault("max_seq_len", min(config.max_position_embeddings, 2048))
        llm = cls(config, params, tokenizer, **kwargs)
        llm.programs.progress = progress
        llm.weights_format, llm.activations = weights, activations
        return llm

    @classmethod
    def from_config(cls, cfg, *, progress=None, before_weights=None) -> "LLM":
        """The LLM a `GenerationConfig` describes: the model (dtype, weights),
        the KV cache, the serving engine's sizes and speculative decoding
        (loading the draft model). `jaxinfer generate`, `serve` and `bench`
        build theirs here.

        Args:
          cfg: a `config.GenerationConfig`.
          progress: as `LLM.load`.
          before_weights: called with the tokenizer before any weight is read
            (e.g. to check prompt lengths; see `serving.loading.load_model`).
        Raises:
          as `LLM.load`, and ValueError from `loading.speculative_config`.
        """
        progress = Progress.resolve(progress)
        resolve_layout(cfg.cache)           # a layout's refusal comes before any loading
        dtype, weights = serving_dtypes(cfg.dtype, cfg.weights)
        if cfg.chat_template is not None:   # a bad file fails before any download or weight read
            before_weights = template_hook(cfg.chat_template, before_weights)
        config, params, tokenizer = load_model(
            cfg.model, jnp.dtype(dtype), prepared=True, progress=progress, weights=weights,
            activations=cfg.activations, before_weights=before_weights)
        draft_weights = serving_dtypes(cfg.dtype, cfg.draft_weights, notice=False)[1]
        spec = speculative_config(cfg.speculative, cfg.num_speculative_tokens, cfg.ngram_min,
                                        cfg.ngram_max, cfg.draft_model, config, tokenizer, dtype,
                                        draft_weights)
        llm = cls(config, params, tokenizer, cache_config=cfg.cache, scheduler_config=cfg.scheduler,
                  speculative=spec, deterministic=cfg.deterministic,
                  grammar_cache_bytes=cfg.grammar_cache_bytes)
        llm.programs.progress, llm.programs.max_programs = progress, cfg.max_programs
        llm.weights_format, llm.activations = weights, cfg.activations
        return llm

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids for a prompt: text (raw, or a user turn with chat=True),
        chat messages [{"role", "content"}, ...], or ids given directly.

        Raises:
          ValueError: an empty prompt for a model with no BOS token, ids out of
            the vocabulary, or text/chat without a tokenizer or chat template.
        """
        if isinstance(prompt, str):
            ids = self._tokenize(prompt, chat)
        elif len(prompt) and isinstance(prompt[0], dict):
            ids = self._tokenize(list(prompt), True)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("empty prompt: this model adds no BOS token, so a prompt needs at "
                             "least one token")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _tokenize(self, prompt, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: pass token ids")
        return self.tokenizer.encode_prompt(prompt, chat)

    # --- the serving engine ----------------------------------------------------------------

    @property
    def tokens(self) -> TokenRules:
        """The stop rule and vocabulary limits every row shares (`rows.TokenRules`)."""
        return TokenRules(self.stop_token_ids, self.eos_token_ids,
                          self.tokenizer.vocab_size if self.tokenizer else 0, self.grammars)

    def runner(self, max_num_seqs: int, scheduler_config: Optional[SchedulerConfig] = None
               ) -> ModelRunner:
        """A `ModelRunner` over `max_num_seqs` slots (of `scheduler_config`,
        default this LLM's) and a page pool of `pool_pages(max_num_seqs)`
        pages, compiling through this LLM's `programs`."""
        sched = (scheduler_config or self.scheduler_config).replace(max_num_seqs=max_num_seqs)
        runner = ModelRunner(self.config, self.params, self.pool_config(sched), sched,
                             tokens=self.tokens, speculative=self.speculative,
                             programs=self.programs, backend=self.backend)
        runner.controls = self.controls         # an EngineThread over it pauses with this LLM
        self._runners.add(runner)
        return runner

    def pool_config(self, scheduler_config: SchedulerConfig) -> CacheConfig:
        """This LLM's `cache_config` with the pool's pages decided for a
        runner of `scheduler_config`'s slots (`pool_pages`)."""
        return self.cache_config.replace(
            num_pages=self.pool_pages(scheduler_config.max_num_seqs, scheduler_config),
            kv_cache_memory=None)

    def pool_pages(self, max_num_seqs: int, scheduler_config: Optional[SchedulerConfig] = None) -> int:
        """Pages in the KV page pool of a runner of `max_num_seqs` slots
        (`cache.layouts.pool_pages`: num_pages, else what kv_cache_memory
        holds, else max_num_seqs full sequences within a default budget).

        Raises:
          ValueError: kv_cache_memory does not hold one page.
        """
        sched = scheduler_config or self.scheduler_config
        step_tokens = sched.max_num_batched_tokens + (
            self.speculative.num_speculative_tokens if self.speculative else 0)
        return pool_pages(self.layout, self.config, self.cache_config, max_num_seqs, step_tokens)

    def scheduler(self, max_num_seqs: Optional[int] = None, **kwargs) -> Scheduler:
        """A `Scheduler` over a new runner of `max_num_seqs` slots (default
        this LLM's), detokenizing with this LLM's tokenizer, timed on
        `programs.clock` (compile time excluded). kwargs: `SchedulerConfig`
        fields over this LLM's (policy, prefill_chunk_size, decode_chunk,
        long_prefill_chunk_size, max_waiting_requests), and `Scheduler`'s
        compile_loops and isolate_faults.

        Raises:
          TypeError: an unknown keyword; ValueError: a field out of range.
        """
        own = {k: kwargs.pop(k) for k in ("compile_loops", "isolate_faults") if k in kwargs}
        sched = self.scheduler_config.replace(max_num_seqs=max_num_seqs or self.max_num_seqs,
                                              **kwargs)
        runner = self.runner(sched.max_num_seqs, sched)
        tok = self.tokenizer
        scheduler = Scheduler(runner, sched, runner.cache_config,
                              detokenizer_factory=(lambda: IncrementalDetokenizer(tok)) if tok else None,
                              tokens=self.tokens, clock=self.programs.clock, **own)
        self._schedulers.add(scheduler)
        return scheduler

    # --- generation ----------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling_params=None, *, max_new_tokens=64,
                 chat: bool = False, stop: Sequence[str] = (), logprobs: Optional[int] = None,
                 min_tokens=0, ignore_eos=False) -> list[Completion]:
        """Generate completions for a list of prompts.

        Args:
          prompts: texts, chat-message lists or token-id lists.
          sampling_params: one `SamplingParams` for all prompts, a list (one
            per prompt), or None for the default, `SamplingParams()` (greedy).
          max_new_tokens: int or per-prompt list, >= 1.
          chat: render text prompts as a user turn with the chat template.
          stop: stop strings (the matched text is excluded from the output).
          logprobs: None, or the number of top alternatives (0-20) per token.
          min_tokens: int or per-prompt list: stop tokens and strings are
            ignored until this many tokens were generated.
          ignore_eos: bool or per-prompt list: EOS does not end the request.
        Returns:
          One Completion per prompt, in order. Timing is in `self.last_stats`.
        Raises:
          ValueError / TypeError: bad prompts or settings, or prompt length +
            max_new_tokens > max_seq_len, checked before any work starts.
        """
        requests = self.requests(prompts, sampling_params, max_new_tokens=max_new_tokens, chat=chat,
                                 stop=stop, logprobs=logprobs, min_tokens=min_tokens,
                                 ignore_eos=ignore_eos)
        run = self._run(requests)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: Prompt, sampling_params=None, *, max_new_tokens=64, chat: bool = False,
               stop: Sequence[str] = (), min_tokens: int = 0, ignore_eos: bool = False
               ) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece.

        The concatenated pieces equal `generate(...)[0].text` for the same
        arguments and seed. Text that could still be the start of a stop
        string, or an incomplete UTF-8 character, is held back.
        """
        requests = self.requests([prompt], sampling_params, max_new_tokens=max_new_tokens, chat=chat,
                                 stop=stop, min_tokens=min_tokens, ignore_eos=ignore_eos)
        for _, event in self._run(requests, stream=True):
            if event.text:
                yield event.text

    def requests(self, prompts: Sequence[Prompt], sampling_params=None, *, max_new_tokens=64,
                 chat: bool = False, stop: Sequence[str] = (), logprobs: Optional[int] = None,
                 min_tokens=0, ignore_eos=False) -> list[Request]:
        """Validated `Request`s for prompts and settings (see `generate`).

        Raises:
          ValueError / TypeError: as `generate`, naming the row.
        """
        return offline.requests(self, prompts, sampling_params, max_new_tokens, chat, stop, logprobs,
                                min_tokens, ignore_eos)

    def _offline_scheduler(self, max_num_seqs: int) -> Scheduler:
        """The scheduler `generate` and `stream` run on: kept while calls need
        the same number of slots, so later calls reuse its compiled programs'
        buffers and its prefix cache (pages of earlier prompts). A scheduler
        left with work (a `stream` its caller stopped reading) is replaced."""
        kept = self._scheduler
        if kept is None or kept.runner.max_num_seqs != max_num_seqs or kept.has_unfinished():
            self._scheduler = None      # the old pools go before the new ones are allocated
            self._scheduler = self.scheduler(     # the serve-only bounds stay off here
                max_num_seqs, long_prefill_chunk_size=None, max_waiting_requests=None,
                compile_loops=True, isolate_faults=False)
        return self._scheduler

    def _run(self, requests: Sequence[Request], stream: bool = False
             ) -> Generator[tuple[int, RequestOutput], None, list[Completion]]:
        """Run requests to the end on the scheduler; yields (index, event) and
        returns the Completions (in order). Sets `last_stats`."""
        self.controls.check_awake(self.params is None)
        with self.controls.run():
            self.controls.check_awake(self.params is None)     # it may have slept meanwhile
            scheduler = self._offline_scheduler(batch_bucket(min(len(requests), self.max_num_seqs)))
            return (yield from offline.run(self, scheduler, requests, stream))

    # --- scoring -------------------------------------------------------------------------

    def score(self, prompts: Sequence[Prompt], continuations: Sequence[Union[str, Sequence[int]]],
              *, chat: bool = False) -> list[float]:
        """Log-likelihood of each continuation given its prompt (research use).

        One step of the forward returns every position's log-probs
        (`engine.phases.token_logprobs`); the continuation is scored by teacher forcing.

        Args:
          prompts: texts (BOS added as the model does), chat messages, or ids.
          continuations: texts (tokenized without special tokens) or ids, one
            per prompt, each at least one token.
        Returns:
          Per row, sum over continuation tokens of log p(token | prefix), in nats.
        Raises:
          ValueError: mismatched lengths, an empty continuation, ids out of the
            vocabulary, or prompt + continuation longer than max_seq_len.
        """
        return prompts_module.score(self, prompts, continuations, chat)

    def prompt_logprobs(self, prompts: Sequence[Prompt], top_n: int = 0, *, chat: bool = False
                        ) -> list[list[Optional[PromptLogprob]]]:
        """Every prompt token's log-prob, rank and the top_n most likely tokens
        at its position, from the forward `score` runs (the same program but
        for the top n: `engine.phases.prompt_logprobs`; `serving.prompts`);
        the server's `echo` and `prompt_logprobs`.

        Args:
          prompts: as `score`'s (texts, chat messages, ids).
          top_n: alternatives per position, 0 to MAX_LOGPROBS.
        Returns:
          Per prompt, one entry per token: None for the first (nothing before
          it predicts it), then a `PromptLogprob`.
        Raises:
          ValueError: top_n out of range, an empty prompt, ids out of the
            vocabulary, or a prompt longer than max_seq_len.
        """
        if not 0 <= top_n <= MAX_LOGPROBS:
            raise ValueError(f"top_n must be in [0, {MAX_LOGPROBS}], got {top_n}")
        self.controls.check_awake(self.params is None)
        rows = [self.encode_prompt(p, chat) for p in prompts]
        for row, p in enumerate(rows):
            if len(p) > self.max_seq_len:
                raise ValueError(f"row {row}: prompt of {len(p)} tokens exceeds max_seq_len "
                                 f"{self.max_seq_len}")
        return prompts_module.prompt_logprobs(self, rows, top_n)

    # --- live weights, pausing and sleeping (serving.control, serving.update) --------------

    def update_weights(self, params) -> None:
        """Serve new weights from memory: no reload, no new compile, the prefix
        cache invalidated, requests in flight finished on the old weights
        first (`serving.live.update_weights` has the layouts taken and what
        is prepared and dropped). Raises ValueError naming the first leaf
        whose tree, shape or dtype does not match; nothing has changed then."""
        live.update_weights(self, params)

    def pause(self, mode: str = "wait", timeout_s: Optional[float] = None) -> None:
        """Stop starting new requests, on every engine of this LLM (`generate`
        / `stream` callers and server engine threads): mode "wait" lets the
        requests in flight finish, "abort" ends them with finish_reason
        "abort". Returns once nothing runs; new requests wait for `resume`.

        Raises:
          ValueError: an unknown mode. TimeoutError: requests still ran after timeout_s.
        """
        self.controls.pause(mode, timeout_s)

    def resume(self) -> None:
        """Start the requests that waited during `pause` (a no-op when not paused)."""
        self.controls.resume()

    @property
    def is_paused(self) -> bool:
        return self.controls.paused

    @property
    def is_sleeping(self) -> bool:
        return bool(self.controls.sleep_level)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt page of every engine of this LLM (after
        in-flight requests finish). Returns the cached pages freed."""
        return live.reset_prefix_cache(self)

    def sleep(self, level: int = 1) -> None:
        """Free device memory while the LLM is not used: level 1 the KV pools,
        level 2 the weights too (`serving.live.sleep`: what is kept and
        freed). Raises ValueError: level not 1 or 2."""
        live.sleep(self, level)

    def wake_up(self) -> None:
        """Allocate the KV pools `sleep` freed again (the same shapes: nothing
        compiles) and resume serving (`serving.live.wake_up`)."""
        live.wake_up(self)


def _params_dtype(params: dict):
    """The activation / KV-cache dtype of a params pytree: its final norm's
    (matmul weights may be quantized codes), else its first float leaf's."""
    if "norm" in params:
        return params["norm"].dtype
    return next(w.dtype for w in jax.tree.leaves(params) if jnp.issubdtype(w.dtype, jnp.floating))
