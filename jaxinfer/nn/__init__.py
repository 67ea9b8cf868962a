"""Pure math with no weights attached: RMSNorm (`norm`), rotary position
embedding (`rope`) and attention (`attention`: the grouped-query layout,
scores, masked softmax, the one key-visibility rule and a flash-style
reference). Everything is pure and jit-friendly."""

from jaxinfer.nn.attention import (attention_output, attention_scores, blocked_attention,
                                   group_heads, masked_softmax, ungroup_heads, visible_keys)
from jaxinfer.nn.norm import ordered_sum, rms_norm
from jaxinfer.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["apply_rope", "attention_output", "attention_scores", "blocked_attention", "group_heads",
           "masked_softmax", "ordered_sum", "rms_norm", "rope_cos_sin", "rope_inv_freq", "ungroup_heads",
           "visible_keys"]
