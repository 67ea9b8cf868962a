"""`GenerationConfig`: what `jaxinfer generate`, `serve` and `bench` read from a
YAML file plus key=value overrides, and the YAML helpers behind it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import yaml

from jaxinfer.config.cache import CacheConfig, parse_bytes
from jaxinfer.config.paths import read_user_file
from jaxinfer.config.sampling import DEFAULT_GRAMMAR_CACHE_BYTES, SamplingParams, check_token_limits
from jaxinfer.config.scheduler import SchedulerConfig

# Compiled programs a process keeps alive at most (`serving.programs.ProgramCache`):
# XLA:CPU maps each one's code, and vm.max_map_count (65,530) bounds the maps.
DEFAULT_MAX_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What `jaxinfer generate` reads from a YAML file plus key=value overrides.

    The YAML is flat: the keys are these attributes (except `sampling`) and
    the fields of `jaxinfer.config.SamplingParams` (temperature, top_k,
    top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty,
    seed), which go into `sampling` and are validated there, once.

    Attributes:
      model: a named model ("smollm2-135m-instruct", "gemma3-270m"), a .gguf
        path, a Hugging Face checkpoint folder, or research code's own model
        as a Python factory "python:PATH.py:FUNCTION" (e.g.
        "python:examples/byo_model.py:build", PATH relative to the working
        directory): FUNCTION() returns (ModelConfig, params, tokenizer or
        None) and the file registers the model's family
        (`jaxinfer.models.register`); see jaxinfer/serving/loading.py.
        `jaxinfer serve` needs a tokenizer.
      dtype: parameter and KV-cache dtype: "float32", "bfloat16" or "float16".
        Where the C++ CPU kernels run, "bfloat16" serves float32 activations
        and KV cache over bfloat16 weights (weights float32 becomes bfloat16;
        `engine.ragged.serving_dtypes`), and "float16" runs attention on XLA;
        each says so in one logged warning line.
      kv_cache_dtype: KV-cache storage, a codec of `cache.CODECS`: null (as
        dtype), "float32", "bfloat16", "float16" or "int8" (codes plus a float32
        scale per token per kv head, a quarter of float32's bytes; see
        jaxinfer/cache/int8.py).
      weights: how matmul weights are kept: "float32", "bfloat16", "int8"
        (8-bit blocks of 16 rows with float16 scales) or "q4" (4-bit blocks; a GGUF file's own blocks
        where it has them); see jaxinfer/weights/quant.py and docs/quantization.md.
      activations: what the 4-bit ("q4") matmuls multiply: "float32" (the
        activations as they are) or "int8" (rounded to int8 per row and block
        of 32 and multiplied on AVX512-VNNI or AVX2, llama.cpp's scheme for its 4-bit
        formats; see docs/quantization.md for its speed and accuracy).
        "int8" needs weights "q4".
      max_seq_len: KV-cache capacity per row, tokens (prompt + generated).
      max_new_tokens: generated tokens per prompt, at most.
      chat: render the prompt as a user turn with the model's chat template.
      chat_template: a Jinja file that replaces the model's chat template
        for every chat prompt (`generate`, `serve`, `LLM`; vLLM's
        --chat-template), e.g. examples/chatml_tools.jinja to serve tool
        calls with a model whose own template renders no tools; null: the
        model's. A missing file or a template that does not render a user
        turn is an error before any weight is read.
      system_prompt: a system turn before chat prompts; null keeps the
        template's default.
      stop: stop strings; a match ends the row and is cut from the text.
      min_tokens: stop tokens and stop strings are ignored until this many
        tokens were generated.
      ignore_eos: the tokenizer's EOS does not end a row (fixed-length runs).
      decode_chunk: decoding steps per dispatch (one `lax.scan`) once
        nothing waits and no request streams (`generate`); streams and
        `jaxinfer serve` decode one step per dispatch.
      max_num_seqs: slots, the most requests running at once.
      page_size: tokens per KV-cache page: every layer's K/V live in one
        pool of pages, each request holding the pages it fills through a
        block table (PagedAttention; see jaxinfer/cache/paged.py).
      num_pages: pages in the pool (null: from kv_cache_memory).
      kv_cache_memory: the KV page pool's budget in bytes; an int or a
        string such as 512MiB or 2GiB. null: enough for max_num_seqs
        requests of max_seq_len tokens, at most 2 GiB. Requests beyond it
        wait, and the newest running one is preempted (recomputed later)
        when the pool runs dry.
      prefix_caching: requests reuse the KV pages of an equal prompt
        prefix computed before (full pages only; a request's cache_salt
        keeps its pages apart). null: on where the cache layout supports
        it (not with layout paged_ring).
      prefill_chunk_size: prompt tokens per serving step while requests
        decode (the bound on a running stream's gap between two tokens);
        null: the whole token budget (see jaxinfer/serving/scheduler.py).
      long_prefill_chunk_size: in `jaxinfer serve`, while requests decode,
        a prompt longer than the token budget fills a step only up to the
        token bucket of the decode tokens plus this many, after the other
        prompts, and later in the prompt only to 1.5 times what those
        tokens cost at its start (it takes several steps anyway; small
        pieces keep the running streams' gaps near one decode step's, at
        some cost to its own TTFT); null: as any prompt (prefill_chunk_size).
      max_num_batched_tokens: the most tokens one serving step runs (its
        token budget and largest compiled token bucket).
      layout: the KV-cache layout, a name in `cache.LAYOUTS`: "paged" (every
        layer keeps every position in the page pool) or "paged_ring"
        (sliding-window layers, Gemma 3's, keep a fixed ring of KV pages per
        request instead of every position, so their memory stops growing with
        the context; see jaxinfer/cache/paged_ring.py; prefix caching is then
        off, true with it is an error, and disaggregated prefill refuses it).
        null: "paged", or "paged_ring" with sliding_window_ring.
      sliding_window_ring: true is layout "paged_ring" (the older key; give
        one of the two).
      deterministic: a request's tokens and log-probs are bitwise the same
        whatever the batch, its neighbours, the chunking, a prefix-cache hit
        or a preemption (jaxinfer/serving/deterministic.py); loading fails
        with the reason where it cannot hold (int8/q4 weights, a bfloat16
        or int8 KV cache, the CPU kernels off).
      speculative: null (off), "ngram" (prompt lookup) or "draft" (a draft
        model): speculative decoding (see jaxinfer/speculative/).
      num_speculative_tokens: k, tokens proposed per verification round.
      ngram_min, ngram_max: n-gram lengths the ngram proposer matches.
      draft_model: the draft for speculative: draft, a model sharing the
        target's tokenizer (a name, .gguf path or folder).
      draft_weights: the draft model's weight format (as `weights`; "q4"
        makes a quantized copy of the target a cheap draft).
      max_waiting_requests: `jaxinfer serve` only: requests accepted but
        not yet decoding, at most; past it the server answers HTTP 503
        (null: unbounded).
      warmup: `jaxinfer serve` only: before serving, compile ahead of time
        the step of every token bucket (ModelRunner.warmup), so that no
        request waits for a compile.
      grammar_cache_bytes: the device memory structured output's automata
        (JSON schemas, regexes, choices, tool sets) may take in one runner:
        an int or a string such as 512MiB. Past it the least recently used
        automata no running request uses are evicted and built again when
        needed; a schema that cannot fit beside the running ones is masked
        on the host (docs/structured.md). 0: every constraint on the host.
      max_programs: compiled programs kept alive at most (null: unbounded);
        past it the least recently used is dropped and compiled again when
        next needed (see jaxinfer/serving/programs.py). XLA:CPU maps each
        program's code, and a process past vm.max_map_count crashes.
      tp: tensor-parallel size: `jaxinfer serve` shards the model over tp
        devices (float32 or bfloat16 weights): this process's
        devices when num_processes is 1 (on CPU forced with
        XLA_FLAGS=--xla_force_host_platform_device_count=N), else every device
        of the job, tp / num_processes per process (docs/scaling.md).
      coordinator: with num_processes > 1, host:port of the job's coordination
        service, which process 0 hosts (`jax.distributed`); null otherwise.
      num_processes: processes one model spans (`jaxinfer serve`, one command
        per process, the same but for process_id; `python -m
        jaxinfer.cli.launch -n N -- jaxinfer serve ...` starts them here).
      process_id: this process's rank in [0, num_processes): 0 serves HTTP
        and schedules, the others run its steps on their shards.
      sampling: the sampling parameters (`SamplingParams`; greedy unless the
        YAML sets temperature > 0).
      cache: the cache keys above as one `CacheConfig` (max_seq_len,
        kv_cache_dtype, page_size, num_pages, kv_cache_memory,
        prefix_caching, layout; sliding_window_ring as layout "paged_ring"), built
        and validated with this config; not a YAML key.
      scheduler: the scheduler keys above as one `SchedulerConfig`
        (max_num_seqs, max_num_batched_tokens, prefill_chunk_size,
        long_prefill_chunk_size, decode_chunk, max_waiting_requests); not a
        YAML key.

    Raises:
      ValueError: naming the key, for a value of the wrong type or out of range.
      TypeError: from `SamplingParams`, for a sampling value of the wrong type.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    weights: str = "float32"
    activations: str = "float32"
    kv_cache_dtype: Optional[str] = None
    max_seq_len: int = 2048
    max_new_tokens: int = 128
    chat: bool = True
    chat_template: Optional[str] = None
    system_prompt: Optional[str] = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    decode_chunk: int = 16
    max_num_seqs: int = 256
    page_size: int = 16
    num_pages: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    prefix_caching: Optional[bool] = None
    prefill_chunk_size: Optional[int] = 512
    long_prefill_chunk_size: Optional[int] = 32
    max_num_batched_tokens: int = 512
    layout: Optional[str] = None
    sliding_window_ring: bool = False
    deterministic: bool = False
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    draft_model: Optional[str] = None
    draft_weights: str = "float32"
    max_waiting_requests: Optional[int] = 256
    warmup: bool = True
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    max_programs: Optional[int] = DEFAULT_MAX_PROGRAMS
    tp: int = 1
    coordinator: Optional[str] = None
    num_processes: int = 1
    process_id: int = 0
    sampling: SamplingParams = SamplingParams()
    cache: CacheConfig = dataclasses.field(init=False, repr=False, compare=False)
    scheduler: SchedulerConfig = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_types()
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("weights", "draft_weights"):
            if getattr(self, name) not in ("float32", "bfloat16", "int8", "q4"):
                raise ValueError(f"{name} must be float32, bfloat16, int8 or q4, got "
                                 f"{getattr(self, name)!r}")
        if self.activations not in ("float32", "int8"):
            raise ValueError(f"activations must be float32 or int8, got {self.activations!r}")
        if self.activations == "int8" and self.weights != "q4":
            raise ValueError(f"activations=int8 needs weights=q4 (int8 activations multiply "
                             f"4-bit weights), got weights={self.weights!r}")
        check_token_limits(self.max_new_tokens, self.min_tokens)
        if isinstance(self.grammar_cache_bytes, str):
            object.__setattr__(self, "grammar_cache_bytes",
                               parse_bytes(self.grammar_cache_bytes, "grammar_cache_bytes"))
        if (not isinstance(self.grammar_cache_bytes, int) or isinstance(self.grammar_cache_bytes, bool)
                or self.grammar_cache_bytes < 0):
            raise ValueError(f"grammar_cache_bytes must be an int >= 0 or a string such as 512MiB, "
                             f"got {self.grammar_cache_bytes!r}")
        self._check_job()
        if self.max_programs is not None and self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1 or null, got {self.max_programs}")
        if self.sliding_window_ring and self.layout not in (None, "paged_ring"):
            raise ValueError(f"sliding_window_ring: true is layout paged_ring; give layout or "
                             f"sliding_window_ring, not both (got layout {self.layout!r})")
        layout = self.layout if self.layout is not None else (
            "paged_ring" if self.sliding_window_ring else "paged")
        cache = CacheConfig(self.max_seq_len, None, self.kv_cache_dtype, self.page_size,
                            self.num_pages, self.kv_cache_memory, self.prefix_caching, layout)
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "kv_cache_memory", cache.kv_cache_memory)   # "2GiB" -> bytes
        object.__setattr__(self, "scheduler", SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.prefill_chunk_size,
            self.long_prefill_chunk_size, self.decode_chunk, "continuous", self.max_waiting_requests))
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def _check_job(self) -> None:
        """tp, num_processes, process_id and coordinator hold together
        (`parallel.multiprocess.JobSettings.check` checks the address itself)."""
        if self.tp < 1 or self.num_processes < 1:
            raise ValueError(f"tp and num_processes must be >= 1, got {self.tp} and "
                             f"{self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), got "
                             f"{self.process_id}")
        if self.num_processes > 1 and self.coordinator is None:
            raise ValueError("num_processes > 1 needs coordinator: host:port of the job's "
                             "coordination service (process 0 hosts it)")
        if self.tp % self.num_processes:
            raise ValueError(f"tp must be a multiple of num_processes={self.num_processes} (each "
                             f"process holds tp / num_processes devices), got {self.tp}")
        if self.tp > 1 and self.weights not in ("float32", "bfloat16"):
            raise ValueError(f"tp > 1 needs weights float32 or bfloat16 (quantized weights do not "
                             f"shard), got {self.weights!r}")
        if self.num_processes > 1 and self.speculative is not None:
            raise ValueError("speculative decoding is not supported with num_processes > 1")

    def _check_types(self) -> None:
        """Reject values of the wrong type (YAML turns `yes` into a bool, `5` into an int)."""
        kinds = {"model": str, "dtype": str, "weights": str, "activations": str,
                 "draft_weights": str, "chat": bool,
                 "max_new_tokens": int, "min_tokens": int,
                 "ignore_eos": bool, "num_speculative_tokens": int,
                 "ngram_min": int, "ngram_max": int, "warmup": bool,
                 "sliding_window_ring": bool, "deterministic": bool, "tp": int,
                 "num_processes": int, "process_id": int}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not _is_kind(value, kind):
                raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")
        # keys that may be null: name -> (kind, what the error calls it)
        nullable = {"draft_model": (str, "a string"), "max_programs": (int, "int"),
                    "coordinator": (str, "host:port"), "chat_template": (str, "a path to a Jinja file"),
                    "system_prompt": (str, "a string")}
        for name, (kind, what) in nullable.items():
            value = getattr(self, name)
            if value is not None and not _is_kind(value, kind):
                raise ValueError(f"{name} must be {what} or null, got {value!r}")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be null, ngram or draft, got {self.speculative!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {self.sampling!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The YAML keys, in documentation order: own fields, then sampling fields."""
        own = tuple(f.name for f in dataclasses.fields(cls) if f.name != "sampling" and f.init)
        return own + tuple(f.name for f in dataclasses.fields(SamplingParams))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "GenerationConfig":
        """Build from a flat mapping of YAML keys (see the class docstring).

        Raises:
          ValueError: unknown keys (all named, with the known ones), or invalid values.
          TypeError: a sampling value of the wrong type.
        """
        check_keys(values, cls.keys(), "config")
        sampling_names = {f.name for f in dataclasses.fields(SamplingParams)}
        sampling = SamplingParams(**{k: v for k, v in values.items() if k in sampling_names})
        return cls(sampling=sampling, **{k: v for k, v in values.items() if k not in sampling_names})

    @classmethod
    def load(cls, path: Optional[str] = None, overrides: Sequence[str] = ()) -> "GenerationConfig":
        """Read a YAML file (or defaults when path is None) and apply
        `key=value` overrides, each value parsed as YAML (so 0.7, true, null work).

        Raises:
          ValueError: unknown keys, a malformed override, or invalid values.
          TypeError: a sampling value of the wrong type.
          FileNotFoundError: the YAML file does not exist.
        """
        values = read_yaml_mapping(path) if path is not None else {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"override {item!r} is not key=value")
            try:
                values[key.strip()] = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ValueError(f"override {item!r}: value is not valid YAML ({e})") from None
        return cls.from_dict(values)

    @classmethod
    def key_docs(cls) -> dict[str, str]:
        """YAML key -> its documentation (from this docstring and
        `SamplingParams`'), for `jaxinfer generate --help`."""
        docs = {**attribute_docs(cls), **attribute_docs(SamplingParams)}
        return {k: docs[k] for k in cls.keys()}


