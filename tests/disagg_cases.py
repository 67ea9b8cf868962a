"""Disaggregation cases run in subprocesses with forced CPU devices
(`multidevice.run_case`); each returns JSON for the test to assert on."""

from __future__ import annotations

import time

import jax

from jaxinfer import sharding
from jaxinfer.disagg import make_scheduler
from jaxinfer.disagg.local import ThreadPrefillClient
from jaxinfer.llm import LLM
from jaxinfer.params import prepare_params
from jaxinfer.request import Request
from jaxinfer.sampling import SamplingParams
from tiny import random_params
from tp_cases import CONFIGS

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
GREEDY = SamplingParams()
# (prompt, sampling, max_new_tokens): prompts longer than the tiny Gemma's window (4)
REQUESTS = [(list(range(3, 30)), GREEDY, 14), ([5, 9, 2, 7, 7, 1], SEEDED, 12),
            (list(range(40, 10, -1)), SEEDED, 16), ([8, 8, 3, 90, 4, 4, 4, 6, 1], GREEDY, 10)]
LLM_KWARGS = dict(max_seq_len=64, min_kv_bucket=32, decode_chunk=4, prefill_chunk_size=None,
                  max_num_seqs=4)


def _colocated(config, params) -> list:
    ref = LLM(config, prepare_params(params, config, pack=False), **LLM_KWARGS)
    out = ref.generate([p for p, _, _ in REQUESTS], [s for _, s, _ in REQUESTS],
                       max_new_tokens=[m for _, _, m in REQUESTS], ignore_eos=True)
    return [c.token_ids for c in out]


def drive(scheduler, requests, late: int = 1, timeout_s: float = 300.0) -> dict:
    """Add all but the last `late` requests, step until something decodes,
    add the rest (they arrive while others decode), run to the end.
    Returns {request index: (token ids, finish reason, error)}."""
    out, ids = {}, {}

    def add(i):
        ids[scheduler.add_request(requests[i])] = i

    for i in range(len(requests) - late):
        add(i)
    deadline = time.monotonic() + timeout_s
    added = len(requests) - late
    while scheduler.has_unfinished() or added < len(requests):
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests did not finish within {timeout_s} s")
        if added < len(requests) and scheduler.num_running > 0:
            add(added)
            added += 1
        for event in scheduler.step():
            tokens, _, _ = out.get(ids[event.request_id], ([], None, None))
            out[ids[event.request_id]] = (tokens + event.token_ids, event.finish_reason,
                                          getattr(event, "error", None))
    return {str(i): v for i, v in sorted(out.items())}


def device_sets(model: str, prefill_tp: int, decode_tp: int) -> dict:
    """Prefill on devices [0, prefill_tp), decode on the next decode_tp
    devices of this process; outputs of both and of the colocated engine."""
    n = prefill_tp + decode_tp
    if len(jax.local_devices()) < n:
        return {"skip": f"needs {n} devices"}
    config = CONFIGS[model]
    params = random_params(config, seed=11)
    devs = jax.local_devices()
    mesh_a = sharding.make_mesh(prefill_tp, devices=devs[:prefill_tp])
    mesh_b = sharding.make_mesh(decode_tp, devices=devs[prefill_tp:n])
    prefill_llm = sharding.tensor_parallel_llm(config, params, None, mesh_a, **LLM_KWARGS)
    decode_llm = sharding.tensor_parallel_llm(config, params, None, mesh_b, **LLM_KWARGS)
    client = ThreadPrefillClient([prefill_llm])
    scheduler = make_scheduler(decode_llm, client, 4)
    requests = [Request(p, s, m, ignore_eos=True) for p, s, m in REQUESTS]
    got = drive(scheduler, requests)
    client.close()
    cache = scheduler.runner.state.cache
    return {"disaggregated": got, "colocated": _colocated(config, params),
            "held": client.transport().num_held, "in_flight": scheduler.num_in_flight,
            "slots": [s is not None for s in scheduler.slots],
            "transfers": scheduler.transfers,
            "decode_devices": sorted(d.id for d in cache.layers[0].keys.sharding.device_set),
            "decode_mesh": [d.id for d in mesh_b.devices.flat],
            "kv_repeat": [prefill_llm.sharding_plan.kv_repeat, decode_llm.sharding_plan.kv_repeat]}
