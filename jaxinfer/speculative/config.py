"""`SpecConfig`: the settings of speculative decoding."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (see `jaxinfer.speculative`).

    Attributes:
      method: "ngram" (prompt lookup) or "draft" (a draft model).
      num_speculative_tokens: k, tokens proposed per verification round.
      ngram_min, ngram_max: n-gram lengths tried, longest first.
      draft: the `speculative.DraftModel` for method "draft".
    Raises:
      ValueError: an unknown method, k < 1, a bad n-gram range, or "draft"
        without a draft model.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    draft: object = None

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative must be ngram or draft, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("speculative: draft needs a draft_model")


def as_spec_config(value) -> "SpecConfig | None":
    """`value` as a `SpecConfig`: None (off) and a SpecConfig as they are,
    the string "ngram" as `SpecConfig("ngram")` with its defaults.

    Raises:
      ValueError: "draft" (a draft model must come with it) or another string.
      TypeError: any other type.
    """
    if value is None or isinstance(value, SpecConfig):
        return value
    if value == "ngram":
        return SpecConfig("ngram")
    if value == "draft":
        raise ValueError("speculative='draft' needs its draft model: pass "
                         "SpecConfig('draft', k, draft=DraftModel(config, params))")
    if isinstance(value, str):
        raise ValueError(f"speculative must be 'ngram', a SpecConfig or None, got {value!r}")
    raise TypeError(f"speculative must be a SpecConfig, 'ngram' or None, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Static settings of the draft-model proposer inside a compiled step.

    Attributes:
      k: tokens the draft model proposes per row per step (>= 1).
      config: the draft model's `ModelConfig`.
    """

    k: int
    config: object
