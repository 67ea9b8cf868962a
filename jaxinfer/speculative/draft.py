"""A draft model for speculative decoding: a smaller (or quantized) model
sharing the target's tokenizer, and the check that it does."""

from __future__ import annotations

from jaxinfer.config import ModelConfig


class DraftModel:
    """A draft model: a smaller (or quantized) model sharing the target's
    tokenizer, with prepared params. Its KV cache lives in
    `DecodeState.draft`, kept in step with the target's accepted length.

    Args:
      config: the draft's ModelConfig; params: its prepared params.
      name: where it was loaded from (for messages).
    """

    def __init__(self, config: ModelConfig, params: dict, name: str = "draft"):
        self.config, self.params, self.name = config, params, name


def check_draft(target: ModelConfig, target_tokenizer, draft: ModelConfig, draft_tokenizer,
                name: str, probe: str) -> None:
    """Raise ValueError unless the draft shares the target's vocabulary:
    the same vocabulary size and, with tokenizers, the same ids for `probe`
    and the same EOS ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {name}: vocabulary size {draft.vocab_size} differs from the "
                         f"target's {target.vocab_size}; a draft must share the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    a, b = target_tokenizer.encode(probe), draft_tokenizer.encode(probe)
    if a != b:
        raise ValueError(f"draft model {name}: its tokenizer encodes {probe!r} as {b[:12]}, the "
                         f"target's as {a[:12]}; a draft must share the target's tokenizer")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise ValueError(f"draft model {name}: EOS ids {sorted(draft_tokenizer.eos_token_ids)} "
                         f"differ from the target's {sorted(target_tokenizer.eos_token_ids)}")
