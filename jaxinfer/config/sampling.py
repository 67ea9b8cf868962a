"""`SamplingParams`: one request's host-side sampling settings, validated once.

The device side (per-row arrays, filters, draws) is `jaxinfer.sampling`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import secrets
from typing import Optional, Sequence

# Rows with 0 < temperature < TEMPERATURE_FLOOR divide by the floor instead,
# so that logits / temperature stays finite.
TEMPERATURE_FLOOR = 1e-6
# Seeds are 32-bit: with jax_enable_x64 off, `jax.random.key` keeps only the
# low 32 bits of a larger seed, so larger seeds are rejected, not truncated.
MAX_SEED = 2**32 - 1
# Device tables of structured output's automata one runner keeps at most
# (`sampling.grammar.GrammarPool`; the `grammar_cache_bytes` setting).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20
FLOAT32_MAX = 3.4028234663852886e38      # float values must stay finite in float32
FLOAT32_TINY = 1.1754943508222875e-38    # smallest normal float32: a smaller penalty would be 0


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text (docs/structured.md); exactly
    one field is set. Compiled by `jaxinfer.sampling.grammar` against the
    tokenizer's vocabulary into tables the compiled step applies.

    Attributes:
      json_schema: a JSON schema (a dict or its JSON text; kept as canonical
        JSON text, so equal schemas share one compiled automaton).
      regex: a regular expression the whole output must match.
      choice: the output is exactly one of these strings.
      json_object: the output is any JSON object.
      grammar: a context-free grammar the whole output must match, in
        llama.cpp's GBNF (start rule `root`) or llguidance's Lark syntax
        (start rule `start`); masked on the host, one token per step.
    Raises:
      ValueError / TypeError: none or several fields set, a schema that is
        not JSON, an empty choice list or a choice that is not a string.
    """

    json_schema: Optional[str] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    json_object: bool = False
    grammar: Optional[str] = None

    def __post_init__(self):
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("StructuredOutput needs exactly one of json_schema, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise TypeError(f"StructuredOutput.grammar must be a non-empty string, got {self.grammar!r}")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutput.json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise TypeError(f"StructuredOutput.json_schema must be a JSON object, got {schema!r}")
            object.__setattr__(self, "json_schema", json.dumps(schema, sort_keys=True))
        if self.regex is not None and not isinstance(self.regex, str):
            raise TypeError(f"StructuredOutput.regex must be a string, got {self.regex!r}")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("StructuredOutput.choice must be non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", choice)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling parameters of one request (one batch row).

    The defaults are greedy decoding: `SamplingParams()` takes the argmax at
    every step, so the same prompt always gives the same text (Hugging Face
    `generate`'s default, `do_sample=False`). Set `temperature` > 0 to
    sample; top_k, top_p and min_p only filter sampled rows. jaxinfer does
    not read a checkpoint's `generation_config.json` sampling values: every
    value comes from here (or the YAML keys of the same names).

    Attributes:
      temperature: divides the logits before sampling; 0 (the default) is
        greedy (argmax, lowest id on ties). >= 0.
      top_k: keep the k most likely tokens (ties at the k-th value all kept);
        0 or -1 (off) and k >= V filter nothing; 1 is greedy. >= -1.
      top_p: nucleus sampling (Holtzman et al. 2019), keep the smallest set
        of most likely tokens whose mass reaches top_p; 1.0 is off. In (0, 1].
      min_p: keep tokens with prob >= min_p * max prob (Nguyen et al. 2024);
        0 is off. In [0, 1].
      repetition_penalty: a logit l of a token seen in the prompt or output
        becomes l / r if l > 0 else l * r (CTRL, Keskar et al. 2019,
        arXiv:1909.05858; Hugging Face convention); 1.0 is off. At least
        FLOAT32_TINY (1.18e-38), so that it is not 0 in float32.
      presence_penalty: l -= presence_penalty once a token was generated
        (OpenAI convention; prompt tokens do not count); 0 is off.
      frequency_penalty: l -= frequency_penalty * (times the token was
        generated) (OpenAI convention); 0 is off.
      seed: sampling seed in [0, 2**32 - 1]; None (YAML null) draws a random
        one per request (`resolve_seeds`). Greedy rows ignore it.
      structured: None, or a `StructuredOutput` the output must follow: its
        mask is applied before every other filter, and EOS is allowed only
        where the output is complete (docs/structured.md). A dict (a YAML
        mapping) is read as the `StructuredOutput` fields.

    Raises:
      ValueError: naming the field, for a value out of range, not finite, or
        beyond float32's range (|x| > 3.4e38: the device computes in float32).
      TypeError: naming the field, for a value of the wrong type (a float
        field that is not a real number, top_k or seed not an integer).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    structured: Optional[StructuredOutput] = None

    def __post_init__(self):
        if isinstance(self.structured, dict):     # a YAML mapping: the StructuredOutput fields
            try:
                object.__setattr__(self, "structured", StructuredOutput(**self.structured))
            except TypeError as e:    # an unknown field
                raise TypeError(f"structured: {e}") from None
            except ValueError as e:
                raise ValueError(f"structured: {e}") from None
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise TypeError("SamplingParams.structured must be a StructuredOutput or None, got "
                            f"{self.structured!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"SamplingParams.{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be finite, got {value!r}")
            if abs(value) > FLOAT32_MAX:       # the device computes in float32: it would be inf
                raise ValueError(f"SamplingParams.{name} must be at most {FLOAT32_MAX:.7g} in "
                                 f"magnitude (float32), got {value!r}")
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty >= FLOAT32_TINY, "repetition_penalty",
               f"must be > 0 and at least {FLOAT32_TINY:.7g} (the smallest normal float32)",
               self.repetition_penalty)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"SamplingParams.top_k must be an int, got {self.top_k!r}")
        _check(self.top_k >= -1, "top_k", "must be >= -1 (0 and -1 mean no top-k filter)",
               self.top_k)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise TypeError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
            _check(0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}]", self.seed)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


def check_token_limits(max_new_tokens: int, min_tokens: int) -> None:
    """One request's token limits, as `serving.Request` and
    `config.GenerationConfig` take them: max_new_tokens >= 1 and
    0 <= min_tokens <= max_new_tokens (both ints; types are the caller's).

    Raises:
      ValueError: naming the field out of range and its value.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_tokens <= max_new_tokens:
        raise ValueError(f"min_tokens must be in [0, max_new_tokens = {max_new_tokens}], "
                         f"got {min_tokens}")


def resolve_seeds(seeds: Sequence[Optional[int]]) -> tuple[int, ...]:
    """Replaces each None seed by a fresh random 32-bit seed from `secrets`.

    Returns the seeds actually used, so a caller can report them and replay
    a request exactly.

    Raises:
      ValueError / TypeError: for a seed outside [0, 2**32 - 1] or not an int.
    """
    out = []
    for s in seeds:
        if s is None:
            s = secrets.randbits(32)
        SamplingParams(seed=s)  # validates
        out.append(int(s))
    return tuple(out)
