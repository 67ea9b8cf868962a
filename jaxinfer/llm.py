"""The host side of generation: load a model once, then generate or stream.

    llm = LLM.load("smollm2-135m-instruct")
    [c] = llm.generate(["What is the capital of France?"], chat=True, max_new_tokens=32)
    for piece in llm.stream("Once upon a time", max_new_tokens=64): print(piece, end="")

All input checks happen here, on the host, before any device work: JAX clamps
out-of-range indices and slice starts silently, so lengths and ids are checked
before they reach a compiled program.

Which shapes compile: one `start` program (prefill + first token) per
(batch bucket, prompt-length bucket, cache bucket) and one `decode_chunk`
program per (batch bucket, cache bucket). Batch buckets are powers of two;
prompt-length buckets are powers of two from `min_prompt_bucket` up to
`max_seq_len`. A run's KV cache starts at the smallest cache bucket that
holds its prompts and first chunk, and grows (`cache.grow_cache`) to the next
bucket when a chunk would overflow it, so a decode step attends over a buffer
sized to the context, not to `max_seq_len`. Cache buckets are the powers of
two and 1.5x powers of two from `min_kv_bucket` up to `max_seq_len`
(`cache_buckets`): at most a third of the attended buffer is ahead of the
longest row once it passes `min_kv_bucket`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import engine, sampling
from jaxinfer.cache import grow_cache, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.loading import load_model
from jaxinfer.params import prepare_params
from jaxinfer.progress import Progress
from jaxinfer.stop import StopMatcher

Prompt = Union[str, Sequence[int], Sequence[dict]]


@dataclasses.dataclass
class Completion:
    """One row's result.

    Attributes:
      prompt_token_ids: the prompt as fed to the model.
      token_ids: generated ids, including a final stop token when one ended the row.
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


@dataclasses.dataclass
class RunStats:
    """Timing of the last generate/stream call. Seconds, tokens and tokens/s.

    ttft_s: from the call's device work start to the first tokens on the host,
    excluding compilation. tpot_s: decode seconds per decode step run.
    decode_tokens_per_s: decoded tokens (after each row's first) per decode second.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    decoded_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        """Decode seconds per decode step run (compiled chunks run whole, so
        steps past a row's stop token count too)."""
        return self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all rows, after each row's first
        token) per decode second."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self) -> str:
        return (f"prompt tokens {self.prompt_tokens} | generated tokens {self.generated_tokens} | "
                f"compile {self.compile_s:.2f} s | TTFT {self.ttft_s * 1e3:.1f} ms | "
                f"TPOT {self.tpot_s * 1e3:.1f} ms/step ({self.decode_steps} steps) | "
                f"decode {self.decode_tokens_per_s:.1f} tokens/s")


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """(low, 2*low, 4*low, ..., high): every bucket <= high, high included."""
    out, b = [], max(1, low)
    while b < high:
        out.append(b)
        b *= 2
    return tuple(out) + (high,)


def cache_buckets(low: int, high: int) -> tuple[int, ...]:
    """(low, 1.5*low, 2*low, 3*low, 4*low, 6*low, ...): every bucket < high, then high.

    Two buckets per doubling: going from power-of-two buckets to these cut
    SmolLM2's batch-32 decode step at ~290 cached tokens from 147 ms (buffer
    512) to 123 ms (buffer 384) on the 2-core CI machine, for at most twice
    the decode programs.
    """
    low = max(1, low)
    out = sorted({b for i in range(high.bit_length() + 1) for b in (low << i, (3 * low << i) // 2)
                  if b < high})
    return tuple(out) + (high,)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class _Programs:
    """Ahead-of-time compiled programs keyed by static arguments and shapes,
    so the number of compilations and their seconds are observable."""

    def __init__(self):
        self._compiled = {}
        self.num_compiles = 0
        self.compile_s = 0.0
        self.progress = Progress.off()   # reports each compile ("compiling start ... 0.9 s")

    def __call__(self, fn, *args, **static):
        shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), args)
        key = (fn.__name__, tuple(sorted(static.items())), jax.tree_util.tree_structure(args),
               tuple(jax.tree_util.tree_leaves(shapes)))
        if key not in self._compiled:
            t0 = time.perf_counter()
            with self.progress.step(f"compiling {fn.__name__}"):
                self._compiled[key] = fn.lower(*args, **static).compile()
            self.compile_s += time.perf_counter() - t0
            self.num_compiles += 1
        return self._compiled[key](*args)


