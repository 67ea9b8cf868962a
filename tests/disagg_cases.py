"""Disaggregation cases run in subprocesses with forced CPU devices
(`multidevice.run_case`); each returns JSON for the test to assert on."""

from __future__ import annotations

import time

import jax

from jaxinfer.parallel import sharding
from jaxinfer.parallel.disagg import make_scheduler
from jaxinfer.parallel.disagg.local import ThreadPrefillClient
from jaxinfer.serving.llm import LLM
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.serving.request import Request
from jaxinfer.sampling import SamplingParams
from tiny import random_params
from tp_cases import CONFIGS

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
GREEDY = SamplingParams()
# (prompt, sampling, max_new_tokens): prompts longer than the tiny Gemma's window (4)
REQUESTS = [(list(range(3, 30)), GREEDY, 14), ([5, 9, 2, 7, 7, 1], SEEDED, 12),
            (list(range(40, 10, -1)), SEEDED, 16), ([8, 8, 3, 90, 4, 4, 4, 6, 1], GREEDY, 10)]
LLM_KWARGS = dict(max_seq_len=64, decode_chunk=4, prefill_chunk_size=None,
                  max_num_seqs=4)


def _colocated(config, params, kv_cache_dtype=None) -> list:
    ref = LLM(config, prepare_params(params, config, pack=False), **LLM_KWARGS,
              kv_cache_dtype=kv_cache_dtype)
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


def device_sets(model: str, prefill_tp: int, decode_tp: int, prefill_workers: int = 1,
                kv_cache_dtype=None) -> dict:
    """`prefill_workers` prefill workers on devices [0, prefill_tp), [prefill_tp,
    2 prefill_tp), ..., decode on the next decode_tp devices of this
    process; outputs of both and of the colocated engine (the same
    kv_cache_dtype on every side)."""
    n = prefill_tp * prefill_workers + decode_tp
    if len(jax.local_devices()) < n:
        return {"skip": f"needs {n} devices"}
    config = CONFIGS[model]
    params = random_params(config, seed=11)
    kwargs = dict(LLM_KWARGS, kv_cache_dtype=kv_cache_dtype)
    devs = jax.local_devices()
    meshes_a = [sharding.make_mesh(prefill_tp, devices=devs[i * prefill_tp:(i + 1) * prefill_tp])
                for i in range(prefill_workers)]
    mesh_b = sharding.make_mesh(decode_tp, devices=devs[n - decode_tp:n])
    prefill_llms = [sharding.tensor_parallel_llm(config, params, None, m, **kwargs) for m in meshes_a]
    decode_llm = sharding.tensor_parallel_llm(config, params, None, mesh_b, **kwargs)
    prefill_llm = prefill_llms[0]
    client = ThreadPrefillClient(prefill_llms)
    scheduler = make_scheduler(decode_llm, client, 4)
    requests = [Request(p, s, m, ignore_eos=True) for p, s, m in REQUESTS]
    got = drive(scheduler, requests)
    client.close()
    cache = scheduler.runner.cache
    return {"disaggregated": got, "colocated": _colocated(config, params, kv_cache_dtype),
            "held": client.transport().num_held, "in_flight": scheduler.num_in_flight,
            "waiting": scheduler.num_waiting, "pages_used": scheduler.kv_pages.num_used,
            "slots": [s is not None for s in scheduler.slots],
            "transfers": scheduler.transfers,
            "workers_used": sorted({t["worker"] for t in scheduler.transfers}),
            "decode_devices": sorted(d.id for d in cache.layers[0].keys.sharding.device_set),
            "decode_mesh": [d.id for d in mesh_b.devices.flat],
            "scales_sharding": [str(kv.key_scale.sharding.spec) if kv.key_scale is not None else None
                                for kv in cache.layers[:1]],
            "kv_repeat": [prefill_llm.sharding_plan.kv_repeat, decode_llm.sharding_plan.kv_repeat]}


# --- processes -----------------------------------------------------------------------------------

STALL_PROMPT = list(range(60, 91))            # 31 tokens: the prompt a worker stalls on


def tiny_gemma3():
    """(config, params, tokenizer) for worker processes (`WorkerSpec.factory`)."""
    return CONFIGS["gemma3"], random_params(CONFIGS["gemma3"], seed=11), None


def tiny_llama():
    """As `tiny_gemma3`, a model without sliding layers."""
    return CONFIGS["llama"], random_params(CONFIGS["llama"], seed=11), None


def _collect(engine, requests, late, deadline):
    """Submit requests (the `late` ones after the first tokens of the
    others), collecting events with callbacks; returns {index: [tokens,
    finish_reason, error]} once all finished or at the deadline."""
    import threading

    out, lock = {}, threading.Lock()

    def on_event(i):
        def f(event):
            with lock:
                tokens, _, _ = out.get(i, ([], None, None))
                if isinstance(event, BaseException):
                    out[i] = (tokens, "exception", repr(event))
                else:
                    out[i] = (tokens + event.token_ids, event.finish_reason, getattr(event, "error", None))
        return f

    early = [i for i in range(len(requests)) if i not in late]
    for i in early:
        engine.submit(requests[i], on_event(i))
    while not any(out.get(i, ([],))[0] for i in early):
        if time.monotonic() > deadline:
            raise RuntimeError("no first token before the deadline")
        time.sleep(0.01)
    return out, on_event


