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

import dataclasses
from typing import Generator, Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import phases as engine
from jaxinfer import models, sampling
from jaxinfer.serving.buckets import Buckets, batch_bucket
from jaxinfer.serving.deterministic import check_deterministic
from jaxinfer.cache.kv import DEFAULT_KV_CACHE_MEMORY, KV_CACHE_DTYPES, init_cache
from jaxinfer.cache.paged_ring import pool_costs, ring_pages_for
from jaxinfer.config.generation import check_ring
from jaxinfer.engine.ragged import choose_backend, serving_dtypes
from jaxinfer.config import ModelConfig
from jaxinfer.serving.loading import load_model, speculative_config
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.progress import Progress
from jaxinfer.sampling.grammar import GrammarCompiler
from jaxinfer.serving.request import Request, RequestOutput, per_row
from jaxinfer.serving.rows import pad_rows
from jaxinfer.serving.runner import ModelRunner
from jaxinfer.speculative import SpecConfig, as_spec_config
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.stats import RunStats
from jaxinfer.tokenizer import IncrementalDetokenizer

Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      prompt_token_ids: the prompt as fed to the model.
      token_ids: generated ids, including a final stop token when one ended it.
      text: detokenized generated text, stop token and stop string excluded.
      finish_reason: "stop" (stop token or stop string) or "length".
      logprobs: per generated token (token_id, logprob, [(alt_id, alt_logprob), ...])
        when requested, else None. Log-probs are of the model's raw distribution.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: Optional[list] = None


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
      max_seq_len: KV-cache capacity per request, tokens (prompt + generated).
      decode_chunk: decoding steps per dispatch in steady state (one
        `lax.scan`) when no request streams and none waits (see
        `jaxinfer.serving.scheduler`).
      max_num_seqs: the most requests one `generate` call decodes at once
        (its slots: the batch bucket of min(len(prompts), max_num_seqs)).
      prefill_chunk_size: prompt tokens per step while requests decode (the
        bound on a running stream's gap between tokens); None: the whole
        token budget.
      min_prompt_bucket: smallest prompt-length bucket (`score`).
      min_kv_bucket: smallest KV-cache bucket of `score`'s dense cache, tokens.
      stop_token_ids: extra ids that end a request (the tokenizer's EOS set is
        always included).
      speculative: a `speculative.SpecConfig` for speculative decoding, the
        string "ngram" (`SpecConfig("ngram")`), or None.
      kv_cache_dtype: None (the params' dtype) or one of `cache.KV_CACHE_DTYPES`
        ("int8": a quarter of float32's K/V bytes, plus a scale per token per kv head).
      page_size: tokens per KV page (PagedAttention: every layer's K/V in one
        page pool with a block table per request; `cache.paged`).
      num_pages: pages in the pool; None derives it from kv_cache_memory.
      kv_cache_memory: the KV page pool's budget in bytes; None: what
        max_num_seqs slots of max_seq_len tokens need, at most
        DEFAULT_KV_CACHE_MEMORY.
      prefix_caching: requests share the cached pages of equal prompt
        prefixes; None: on, unless sliding_window_ring.
      max_num_batched_tokens: the most tokens one serving step runs (its
        token budget, the largest compiled token bucket).
      sliding_window_ring: sliding-window layers keep a fixed ring of pages
        per slot (`cache.paged_ring`): their K/V memory no longer grows with
        the context; prefix caching is off and page transfers are refused.
      deterministic: a row's tokens and log-probs bitwise independent of its
        batch, neighbours, chunking and cache hits (`serving.deterministic`).
    Raises:
      ValueError: max_seq_len outside [2, the model's context length], a
        size below 1, both num_pages and kv_cache_memory given, no model
        family registered as config.arch, or sliding_window_ring on a model
        without sliding layers or with prefix_caching=True, or
        deterministic=True where it cannot hold (`check_deterministic`),
        speculative "draft" or another string (`speculative.as_spec_config`).
      TypeError: speculative neither a SpecConfig, a string nor None.
    """

    def __init__(self, config: ModelConfig, params: dict, tokenizer=None, *, max_seq_len: int = 2048,
                 decode_chunk: int = 16, max_num_seqs: int = 256,
                 prefill_chunk_size: Optional[int] = 512, min_prompt_bucket: int = 16,
                 min_kv_bucket: int = 256, stop_token_ids: Sequence[int] = (),
                 speculative: Union[SpecConfig, str, None] = None, kv_cache_dtype: Optional[str] = None,
                 page_size: int = 16, num_pages: Optional[int] = None,
                 kv_cache_memory: Optional[int] = None, prefix_caching: Optional[bool] = None,
                 max_num_batched_tokens: int = 512, sliding_window_ring: bool = False,
                 deterministic: bool = False):
        if not 2 <= max_seq_len <= config.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [2, {config.max_position_embeddings}] (the "
                             f"model's context length), got {max_seq_len}")
        for name, value in (("decode_chunk", decode_chunk), ("max_num_seqs", max_num_seqs),
                            ("prefill_chunk_size", prefill_chunk_size or 1),
                            ("page_size", page_size), ("num_pages", num_pages or 1),
                            ("kv_cache_memory", kv_cache_memory or 1),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_pages is not None and kv_cache_memory is not None:
            raise ValueError("give num_pages or kv_cache_memory, not both")
        check_ring(prefix_caching, sliding_window_ring)
        speculative = as_spec_config(speculative)
        step_tokens = max_num_batched_tokens + (speculative.num_speculative_tokens if speculative else 0)
        self.ring_pages = (ring_pages_for(config, page_size, step_tokens, max_seq_len)
                           if sliding_window_ring else 0)      # R per slot (`cache.paged_ring`)
        self.config = config = config.replace(deterministic=bool(deterministic))
        self.params = models.family(config.arch).prepare(params, config)
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, config.vocab_size) if tokenizer else None
        self.max_seq_len = int(max_seq_len)
        self.decode_chunk = int(decode_chunk)
        self.max_num_seqs = int(max_num_seqs)
        self.prefill_chunk_size = prefill_chunk_size
        self.buckets = Buckets.create(self.max_seq_len, min_prompt_bucket, min_kv_bucket)
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids)) if tokenizer is not None else ()
        self.stop_token_ids = tuple(sorted(set(self.eos_token_ids) | set(stop_token_ids)))
        self.cache_dtype = _params_dtype(params)
        self.speculative = speculative
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.page_size, self.num_pages, self.kv_cache_memory = page_size, num_pages, kv_cache_memory
        self.sliding_window_ring = bool(sliding_window_ring)
        self.prefix_caching = not sliding_window_ring if prefix_caching is None else prefix_caching
        self.token_budget = int(max_num_batched_tokens)
        self.backend = choose_backend(self.cache_dtype)
        if deterministic:
            check_deterministic(config, self.params, self.backend,
                                kv_cache_dtype or self.cache_dtype, self.token_budget)
        self.programs = ProgramCache()
        self.last_stats = RunStats()
        self._scheduler: Optional[Scheduler] = None

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
          kwargs: passed to `LLM(...)` (max_seq_len, decode_chunk, ...).
        Raises:
          ModelSourceError: the model file cannot be found or fetched.
          CheckpointError: a tensor is missing or has the wrong shape.
          RuntimeError: activations "int8" without the AVX512-VNNI or AVX2 kernel.
        """
        progress = Progress.resolve(progress)
        dtype, weights = serving_dtypes(jnp.dtype(dtype).name, weights)
        config, params, tokenizer = load_model(source, dtype=jnp.dtype(dtype), prepared=True,
                                               cache=load_cache, progress=progress, weights=weights,
                                               activations=activations)
        kwargs.setdefault("max_seq_len", min(config.max_position_embeddings, 2048))
        llm = cls(config, params, tokenizer, **kwargs)
        llm.programs.progress = progress
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
        dtype, weights = serving_dtypes(cfg.dtype, cfg.weights)
        config, params, tokenizer = load_model(
            cfg.model, jnp.dtype(dtype), prepared=True, progress=progress, weights=weights,
            activations=cfg.activations, before_weights=before_weights)
        draft_weights = serving_dtypes(cfg.dtype, cfg.draft_weights, notice=False)[1]
        spec = speculative_config(cfg.speculative, cfg.num_speculative_tokens, cfg.ngram_min,
                                        cfg.ngram_max, cfg.draft_model, config, tokenizer, dtype,
                                        draft_weights)
        names = ("max_seq_len", "decode_chunk", "max_num_seqs", "prefill_chunk_size",
                 "kv_cache_dtype", "page_size", "num_pages", "kv_cache_memory", "prefix_caching",
                 "max_num_batched_tokens", "sliding_window_ring", "deterministic")
        llm = cls(config, params, tokenizer, speculative=spec, **{n: getattr(cfg, n) for n in names})
        llm.programs.progress, llm.programs.max_programs = progress, cfg.max_programs
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

    def runner(self, max_num_seqs: int) -> ModelRunner:
        """A `ModelRunner` over `max_num_seqs` slots and a page pool of
        `pool_pages(max_num_seqs)` pages, compiling through this LLM's `programs`."""
        return ModelRunner(self.config, self.params, max_num_seqs=max_num_seqs,
                           max_seq_len=self.max_seq_len, page_size=self.page_size,
                           num_pages=self.pool_pages(max_num_seqs),
                           stop_token_ids=self.stop_token_ids, eos_token_ids=self.eos_token_ids,
                           cache_dtype=self.cache_dtype, kv_cache_dtype=self.kv_cache_dtype,
                           speculative=self.speculative, programs=self.programs, backend=self.backend,
                           token_budget=self.token_budget, grammars=self.grammars,
                           sliding_window_ring=self.sliding_window_ring,
                           tokenizer_vocab_size=self.tokenizer.vocab_size if self.tokenizer else 0)

    def pool_pages(self, max_num_seqs: int) -> int:
        """Pages in the KV page pool of a runner of `max_num_seqs` slots:
        num_pages, else what kv_cache_memory holds, else enough for
        max_num_seqs full sequences within DEFAULT_KV_CACHE_MEMORY (less the
        bytes of sliding-window rings, if any: `cache.paged_ring.pool_costs`).

        Raises:
          ValueError: kv_cache_memory does not hold one page.
        """
        if self.num_pages is not None:
            return self.num_pages
        page, rings = pool_costs(self.config, self.page_size, self.kv_cache_dtype or self.cache_dtype,
                                 max_num_seqs, self.ring_pages)      # rings: apart from the pool
        if self.kv_cache_memory is not None:
            if self.kv_cache_memory - rings < page:
                raise ValueError(f"a KV budget of {self.kv_cache_memory} bytes holds no page "
                                 f"({page} bytes, besides {rings} bytes of sliding-window rings)")
            return (self.kv_cache_memory - rings) // page
        full = max_num_seqs * -(-(self.max_seq_len + self.page_size) // self.page_size)
        return max(1, min(full, max(DEFAULT_KV_CACHE_MEMORY - rings, 0) // page))

    def scheduler(self, max_num_seqs: Optional[int] = None, **kwargs) -> Scheduler:
        """A `Scheduler` over a new runner of `max_num_seqs` slots (default
        this LLM's), detokenizing with this LLM's tokenizer, timed on
        `programs.clock` (compile time excluded). kwargs go to `Scheduler`
        (policy, max_waiting_requests, prefill_chunk_size, decode_chunk)."""
        tok = self.tokenizer
        kwargs.setdefault("prefill_chunk_size", self.prefill_chunk_size)
        kwargs.setdefault("decode_chunk", self.decode_chunk)
        kwargs.setdefault("prefix_caching", self.prefix_caching)
        return Scheduler(self.runner(max_num_seqs or self.max_num_seqs),
                         detokenizer_factory=(lambda: IncrementalDetokenizer(tok)) if tok else None,
                         stop_token_ids=self.stop_token_ids, eos_token_ids=self.eos_token_ids,
                         clock=self.programs.clock, **kwargs)

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
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list; wrap a single prompt in [...]")
        n = len(prompts)
        if n == 0:
            raise ValueError("no prompts given")
        ids = [self.encode_prompt(p, chat) for p in prompts]
        params = per_row(sampling_params, n, "sampling_params") or [sampling.SamplingParams()] * n
        budgets = per_row(max_new_tokens, n, "max_new_tokens")
        mins = per_row(min_tokens, n, "min_tokens")
        ignores = per_row(ignore_eos, n, "ignore_eos")
        out = []
        for row, (p, m) in enumerate(zip(ids, budgets)):
            if isinstance(m, (int, np.integer)) and m >= 1 and len(p) + m > self.max_seq_len:
                raise ValueError(
                    f"row {row}: prompt length {len(p)} + max_new_tokens {m} = {len(p) + m} exceeds "
                    f"max_seq_len {self.max_seq_len}; shorten the prompt, lower max_new_tokens "
                    "or raise max_seq_len")
            try:
                if params[row].structured is not None and self.grammars is not None:
                    self.grammars.compile(params[row].structured)    # a bad constraint fails here
                out.append(Request(p, params[row], int(m), int(mins[row]), bool(ignores[row]),
                                   tuple(stop), logprobs))
            except (ValueError, TypeError) as e:
                raise type(e)(f"row {row}: {e}") from None
        return out

    def _offline_scheduler(self, max_num_seqs: int) -> Scheduler:
        """The scheduler `generate` and `stream` run on: kept while calls need
        the same number of slots, so later calls reuse its compiled programs'
        buffers and its prefix cache (pages of earlier prompts). A scheduler
        left with work (a `stream` its caller stopped reading) is replaced."""
        kept = self._scheduler
        if kept is None or kept.runner.max_num_seqs != max_num_seqs or kept.has_unfinished():
            self._scheduler = None      # the old pools go before the new ones are allocated
            self._scheduler = self.scheduler(max_num_seqs, compile_loops=True, isolate_faults=False)
        return self._scheduler

    def _run(self, requests: Sequence[Request], stream: bool = False
             ) -> Generator[tuple[int, RequestOutput], None, list[Completion]]:
        """Run requests to the end on the scheduler; yields (index, event) and
        returns the Completions (in order). Sets `last_stats`."""
        compile_before = self.programs.compile_s
        scheduler = self._offline_scheduler(batch_bucket(min(len(requests), self.max_num_seqs)))
        pool = scheduler.kv_pages
        queried, hit, preempted = pool.query_tokens, pool.hit_tokens, scheduler.num_preempted
        steps = scheduler.runner.decode_steps
        index = {scheduler.add_request(r, stream=stream): i for i, r in enumerate(requests)}
        parts = [dict(tokens=[], text=[], logprobs=[], reason=None, timings=None, spec=None)
                 for _ in requests]
        while scheduler.has_unfinished():
            for event in scheduler.step():
                i = index[event.request_id]
                acc = parts[i]
                acc["tokens"] += event.token_ids
                acc["text"].append(event.text)
                acc["logprobs"] += event.logprobs or []
                acc["reason"], acc["timings"], acc["spec"] = event.finish_reason, event.timings, event.spec
                yield i, event
        steps = scheduler.runner.decode_steps - steps
        self.last_stats = RunStats.from_requests(
            [len(r.prompt_ids) for r in requests], [p["tokens"] for p in parts],
            [p["timings"] for p in parts], compile_s=self.programs.compile_s - compile_before,
            decode_steps=steps, spec=[p["spec"] for p in parts])
        self.last_stats = dataclasses.replace(
            self.last_stats, prefix_query_tokens=pool.query_tokens - queried,
            prefix_hit_tokens=pool.hit_tokens - hit, num_pages=pool.num_pages,
            num_preempted=scheduler.num_preempted - preempted)
        return [Completion(list(r.prompt_ids), p["tokens"], "".join(p["text"]), p["reason"],
                           p["logprobs"] if r.logprobs is not None else None)
                for r, p in zip(requests, parts)]

    # --- scoring -------------------------------------------------------------------------

    def score(self, prompts: Sequence[Prompt], continuations: Sequence[Union[str, Sequence[int]]],
              *, chat: bool = False) -> list[float]:
        """Log-likelihood of each continuation given its prompt (research use).

        One batched prefill with all-position logits; the continuation's tokens
        are scored one after another under teacher forcing.

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
        if len(prompts) != len(continuations) or not prompts:
            raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
        rows = [(self.encode_prompt(p, chat), self._continuation_ids(c))
                for p, c in zip(prompts, continuations)]
        for row, (p, c) in enumerate(rows):
            if len(p) + len(c) > self.max_seq_len:
                raise ValueError(f"row {row}: prompt {len(p)} + continuation {len(c)} tokens exceed "
                                 f"max_seq_len {self.max_seq_len}")
        full = [p + c for p, c in rows]
        tokens, lengths = pad_rows(full, batch_bucket(len(full)),
                               self.buckets.prompt_bucket(max(map(len, full))))
        cache = init_cache(self.config, tokens.shape[0], tokens.shape[1], self.cache_dtype)
        logp = np.asarray(self.programs(engine.token_logprobs, self.params, cache, tokens, lengths,
                                        config=self.config))
        return [float(logp[row, len(p) - 1:len(p) + len(c) - 1].sum())
                for row, (p, c) in enumerate(rows)]

    def _continuation_ids(self, continuation) -> list[int]:
        if isinstance(continuation, str):
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(continuation, add_special_tokens=False)
        else:
            ids = [int(i) for i in continuation]
        if not ids:
            raise ValueError("empty continuation: nothing to score")
        return self.encode_prompt(ids)


def _params_dtype(params: dict):
    """The activation / KV-cache dtype of a params pytree: its final norm's
    (matmul weights may be quantized codes), else its first float leaf's."""
    if "norm" in params:
        return params["norm"].dtype
    return next(w.dtype for w in jax.tree.leaves(params) if jnp.issubdtype(w.dtype, jnp.floating))