class LLM:
    """A loaded model: config, params, tokenizer and compiled programs.

    Args:
      config: ModelConfig.
      params: params pytree (jax arrays), as loaded or prepared; kept
        prepared (`params.prepare_params`), the layout the compiled phases
        run fastest on.
      tokenizer: a `jaxinfer.tokenizer.Tokenizer`, or None to accept token-id
        prompts only.
      max_seq_len: KV-cache capacity per row, tokens (prompt + generated).
      decode_chunk: decode steps per compiled chunk (streaming granularity).
      min_prompt_bucket: smallest prompt-length bucket.
      min_kv_bucket: smallest KV-cache bucket, tokens: a run's cache is the
        smallest bucket (`cache_buckets`) that covers its longest running row
        through the next decode chunk, grown bucket by bucket up to max_seq_len.
      stop_token_ids: extra ids that end a row (the tokenizer's EOS set is
        always included).
    """

    def __init__(self, config: ModelConfig, params: dict, tokenizer=None, *, max_seq_len: int = 2048,
                 decode_chunk: int = 16, min_prompt_bucket: int = 16, min_kv_bucket: int = 256,
                 stop_token_ids: Sequence[int] = ()):
        if not 2 <= max_seq_len <= config.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [2, {config.max_position_embeddings}] (the "
                             f"model's context length), got {max_seq_len}")
        self.config = config
        self.params = prepare_params(params, config)
        self.tokenizer = tokenizer
        self.max_seq_len = int(max_seq_len)
        self.decode_chunk = int(decode_chunk)
        self.prompt_buckets = power_of_two_buckets(min(min_prompt_bucket, max_seq_len), max_seq_len)
        self.kv_buckets = cache_buckets(min(min_kv_bucket, max_seq_len), max_seq_len)
        eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.stop_token_ids = tuple(sorted(eos | set(stop_token_ids)))
        self.cache_dtype = jax.tree_util.tree_leaves(params)[0].dtype
        self.programs = _Programs()
        self.last_stats = RunStats()

    @classmethod
    def load(cls, source: str, *, dtype: str = "float32", progress=None,
             load_cache: Optional[bool] = None, **kwargs) -> "LLM":
        """Load a named model, a `.gguf` file or a Hugging Face folder.

        Args:
          source: e.g. "smollm2-135m-instruct", "/path/model.gguf", "/path/hf_folder".
          dtype: parameter and KV-cache dtype name ("float32", "bfloat16", "float16").
          progress: a `jaxinfer.progress.Progress`, or True / False; None shows
            download/load bars and compile lines when stderr is a terminal.
          load_cache: keep prepared params in the load cache
            (`jaxinfer.load_cache`); None: unless `JAXINFER_LOAD_CACHE=0`.
          kwargs: passed to `LLM(...)` (max_seq_len, decode_chunk, ...).
        Raises:
          ModelSourceError: the model file cannot be found or fetched.
          CheckpointError: a tensor is missing or has the wrong shape.
        """
        progress = Progress.resolve(progress)
        config, params, tokenizer = load_model(source, dtype=jnp.dtype(dtype), prepared=True,
                                               cache=load_cache, progress=progress)
        kwargs.setdefault("max_seq_len", min(config.max_position_embeddings, 2048))
        llm = cls(config, params, tokenizer, **kwargs)
        llm.programs.progress = progress
        return llm

    # --- prompts ---------------------------------------------------------------

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

    # --- generation -------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling_params=None, *, max_new_tokens=64,
                 chat: bool = False, stop: Sequence[str] = (), logprobs: Optional[int] = None
                 ) -> list[Completion]:
        """Generate completions for a batch of prompts in one compiled batch.

        Args:
          prompts: texts, chat-message lists or token-id lists.
          sampling_params: one `SamplingParams` for all rows, a list (one per
            row), or None for the default, `SamplingParams()` (greedy).
          max_new_tokens: int or per-row list, >= 1.
          chat: render text prompts as a user turn with the chat template.
          stop: stop strings (the matched text is excluded from the output).
          logprobs: None, or the number of top alternatives to return per token.
        Returns:
          One Completion per prompt, in order. Timing is in `self.last_stats`.
        Raises:
          ValueError: bad prompts, or prompt length + max_new_tokens > max_seq_len,
            checked before any work starts.
        """
        events = self._run(prompts, sampling_params, max_new_tokens, chat, stop, logprobs)
        for _ in events:
            pass
        return self._completions

    def stream(self, prompt: Prompt, sampling_params=None, *, max_new_tokens=64, chat: bool = False,
               stop: Sequence[str] = ()) -> Iterator[str]:
        """Yield the generated text of one prompt piece by piece.

        The concatenated pieces equal `generate(...)[0].text` for the same
        arguments and seed. Text that could still be the start of a stop
        string, or an incomplete UTF-8 character, is held back.
        """
        for _row, piece in self._run([prompt], sampling_params, max_new_tokens, chat, stop, None):
            if piece:
                yield piece

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
        b = _batch_bucket(len(full))
        tokens, lengths = _pad(full, b, bucket_for(max(map(len, full)), self.prompt_buckets))
        cache = init_cache(self.config, b, tokens.shape[1], self.cache_dtype)
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

    def _requests(self, prompts, sampling_params, max_new_tokens, chat):
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list; wrap a single prompt in [...]")
        n = len(prompts)
        if n == 0:
            raise ValueError("no prompts given")
        ids = [self.encode_prompt(p, chat) for p in prompts]
        params = _per_row(sampling_params, n, "sampling_params") or [sampling.SamplingParams()] * n
        budgets = [int(m) for m in _per_row(max_new_tokens, n, "max_new_tokens")]
        for row, (p, m) in enumerate(zip(ids, budgets)):
            if m < 1:
                raise ValueError(f"row {row}: max_new_tokens must be >= 1, got {m}")
            if len(p) + m > self.max_seq_len:
                raise ValueError(
                    f"row {row}: prompt length {len(p)} + max_new_tokens {m} = {len(p) + m} exceeds "
                    f"max_seq_len {self.max_seq_len}; shorten the prompt, lower max_new_tokens "
                    "or raise max_seq_len")
        return ids, params, budgets

    def _device_inputs(self, ids, params, budgets):
        n = len(ids)
        b = _batch_bucket(n)
        tokens, lengths = _pad(ids, b, bucket_for(max(len(p) for p in ids), self.prompt_buckets))
        fill = [sampling.SamplingParams(temperature=0.0)] * (b - n)
        arrays = sampling.stack_params(list(params) + fill)
        keys = sampling.row_keys([p.seed for p in params] + [0] * (b - n))
        budget = np.array(list(budgets) + [1] * (b - n), np.int32)
        stop_ids = np.array(self.stop_token_ids or (-1,), np.int32)
        return tokens, lengths, jnp.asarray(budget), arrays, keys, jnp.asarray(stop_ids)

    def _run(self, prompts, sampling_params, max_new_tokens, chat, stop, logprobs):
        """Generator of (row, text piece) events; fills self._completions."""
        ids, params, budgets = self._requests(prompts, sampling_params, max_new_tokens, chat)
        rows = [_Row(self.tokenizer, p, m, stop, self.stop_token_ids) for p, m in zip(ids, budgets)]
        inputs = self._device_inputs(ids, params, budgets)
        stats = RunStats(prompt_tokens=sum(map(len, ids)))
        compile_before = self.programs.compile_s
        num_logprobs = -1 if logprobs is None else int(logprobs)
        b, t = inputs[0].shape
        cache = init_cache(self.config, b, max(t, self._cache_len(rows)), self.cache_dtype)
        t0 = time.perf_counter()
        state, out = self.programs(engine.start, self.params, cache, *inputs, config=self.config,
                                   num_logprobs=num_logprobs)
        yield from self._absorb(rows, jax.device_get(out), single_step=True)
        stats.ttft_s = time.perf_counter() - t0 - (self.programs.compile_s - compile_before)
        t1, compile_mid = time.perf_counter(), self.programs.compile_s
        while not all(r.finished for r in rows):
            state = state.replace(done=state.done | _host_done(rows, state.done.shape[0]))
            cache_len = self._cache_len(rows)
            if cache_len > state.cache.max_seq_len:
                state = state.replace(cache=self.programs(grow_cache, state.cache, config=self.config,
                                                          max_seq_len=cache_len))
            state, out = self.programs(engine.decode_chunk, self.params, state, config=self.config,
                                       num_steps=self.decode_chunk, num_logprobs=num_logprobs)
            stats.decode_steps += self.decode_chunk
            yield from self._absorb(rows, jax.device_get(out), single_step=False)
        stats.decode_s = time.perf_counter() - t1 - (self.programs.compile_s - compile_mid)
        for row, r in enumerate(rows):
            yield row, r.finish()
        stats.compile_s = self.programs.compile_s - compile_before
        stats.generated_tokens = sum(len(r.token_ids) for r in rows)
        stats.decoded_tokens = sum(max(len(r.token_ids) - 1, 0) for r in rows)
        self.last_stats = stats
        self._completions = [r.completion(logprobs is not None) for r in rows]

    def _cache_len(self, rows) -> int:
        """Smallest cache bucket covering every running row through the next
        decode chunk: a row's cache holds prompt + generated - 1 tokens, and
        before its first token, prompt tokens (the first token's K/V is
        written by the first decode step)."""
        needed = max(len(r.prompt_ids) + max(len(r.token_ids), 1) - 1 for r in rows if not r.finished)
        return self.cache_bucket(needed + self.decode_chunk)

    def cache_bucket(self, tokens: int) -> int:
        """The KV-cache bucket for `tokens` cached positions (capped at max_seq_len)."""
        return bucket_for(min(tokens, self.max_seq_len), self.kv_buckets)

    def _absorb(self, rows, out: engine.StepOutput, single_step: bool):
        """Feed a step's (or a chunk's) host-side outputs to each row."""
        out = jax.tree_util.tree_map(lambda x: x[None] if single_step else x, out)
        for row, r in enumerate(rows):
            for step in range(out.token.shape[0]):
                lp = None if out.logprob is None else (
                    out.logprob[step, row], out.top_ids[step, row], out.top_logprobs[step, row])
                piece = r.add(int(out.token[step, row]), lp)
                if piece:
                    yield row, piece


