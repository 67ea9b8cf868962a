"""The offline engine of `LLM.generate` and `LLM.stream`: validated
`Request`s from prompts and settings, and a run of them to their end on the
LLM's own scheduler (on the calling thread), gathered into `Completion`s.
"""

from __future__ import annotations

import dataclasses
from typing import Generator, Optional, Sequence

import numpy as np

from jaxinfer import sampling
from jaxinfer.serving.request import Request, RequestOutput, per_row
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.stats import RunStats


@dataclasses.dataclass
class Completion:
    """One request's result.

    Attributes:
      prompt_token_ids: the prompt as fed to the model.
      token_ids: generated ids, including a final stop token when one ended it.
      text: detokenized generated text, stop token and stop string excluded.
      finish_reason: "stop" (stop token or stop string), "length", or "abort"
        (`LLM.pause("abort")` ended it).
      logprobs: per generated token (token_id, logprob, [(alt_id, alt_logprob), ...])
        when requested, else None. Log-probs are of the model's raw distribution.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: Optional[list] = None


def requests(llm, prompts, sampling_params, max_new_tokens, chat: bool, stop: Sequence[str],
             logprobs: Optional[int], min_tokens, ignore_eos) -> list[Request]:
    """`LLM.requests` (its docstring, and `LLM.generate`'s, have the contract)."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list; wrap a single prompt in [...]")
    n = len(prompts)
    if n == 0:
        raise ValueError("no prompts given")
    ids = [llm.encode_prompt(p, chat) for p in prompts]
    params = per_row(sampling_params, n, "sampling_params") or [sampling.SamplingParams()] * n
    budgets = per_row(max_new_tokens, n, "max_new_tokens")
    mins = per_row(min_tokens, n, "min_tokens")
    ignores = per_row(ignore_eos, n, "ignore_eos")
    out = []
    for row, (p, m) in enumerate(zip(ids, budgets)):
        if isinstance(m, (int, np.integer)) and m >= 1 and len(p) + m > llm.max_seq_len:
            raise ValueError(
                f"row {row}: prompt length {len(p)} + max_new_tokens {m} = {len(p) + m} exceeds "
                f"max_seq_len {llm.max_seq_len}; shorten the prompt, lower max_new_tokens "
                "or raise max_seq_len")
        try:
            if params[row].structured is not None and llm.grammars is not None:
                llm.grammars.compile(params[row].structured)    # a bad constraint fails here
            out.append(Request(p, params[row], int(m), int(mins[row]), bool(ignores[row]),
                               tuple(stop), logprobs))
        except (ValueError, TypeError) as e:
            raise type(e)(f"row {row}: {e}") from None
    return out


def run(llm, scheduler: Scheduler, requests: Sequence[Request], stream: bool = False
        ) -> Generator[tuple[int, RequestOutput], None, list[Completion]]:
    """Run `requests` to their end on `scheduler` (the LLM's offline one),
    the LLM unpaused; yields (index in requests, event) and returns their
    `Completion`s in order. Sets `llm.last_stats`. A pause in "abort" mode
    (`llm.controls.abort`) aborts every request; a stream's reader that
    stops reading holds no pause up meanwhile."""
    compile_before = llm.programs.compile_s
    pool = scheduler.kv_pages
    queried, hit, preempted = pool.query_tokens, pool.hit_tokens, scheduler.num_preempted
    steps = scheduler.runner.decode_steps
    index = {scheduler.add_request(r, stream=stream): i for i, r in enumerate(requests)}
    parts = [dict(tokens=[], text=[], logprobs=[], reason=None, timings=None, spec=None)
             for _ in requests]
    while scheduler.has_unfinished():
        if llm.controls.abort:         # pause("abort"): every request ends with "abort"
            for rid in index:
                scheduler.abort(rid)
        for event in scheduler.step():
            i = index[event.request_id]
            acc = parts[i]
            acc["tokens"] += event.token_ids
            acc["text"].append(event.text)
            acc["logprobs"] += event.logprobs or []
            acc["reason"], acc["timings"], acc["spec"] = event.finish_reason, event.timings, event.spec
            if not stream:
                yield i, event
                continue
            # A stream's reader may stop reading for a while: it holds no pause up
            # meanwhile (`generate` reads on, so its requests finish under pause "wait").
            with llm.controls.suspended() as aborted:
                yield i, event
            if aborted():
                for rid in index:
                    scheduler.abort(rid)
    steps = scheduler.runner.decode_steps - steps
    llm.last_stats = RunStats.from_requests(
        [len(r.prompt_ids) for r in requests], [p["tokens"] for p in parts],
        [p["timings"] for p in parts], compile_s=llm.programs.compile_s - compile_before,
        decode_steps=steps, spec=[p["spec"] for p in parts])
    llm.last_stats = dataclasses.replace(
        llm.last_stats, prefix_query_tokens=pool.query_tokens - queried,
        prefix_hit_tokens=pool.hit_tokens - hit, num_pages=pool.num_pages,
        num_preempted=scheduler.num_preempted - preempted)
    return [Completion(list(r.prompt_ids), p["tokens"], "".join(p["text"]), p["reason"],
                       p["logprobs"] if r.logprobs is not None else None)
            for r, p in zip(requests, parts)]
