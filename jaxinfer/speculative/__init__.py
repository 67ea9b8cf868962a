"""Speculative decoding: propose k tokens cheaply, verify them in one step.

A decoding row's segment in the serving step (`engine.step`) holds its last
token and up to k drafted tokens; the target model runs them in one forward
with a causal mask inside the block, and `sampling.rows.accept_drafts`
keeps the longest accepted prefix plus one token from the target (the rule
of Leviathan et al. 2023 and Chen et al. 2023: the emitted tokens follow the
target's distribution exactly; greedy rows emit exactly plain decoding's
tokens). Rejected positions are forgotten by not advancing the slot's
length: their K/V are overwritten before any query can see them.

Proposers: `ngram` (prompt lookup, on the device, inside the step) and
`draft` (a draft model sharing the target's tokenizer). `SpecConfig` holds
the settings.
"""

from jaxinfer.speculative.config import DraftConfig, SpecConfig, as_spec_config
from jaxinfer.speculative.draft import DraftModel, check_draft
from jaxinfer.speculative.ngram import NgramConfig, ngram_propose

__all__ = ["DraftConfig", "DraftModel", "NgramConfig", "SpecConfig", "as_spec_config", "check_draft", "ngram_propose"]