def _batch_bucket(n: int) -> int:
    """Batch bucket for n rows: the next power of two."""
    return 1 << (n - 1).bit_length()


def _pad(ids: Sequence[Sequence[int]], batch: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Right-pad id lists into int32 tokens [batch, length] and lengths [batch]."""
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for row, p in enumerate(ids):
        tokens[row, :len(p)] = p
        lengths[row] = len(p)
    return jnp.asarray(tokens), jnp.asarray(lengths)


def _per_row(value, n: int, name: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _host_done(rows, batch: int) -> jax.Array:
    """Rows finished on the host (a stop string matched), padded to the batch."""
    done = np.zeros((batch,), bool)
    done[:len(rows)] = [r.finished for r in rows]
    return jnp.asarray(done)


class _Row:
    """Host-side state of one row: ids, streamed text, stop handling."""

    def __init__(self, tokenizer, prompt_ids, max_new_tokens, stop_strings, stop_token_ids):
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finished = False
        self.finish_reason = "length"
        self.stop_token_ids = set(stop_token_ids)
        self.matcher = StopMatcher(stop_strings)
        self.detok = None
        if tokenizer is not None:
            from jaxinfer.tokenizer import IncrementalDetokenizer
            self.detok = IncrementalDetokenizer(tokenizer)

    def add(self, token: int, logprob) -> str:
        """Record one token (-1 = the device row was already done); returns text to emit."""
        if self.finished:
            return ""
        if token < 0:
            raise RuntimeError("device finished a row the host thinks is running")
        self.token_ids.append(token)
        self.finished = len(self.token_ids) >= self.max_new_tokens
        if logprob is not None:
            lp, top_ids, top_lp = logprob
            self.logprobs.append((token, float(lp), [(int(i), float(v)) for i, v in zip(top_ids, top_lp)]))
        if token in self.stop_token_ids:
            self.finished, self.finish_reason = True, "stop"
            return ""
        return self._text(self.detok.push([token]) if self.detok else "")

    def _text(self, new_text: str) -> str:
        piece, matched = self.matcher.push(new_text)
        if matched:
            self.finished, self.finish_reason = True, "stop"
        return piece

    def finish(self) -> str:
        """Flush held-back text at the end; returns the last piece."""
        if self.matcher.stopped:
            return ""
        tail = self.detok.flush() if self.detok else ""
        piece, matched = self.matcher.push(tail)
        if matched:
            self.finish_reason = "stop"
            return piece
        return piece + self.matcher.flush()

    def completion(self, with_logprobs: bool) -> Completion:
        return Completion(self.prompt_ids, self.token_ids, self.matcher.text, self.finish_reason,
                          self.logprobs if with_logprobs else None)
