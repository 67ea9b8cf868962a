"""Prefill/decode disaggregation (`jaxinfer.parallel.disagg`) against the colocated
engine: identical greedy and seeded tokens (prompts longer than the tiny
Gemma's window, a request arriving while others decode), nothing left held
or reserved afterwards; on one host with separate device sets (different
tp on the two sides) and across processes (jax.distributed on 127.0.0.1,
jax.experimental.transfer), and a prefill process killed mid-request.
"""

from __future__ import annotations

import os

import pytest

from multidevice import run_case


@pytest.mark.slow
@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gemma3", 1, 2), ("gemma3", 2, 1),
                                                        ("llama", 1, 1), ("smollm2_heads", 3, 1)])
def test_device_sets_match_colocated(model, prefill_tp, decode_tp):
    r = run_case(4, "disagg_cases", "device_sets", model=model, prefill_tp=prefill_tp,
                 decode_tp=decode_tp)
    got = r["disaggregated"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert all(got[k][1] == "length" for k in got)
    assert r["held"] == 0 and r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0}
    assert not any(r["slots"]) and r["waiting"] == 0 and r["pages_used"] == 0
    assert r["decode_devices"] == sorted(r["decode_mesh"])       # the KV really lives on mesh B
    assert len(r["transfers"]) == len(r["colocated"]) and all(t["bytes"] > 0 for t in r["transfers"])


