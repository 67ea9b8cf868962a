"""What the multi-process tensor-parallel tests run in their processes
(tests/parallel/test_multiprocess.py): the tiny Llama of tests/tiny.py on a
tp=2 mesh, over two processes of a `jax.distributed` job (`rank`) or over
two forced host devices of one process (`reference`); both write the same
JSON (greedy tokens and log-probs, seeded sampled tokens)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time


from jaxinfer.config import SamplingParams
from tiny import TINY_LLAMA, random_params

PROMPTS = [[5, 9, 11, 3], [7, 1, 2, 8, 20, 30, 40], [60, 61, 62], [13] * 10]
# One step program per token bucket, one log-prob count, no decode loops: few compiles.
LLM_KWARGS = dict(max_seq_len=64, decode_chunk=1, prefill_chunk_size=None, max_num_seqs=4,
                  page_size=4, max_num_batched_tokens=4)
NEW_TOKENS = 12
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def tiny_llama():
    """(config, params, tokenizer): every process builds the same model."""
    return TINY_LLAMA, random_params(TINY_LLAMA, seed=3), None


def _results(llm) -> dict:
    greedy = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    seeds = [dataclasses.replace(SEEDED, seed=7 + i) for i in range(len(PROMPTS))]
    seeded = llm.generate(PROMPTS, seeds, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return {"greedy": [c.token_ids for c in greedy],
            "logprobs": [[lp for _, lp, _ in c.logprobs] for c in greedy],
            "seeded": [c.token_ids for c in seeded]}


def reference(out_path: str) -> None:
    """tp=2 over this process's two forced host devices."""
    from jaxinfer.parallel import sharding

    config, params, tok = tiny_llama()
    llm = sharding.tensor_parallel_llm(config, params, tok, sharding.make_mesh(2), **LLM_KWARGS)
    with open(out_path, "w") as f:
        json.dump(_results(llm), f)


def _refused(llm, params) -> list:
    """What process 0 refuses across processes: the error of a structured
    request, `score` and `update_weights` (None where one ran)."""
    from jaxinfer.config.sampling import StructuredOutput

    out = []
    for attempt in (lambda: llm.generate([PROMPTS[0]], SamplingParams(
                        structured=StructuredOutput(regex="a+")), max_new_tokens=2),
                    lambda: llm.score([PROMPTS[0]], [[1, 2]]),
                    lambda: llm.update_weights(params)):
        try:
            attempt()
            out.append(None)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _die_after(calls: int) -> None:
    """Process 1 SIGKILLs itself once it has replayed `calls` program calls."""
    from jaxinfer.parallel.multiprocess import follower

    replay, count = follower._replay, [0]

    def counted(*args):
        count[0] += 1
        if count[0] > calls:
            os.kill(os.getpid(), 9)
        return replay(*args)

    follower._replay = counted


def rank(coordinator: str, process_id: int, out_path: str, kill_after_calls: int = 0) -> int:
    """One process of a 2-process job (tp=2, one device each). Process 0
    writes the results to out_path and stops the job; with
    kill_after_calls, process 1 kills itself (SIGKILL) after replaying that
    many program calls, and process 0 serves requests through an engine
    thread until they fail, writing the errors its clients saw. Returns the exit code."""
    from jaxinfer.parallel import multiprocess
    from jaxinfer.serving.request import Request
    from jaxinfer.serving.thread import EngineThread

    settings = multiprocess.JobSettings(coordinator, 2, process_id, heartbeat_s=30,
                                        init_timeout_s=60)
    job, mesh = multiprocess.join(settings, tp=2)
    config, params, tok = tiny_llama()
    llm = multiprocess.job_llm(job, mesh, config, params, tok, **LLM_KWARGS)
    if process_id != 0:
        if kill_after_calls:
            _die_after(kill_after_calls)
        multiprocess.follow(llm, job)
        job.channel.say_bye()
        sys.stdout.flush()
        os._exit(0)
    if not kill_after_calls:
        refused = _refused(llm, params)        # first: the job goes on after each
        out = {**_results(llm), "refused": refused}
        missing = job.stop()
        with open(out_path, "w") as f:
            json.dump({**out, "missing": missing}, f)
        return 0
    engine = EngineThread(llm.scheduler(max_num_seqs=4)).start()
    errors, t0 = [], time.monotonic()
    while not errors and time.monotonic() - t0 < 120:
        handles = [engine.submit(Request(tuple(p), max_new_tokens=40, ignore_eos=True))
                   for p in PROMPTS]
        for handle in handles:
            try:
                for event in handle:
                    if event.finished and event.finish_reason == "error":
                        errors.append(event.error)
            except Exception as e:  # noqa: BLE001 - the engine stopped: what the client sees
                errors.append(f"{type(e).__name__}: {e}")
    with open(out_path, "w") as f:
        json.dump({"errors": errors, "engine_error": repr(engine.error),
                   "seconds": time.monotonic() - t0}, f)
    return 0


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "reference":
        reference(sys.argv[2])
    else:
        sys.exit(rank(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
