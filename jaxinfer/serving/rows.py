"""The device-side rows of requests: `step.admit`'s per-row inputs
(`row_inputs`), the stop rule every row shares (`TokenRules`,
`stop_tokens`) and right-padded token rows (`pad_rows`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxinfer import sampling
from jaxinfer.engine import step as engine_step
from jaxinfer.sampling.arrays import to_device
from jaxinfer.sampling.rows import StopTokens
from jaxinfer.serving.request import Request


def row_inputs(requests: Sequence[Request], vocab_size: int, history: int,
               generated: Optional[Sequence[Sequence[int]]] = None,
               grammar: Optional[Sequence[int]] = None) -> engine_step.RowInputs:
    """`step.admit`'s per-row inputs for requests (one row each): budgets,
    min_tokens, ignore_eos, the prompt's token set and ids (in a history of
    `history` positions, >= each prompt + max_new_tokens), PRNG keys,
    sampling arrays. `generated`: per request, the tokens it generated before
    it was preempted (its row resumes after them; default none). `grammar`:
    per request, its structured-output state (default -1, none)."""
    generated = generated or [()] * len(requests)
    seen = np.zeros((len(requests), vocab_size), bool)
    counts = np.zeros((len(requests), vocab_size), np.int32)
    ids = np.zeros((len(requests), history), np.int32)
    lengths = []
    for row, (r, done) in enumerate(zip(requests, generated)):
        seq = list(r.prompt_ids) + list(done)
        seen[row, seq] = True
        np.add.at(counts[row], list(done), 1)
        ids[row, :len(seq)] = seq
        lengths.append(len(seq))
    return engine_step.RowInputs(
        max_new_tokens=to_device([r.max_new_tokens for r in requests], np.int32),
        min_tokens=to_device([r.min_tokens for r in requests], np.int32),
        ignore_eos=to_device([r.ignore_eos for r in requests], bool), seen=to_device(seen),
        history=to_device(ids), history_len=to_device(lengths, np.int32),
        keys=sampling.row_keys([r.sampling.seed for r in requests]),
        sampling=sampling.stack_params([r.sampling for r in requests]),
        num_generated=to_device([len(d) for d in generated], np.int32), counts=to_device(counts),
        grammar=to_device(grammar if grammar is not None else [-1] * len(requests), np.int32))


@dataclasses.dataclass(frozen=True)
class TokenRules:
    """What ends a row and what it may emit: the runner builds its device
    stop rule from it (`stop_tokens`), the scheduler its host copy.

    Attributes:
      stop_token_ids: ids that end a row.
      eos_token_ids: the tokenizer's EOS ids: they end a row unless its
        request has ignore_eos.
      vocab_limit: ids from here up to the model's vocab_size (a padded
        embedding) have no token and are never drawn; 0: no limit.
      grammars: the `sampling.grammar.GrammarCompiler` of requests with
        structured output; None: such requests are refused.
    """

    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    vocab_limit: int = 0
    grammars: Any = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def device(self) -> StopTokens:
        """The device's stop rule (`stop_tokens`)."""
        return stop_tokens(self.stop_token_ids, self.eos_token_ids, self.vocab_limit)


def stop_tokens(stop_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                num_ids: int = 0) -> StopTokens:
    """The device's stop rule: every id in either set ends a row, EOS ones
    unless the row has ignore_eos (-1 pads an empty set); ids from num_ids
    on (0: none) are never drawn."""
    ids = sorted(set(stop_token_ids) | set(eos_token_ids)) or [-1]
    return StopTokens(to_device(ids, np.int32), to_device(np.isin(ids, list(eos_token_ids))),
                      num_ids=int(num_ids))


__all__ = ["TokenRules", "row_inputs", "stop_tokens"]


def pad_rows(ids: Sequence[Sequence[int]], batch: int, length: int):
    """Right-pad id lists into device int32 tokens [batch, length] and
    lengths [batch] (zeros past each list and in rows past len(ids))."""
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.zeros((batch,), np.int32)
    for row, p in enumerate(ids):
        tokens[row, :len(p)] = p
        lengths[row] = len(p)
    return to_device(tokens), to_device(lengths)
