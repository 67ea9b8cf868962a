"""Scores of prompts: `LLM.score` (log-likelihood of continuations) and
prompt log-probs (`LLM.prompt_logprobs`): every prompt token's log-prob,
rank and the top n most likely tokens at its position, from one prefill
returning every position's log-softmax (`engine.phases.prompt_logprobs`,
the program `LLM.score` runs but for the ranks and the top n). The
server's `echo` and `prompt_logprobs` (`server.prompt_scores`) read them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from jaxinfer.cache.kv import init_cache
from jaxinfer.engine import phases as engine
from jaxinfer.serving.buckets import batch_bucket
from jaxinfer.serving.request import MAX_LOGPROBS
from jaxinfer.serving.rows import pad_rows


class PromptLogprob(NamedTuple):
    """One prompt token's log-prob (`LLM.prompt_logprobs`).

    Attributes:
      token: its id; logprob: log p(token | the tokens before it), nats.
      rank: 1 + the number of tokens more likely than it at its position.
      top: the most likely tokens there, [(id, logprob), ...] in descending
        order (rank i + 1 for entry i).
    """

    token: int
    logprob: float
    rank: int
    top: list


# Bytes of log-probs ([rows, positions, vocabulary] float32) one forward holds at most.
PROMPT_LOGPROBS_BYTES = 1 << 29


def prompt_logprobs(llm, rows: list[list[int]], top_n: int) -> list[list[Optional[PromptLogprob]]]:
    """`LLM.prompt_logprobs` of checked token-id rows (each at most
    max_seq_len, top_n in [0, MAX_LOGPROBS]): rows of similar length share a
    forward, its log-probs bounded by PROMPT_LOGPROBS_BYTES (one row at least)."""
    width = MAX_LOGPROBS if top_n else 0       # one program for every top_n > 0
    out: list = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    bucket = lambda i: llm.buckets.prompt_bucket(max(2, len(rows[i])))     # noqa: E731
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (batch_bucket(end + 1 - start) * bucket(order[end]) * 4
                                    * llm.config.vocab_size <= PROMPT_LOGPROBS_BYTES):
            end += 1
        group, length = order[start:end], bucket(order[end - 1])
        start = end
        tokens, lengths = pad_rows([rows[i] for i in group], batch_bucket(len(group)), length)
        cache = init_cache(llm.config, tokens.shape[0], tokens.shape[1], llm.cache_dtype)
        lp, rank, top_ids, top_lp = map(np.asarray, llm.programs(
            engine.prompt_logprobs, llm.params, cache, tokens, lengths, config=llm.config,
            top_n=width, backend=llm.backend))
        for r, i in enumerate(group):
            entries: list = [None]
            for t, token in enumerate(rows[i][1:]):
                top = [(int(a), float(b)) for a, b in zip(top_ids[r, t, :top_n], top_lp[r, t, :top_n])
                       if a >= 0]
                entries.append(PromptLogprob(int(token), float(lp[r, t]), int(rank[r, t]), top))
            out[i] = entries
    return out


def score(llm, prompts, continuations, chat: bool) -> list[float]:
    """`LLM.score` (its docstring has the contract): one forward returns every
    position's log-probs (`engine.phases.token_logprobs`), each continuation
    summed by teacher forcing."""
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
    rows = [(llm.encode_prompt(p, chat), _continuation_ids(llm, c))
            for p, c in zip(prompts, continuations)]
    for row, (p, c) in enumerate(rows):
        if len(p) + len(c) > llm.max_seq_len:
            raise ValueError(f"row {row}: prompt {len(p)} + continuation {len(c)} tokens exceed "
                             f"max_seq_len {llm.max_seq_len}")
    llm.controls.check_awake(llm.params is None)
    full = [p + c for p, c in rows]
    tokens, lengths = pad_rows(full, batch_bucket(len(full)),
                               llm.buckets.prompt_bucket(max(map(len, full))))
    cache = init_cache(llm.config, tokens.shape[0], tokens.shape[1], llm.cache_dtype)
    logp = np.asarray(llm.programs(engine.token_logprobs, llm.params, cache, tokens, lengths,
                                   config=llm.config, backend=llm.backend))
    return [float(logp[row, len(p) - 1:len(p) + len(c) - 1].sum())
            for row, (p, c) in enumerate(rows)]


def _continuation_ids(llm, continuation) -> list[int]:
    if isinstance(continuation, str):
        if llm.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: pass token ids")
        ids = llm.tokenizer.encode(continuation, add_special_tokens=False)
    else:
        ids = [int(i) for i in continuation]
    if not ids:
        raise ValueError("empty continuation: nothing to score")
    return llm.encode_prompt(ids)
