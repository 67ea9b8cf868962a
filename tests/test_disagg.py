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


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gemma3", 1, 2), ("gemma3", 2, 1),
                                                        ("llama", 1, 1), ("smollm2_heads", 3, 1)])
def test_device_sets_match_colocated(model, prefill_tp, decode_tp):
    r = run_case(4, "disagg_cases", "device_sets", model=model, prefill_tp=prefill_tp,
                 decode_tp=decode_tp)
    got = r["disaggregated"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert all(got[k][1] == "length" for k in got)
    assert r["held"] == 0 and r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0}
    assert not any(r["slots"])
    assert r["decode_devices"] == sorted(r["decode_mesh"])       # the KV really lives on mesh B
    assert len(r["transfers"]) == len(r["colocated"]) and all(t["bytes"] > 0 for t in r["transfers"])


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
    assert r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0} and r["reserved"] == 0
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
    assert r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0} and r["reserved"] == 0
    assert not any(r["slots"])


def test_prefill_worker_interleaves_pieces_round_robin():
    """A short prompt added while a long one is being prefilled finishes
    after one piece of the long one, not after all of it; the first tokens
    are the colocated engine's (same pieces of prefill_chunk_size)."""
    from jaxinfer.parallel.disagg.transfer import LocalTransport
    from jaxinfer.parallel.disagg.worker import PrefillWorker
    from jaxinfer.serving.llm import LLM
    from jaxinfer.serving.request import Request
    from tiny import TINY_GEMMA3, random_params

    kwargs = dict(max_seq_len=64, min_kv_bucket=32, decode_chunk=4, prefill_chunk_size=8)
    llm = LLM(TINY_GEMMA3, random_params(TINY_GEMMA3, seed=2), **kwargs)
    transport = LocalTransport()
    worker = PrefillWorker(llm, transport)
    long, short = Request(list(range(3, 40)), max_new_tokens=4), Request([7, 8, 9], max_new_tokens=4)
    worker.add(0, long)
    results = worker.step()                                # the long prompt's first piece
    worker.add(1, short)
    steps = 1
    while worker.busy:
        results += worker.step()
        steps += 1
        assert steps < 20
    assert [r.request_id for r in results] == [1, 0] and steps == 6   # 37 tokens: 5 pieces of 8
    assert transport.num_held == 2
    import jax

    first = {r.request_id: int(transport.receive(r.ticket, jax.devices()[0]).wait(30).result()[1].token[0, 0])
             for r in results}
    want = [c.token_ids[0] for c in llm.generate([long.prompt_ids, short.prompt_ids], max_new_tokens=1)]
    assert [first[0], first[1]] == want


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