@pytest.mark.slow
@pytest.mark.parametrize("model,prefill_tp,decode_tp,devices", [("gemma3", 2, 1, 4), ("llama", 2, 4, 6)])
def test_int8_pages_keep_their_scales_across_tp(model, prefill_tp, decode_tp, devices):
    """An int8 KV cache, prefill and decode at different tp: the tiny Gemma
    3's one KV head stored twice at tp = 2 and once at tp = 1; the tiny
    Llama's two KV heads once at tp = 2 and twice at tp = 4 (its scales
    split by heads there). The pages cross with their scales and the
    greedy and seeded tokens are the colocated int8 engine's."""
    r = run_case(devices, "disagg_cases", "device_sets", model=model, prefill_tp=prefill_tp,
                 decode_tp=decode_tp, kv_cache_dtype="int8")
    got = r["disaggregated"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert all(got[k][1] == "length" for k in got)
    assert r["kv_repeat"] == ([2, 1] if model == "gemma3" else [1, 2])
    assert r["scales_sharding"] == (["P()"] if decode_tp == 1 else ["P(None, 'tp')"])   # trailing None dropped
    assert r["held"] == 0 and not any(r["slots"]) and r["pages_used"] == 0


@pytest.mark.slow
def test_two_prefill_workers_share_the_requests():
    r = run_case(4, "disagg_cases", "device_sets", model="gemma3", prefill_tp=1, decode_tp=2,
                 prefill_workers=2)
    got = r["disaggregated"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert r["workers_used"] == [0, 1] and r["held"] == 0 and not any(r["slots"])


@pytest.mark.slow      # processes: jax.distributed start-up and a compile per process (~30 s each)
@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gemma3", 1, 2), ("llama", 2, 1)])
def test_processes_match_colocated(tmp_path, model, prefill_tp, decode_tp):
    """jax.distributed on 127.0.0.1, KV pulled with jax.experimental.transfer;
    different tp in the two processes (Gemma: its one KV head repeated on
    the decode side; Llama: no sliding layers, an empty ring_pos)."""
    r = run_case(2, "disagg_cases", "processes", timeout_s=900, prefill_tp=prefill_tp,
                 decode_tp=decode_tp, kill=False, log_dir=str(tmp_path), model=model)
    got = r["outcomes"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert all(v[1] == "length" for v in got.values())
    assert r["health"]["prefill"][0]["held"] == 0            # every pull acknowledged and freed
    assert r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0} and r["waiting"] == 0
    assert not any(r["slots"])


@pytest.mark.slow
def test_killed_prefill_process_fails_only_its_request(tmp_path):
    """SIGKILL the prefill process while it prefills one request: that request
    fails with a clear error; the request queued behind it is prefilled by
    the restarted worker; the decoding ones finish; nothing stays reserved
    or held."""
    r = run_case(2, "disagg_cases", "processes", timeout_s=900, prefill_tp=1, decode_tp=1, kill=True,
                 log_dir=str(tmp_path))
    got, want = r["outcomes"], r["colocated"]
    tokens, reason, error = got["2"]
    assert reason == "error" and tokens == []
    assert f"prefill worker 0 (pid {r['killed_pid']}) exited with code -9 while prefilling" in error
    assert [got[k][0] for k in ("0", "1", "3")] == want[:3]     # REQUESTS[0], [1], [2]
    assert all(got[k][1] == "length" for k in ("0", "1", "3"))
    worker = r["health"]["prefill"][0]
    assert worker["restarts"] == 1 and worker["state"] == "up" and worker["held"] == 0
    assert r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0} and r["waiting"] == 0
    assert not any(r["slots"])



@pytest.mark.slow
@pytest.mark.parametrize("heartbeat_s,stall_s", [(None, 15.0), (2, 6.0)])
def test_a_stalled_prefill_process_outlives_the_heartbeat_only_when_it_is_long(heartbeat_s, stall_s):
    """A prefill process stopped (SIGSTOP) for 15 s, past the old 10 s
    heartbeat timeout, survives the default one: not restarted, every
    request as colocated. The control, a 2 s timeout and a 6 s stall, is
    the abort of issue 29: the coordination service declares the worker
    dead, JAX aborts it (SIGABRT) when it runs again, the supervisor
    restarts it, and the later requests still finish."""
    r = run_case(1, "disagg_cases", "processes_stalled", timeout_s=900, stall_s=stall_s,
                 heartbeat_s=heartbeat_s)
    got = r["outcomes"]
    assert [got[str(i)][0] for i in range(4)] == r["colocated"]
    assert all(v[1] == "length" for v in got.values())
    worker = r["worker"]
    if heartbeat_s is None:
        assert (worker["restarts"], worker["last_exit"], worker["pid"]) == (0, None, r["stalled_pid"])
    else:
        assert (worker["restarts"], worker["last_exit"]) == (1, -6) and worker["pid"] != r["stalled_pid"]
    assert worker["state"] == "up"

@pytest.mark.slow
def test_prefill_worker_runs_every_request_s_chunk_in_one_step():
    """A short prompt added while a long one is being prefilled runs its
    chunk in the long one's next step and is offered after it, not after
    the whole long prompt; the first tokens (and log-probs) are the
    colocated engine's, the offered pages are the prompt's, padded to a
    power of two, and the worker's slots and pages are free afterwards."""
    import jax

    from jaxinfer.parallel.disagg.transfer import LocalTransport
    from jaxinfer.parallel.disagg.worker import PrefillWorker
    from jaxinfer.serving.llm import LLM
    from jaxinfer.serving.request import Request
    from tiny import TINY_GEMMA3, random_params

    kwargs = dict(max_seq_len=64, decode_chunk=4, prefill_chunk_size=8, page_size=4)
    llm = LLM(TINY_GEMMA3, random_params(TINY_GEMMA3, seed=2), **kwargs)
    transport = LocalTransport()
    worker = PrefillWorker(llm, transport)
    long = Request(list(range(3, 40)), max_new_tokens=4, logprobs=2)
    short = Request([7, 8, 9], max_new_tokens=4)
    worker.add(0, long)
    results = [(1, r) for r in worker.step()]              # the long prompt's first chunk
    worker.add(1, short)
    steps = 1
    while worker.busy:
        steps += 1
        results += [(steps, r) for r in worker.step()]
        assert steps < 20
    assert [(step, r.request_id) for step, r in results] == [(2, 1), (5, 0)]   # 37 tokens: 5 chunks of 8
    assert transport.num_held == 2 and not any(worker.slots) and worker.pages.pool.num_used == 0
    got = {r.request_id: transport.receive(r.ticket, jax.devices()[0]).wait(30).result()
           for _, r in results}
    assert [int(got[0]["length"]), int(got[1]["length"])] == [37, 3]
    assert [got[0]["pages"][0].keys.shape[0], got[1]["pages"][0].keys.shape[0]] == [16, 1]   # 10 and 1 pages
    want = llm.generate([long.prompt_ids, short.prompt_ids], max_new_tokens=1, logprobs=2)
    assert [int(got[0]["token"]), int(got[1]["token"])] == [c.token_ids[0] for c in want]
    _, logprob, alternatives = want[0].logprobs[0]
    assert abs(float(got[0]["logprob"]) - logprob) <= 1e-5
    assert [int(i) for i in got[0]["top_ids"][:2]] == [i for i, _ in alternatives]
    assert "logprob" not in got[1]


@pytest.mark.slow
def test_serve_with_a_prefill_worker_process(toy_folder, tmp_path):
    """`jaxinfer serve --prefill-workers 1`: the OpenAI server over a prefill
    process and this decode process answers as the toy does colocated
    ("你好" -> "世界", the test_server expectation), streamed and not;
    /health lists the worker; SIGTERM stops the server and its worker, and
    the worker's (empty) log folder goes with them."""
    import signal
    import time

    import httpx
    import openai
    from serve_process import start_serve, stop

    cfg = tmp_path / "toy-disagg.yaml"
    cfg.write_text(f"model: {toy_folder}\nmax_seq_len: 32\ndecode_chunk: 4\nmax_num_seqs: 2\n"
                   "chat: false\nwarmup: false\n", encoding="utf-8")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "JAXINFER_LOAD_CACHE": "0", "TMPDIR": str(tmp)}
    proc, url = start_serve(["--config", str(cfg), "--prefill-workers", "1"], 600, env=env)
    assert [p.name[:17] for p in tmp.glob("jaxinfer-prefill-*")] == ["jaxinfer-prefill-"]
    try:
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "ok" and [w["state"] for w in health["prefill"]] == ["up"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = str(toy_folder)
        assert client.completions.create(model=model, prompt="你好", max_tokens=3).choices[0].text == "世界"
        pieces = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="你好", max_tokens=3, stream=True) if c.choices]
        assert "".join(pieces) == "世界"
        deadline = time.monotonic() + 60       # the worker frees a KV once the pull is acknowledged
        while (held := httpx.get(url + "/health", timeout=30).json()["prefill"][0]["held"]) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert held == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert not list(tmp.glob("jaxinfer-prefill-*"))      # its empty log folder removed
    finally:
        stop(proc)