def _wait_all(out, n, deadline):
    while sum(v[1] is not None for v in out.values()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(out)} of {n} requests finished before the deadline: {out}")
        time.sleep(0.02)


def processes(prefill_tp: int, decode_tp: int, kill: bool, log_dir: str, model: str = "gemma3",
              timeout_s: float = 600.0) -> dict:
    """One prefill worker process and this process as the decode worker,
    a tiny model. With `kill`, a request whose prefill stalls is submitted
    while others decode, followed by another; the worker is SIGKILLed
    mid-prefill. Returns every request's outcome, the colocated tokens,
    and what is left held or reserved afterwards."""
    import os
    import signal

    from jaxinfer.parallel.disagg.engine import start_process_engine
    from jaxinfer.parallel.disagg.process import WorkerSpec, _kv, _try_get

    deadline = time.monotonic() + timeout_s
    common = dict(factory=f"disagg_cases:tiny_{model}", llm_kwargs=tuple(LLM_KWARGS.items()))
    prefill = WorkerSpec(tp=prefill_tp, stall_on_prompt_len=len(STALL_PROMPT) if kill else 0,
                         stall_s=120.0, **common)
    engine = start_process_engine([prefill], WorkerSpec(tp=decode_tp, **common), max_num_seqs=4,
                                  transfer_timeout_s=60.0, startup_timeout_s=300.0,
                                  log_dir=log_dir)
    try:
        requests = [Request(p, s, m, ignore_eos=True) for p, s, m in REQUESTS]
        late = [len(requests) - 1]
        if kill:
            requests = requests[:2] + [Request(STALL_PROMPT, GREEDY, 8, ignore_eos=True)] + requests[2:3]
            late = [2, 3]
        out, on_event = _collect(engine, requests, late, deadline)
        client = engine.client
        worker = client.workers[0]
        killed_pid = None
        for i in late:
            engine.submit(requests[i], on_event(i))
            if kill and i == 2:
                while True:                      # wait until the worker prefills the stalled request
                    if time.monotonic() > deadline:
                        raise RuntimeError("the stalled request never started")
                    seqs = [q for q, (_, r) in worker.sent.items() if r is requests[2]]
                    if seqs and _try_get(_kv(), f"{worker.ns}/started/{seqs[0]}") is not None:
                        break
                    time.sleep(0.01)
                killed_pid = worker.proc.pid
                os.kill(killed_pid, signal.SIGKILL)
        _wait_all(out, len(requests), deadline)
        while True:                              # the worker frees acknowledged KV (bounded)
            health = engine.health()
            held = health["prefill"][0]["held"]
            if (held == 0 and health["prefill"][0]["state"] == "up") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        config, params = CONFIGS[model], random_params(CONFIGS[model], seed=11)
        with jax.default_device(jax.local_devices()[0]):
            colocated = _colocated(config, params)
        s = engine.scheduler
        result = {"outcomes": {str(i): v for i, v in sorted(out.items())}, "colocated": colocated,
                  "health": health, "in_flight": s.num_in_flight, "waiting": s.num_waiting,
                  "slots": [x is not None for x in s.slots], "killed_pid": killed_pid,
                  "transfers": s.transfers}
    finally:
        engine.stop()
    return result


def processes_stalled(stall_s: float, heartbeat_s=None, timeout_s: float = 600.0) -> dict:
    """One prefill worker process (tiny Llama) and this process decoding:
    two requests finish, then the worker is stopped (SIGSTOP: starved of
    all CPU) for `stall_s` seconds and continued, then two more requests
    run once the worker is up (restarted, when it was aborted).
    `heartbeat_s` None = `process.DEFAULT_HEARTBEAT_S`. Returns every
    request's outcome, the colocated tokens, the stopped worker's pid and
    the worker's health. (An aborted decode process fails the case.)"""
    import os
    import signal

    from jaxinfer.parallel.disagg.engine import start_process_engine
    from jaxinfer.parallel.disagg.process import DEFAULT_HEARTBEAT_S, WorkerSpec

    deadline = time.monotonic() + timeout_s
    common = dict(factory="disagg_cases:tiny_llama", llm_kwargs=tuple(LLM_KWARGS.items()))
    engine = start_process_engine([WorkerSpec(**common)], WorkerSpec(**common), max_num_seqs=4,
                                  transfer_timeout_s=60.0, startup_timeout_s=300.0,
                                  heartbeat_s=heartbeat_s or DEFAULT_HEARTBEAT_S)
    try:
        requests = [Request(p, s, m, ignore_eos=True) for p, s, m in REQUESTS]
        out, on_event = _collect(engine, requests, [2, 3], deadline)
        _wait_all(out, 2, deadline)
        pid = engine.client.workers[0].proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stall_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(2.0)                  # an aborted worker is seen exiting, then restarted
        while engine.health()["prefill"][0]["state"] != "up":
            if time.monotonic() > deadline:
                raise RuntimeError("the prefill worker did not come back up")
            time.sleep(0.05)
        for i in (2, 3):
            engine.submit(requests[i], on_event(i))
        _wait_all(out, len(requests), deadline)
        config, params = CONFIGS["llama"], random_params(CONFIGS["llama"], seed=11)
        result = {"outcomes": {str(i): v for i, v in sorted(out.items())},
                  "colocated": _colocated(config, params), "stalled_pid": pid,
                  "worker": engine.health()["prefill"][0]}
    finally:
        engine.stop()
    return result