def _is_kind(value, kind: type) -> bool:
    """isinstance(value, kind), but a bool is not an int here (YAML reads `yes` as true)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def read_yaml_mapping(path: str | os.PathLike) -> dict:
    """A YAML file's top-level mapping ({} for an empty file).

    Raises:
      FileNotFoundError: no such file ("config file not found: <path>").
      ValueError: the file cannot be read (a folder, no permission), is not
        UTF-8, not valid YAML or not a mapping (names the file).
    """
    text = read_user_file(path, label=f"config file {path}", missing=f"config file not found: {path}")
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of key: value, got {type(values).__name__}")
    return values


def check_keys(values: Mapping[str, Any], known: Sequence[str], what: str) -> None:
    """Raise ValueError naming every key of `values` not in `known` (and the
    known keys), or the first key that is not a string (YAML allows `1: x`)."""
    for key in values:
        if not isinstance(key, str):
            raise ValueError(f"{what} keys must be strings, got {key!r} ({type(key).__name__})")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known keys: {sorted(known)}")


def attribute_docs(cls) -> dict[str, str]:
    """name -> text of each entry in the "Attributes:" section of a class
    docstring (Google style: `name: text`, continuation lines indented
    deeper; `a, b: text` documents both)."""
    lines = (cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    names: list[str] = []
    inside, indent = False, None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside = True
            continue
        if not inside or not stripped:
            if inside and not stripped and names:
                names = []
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        head, sep, text = stripped.partition(": ")
        if depth == indent and sep and all(n.strip().isidentifier() for n in head.split(",")):
            names = [n.strip() for n in head.split(",")]
            for n in names:
                docs[n] = text
        elif names:
            for n in names:
                docs[n] += " " + stripped
    return docs
