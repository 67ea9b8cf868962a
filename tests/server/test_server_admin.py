"""The admin routes (`server.admin`): /pause, /resume, /sleep, /wake_up,
/reset_prefix_cache, /is_sleeping, /is_paused on a server of the tiny
model of examples/byo_model.py (it has a tokenizer),
behind the API key; a paused server holds new requests until /resume, a
sleeping one answers 503, and waking serves the same tokens."""

from __future__ import annotations

import pathlib
import threading
import time

import httpx
import pytest

from jaxinfer.server import ServerThread, build_server
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import import_python_file

KEY = "admin-key"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "byo_model.py"


@pytest.fixture(scope="module")
def served():
    config, params, tokenizer = import_python_file(EXAMPLE).build()
    llm = LLM(config, params, tokenizer, max_seq_len=160, max_num_seqs=2)
    server = build_server(llm, model_name=MODEL, max_num_seqs=2, max_waiting_requests=8,
                          api_key=KEY)
    with ServerThread(server.app) as url:
        yield llm, url


def _complete(url, max_tokens=6):
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "prompt": "Hello, world", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    return r


def test_admin_routes_need_the_api_key(served):
    _, url = served
    for method, path in (("post", "/pause"), ("post", "/resume"), ("post", "/sleep"),
                         ("post", "/wake_up"), ("post", "/reset_prefix_cache"),
                         ("get", "/is_sleeping"), ("get", "/is_paused")):
        r = getattr(httpx, method)(url + path, timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url + "/is_sleeping", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(url + "/is_sleeping", headers=AUTH, timeout=30).json() == {"is_sleeping": False}


def test_bad_fields_are_400s_naming_them(served):
    _, url = served
    r = httpx.post(url + "/pause", headers=AUTH, json={"mode": "later"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    r = httpx.post(url + "/sleep", headers=AUTH, json={"level": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"


def test_pause_holds_requests_until_resume(served):
    llm, url = served
    before = _complete(url).json()["choices"][0]["text"]
    r = httpx.post(url + "/pause", headers=AUTH, json={"mode": "wait"}, timeout=30)
    assert r.status_code == 200 and r.json()["is_paused"]
    assert httpx.get(url + "/is_paused", headers=AUTH, timeout=30).json() == {"is_paused": True}
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=_complete(url)))
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()                       # held while paused
    assert httpx.post(url + "/resume", headers=AUTH, timeout=30).status_code == 200
    thread.join(60)
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == before
    assert not llm.is_paused


def test_pause_abort_ends_a_running_request(served):
    llm, url = served
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=_complete(url, max_tokens=140)))
    thread.start()
    [engine] = list(llm.controls._engines)
    deadline = time.monotonic() + 30
    while not engine.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.002)                          # until the request decodes
    r = httpx.post(url + "/pause", headers=AUTH, json={"mode": "abort"}, timeout=30)
    assert r.status_code == 200
    thread.join(60)
    httpx.post(url + "/resume", headers=AUTH, timeout=30)
    assert not thread.is_alive()
    assert out["r"].status_code == 200            # answered, not dropped as a gone client's
    [choice] = out["r"].json()["choices"]
    assert choice["finish_reason"] == "abort"
    assert _complete(url).status_code == 200


def test_sleep_wake_up_and_reset_prefix_cache(served):
    llm, url = served
    before = _complete(url).json()["choices"][0]["text"]
    r = httpx.post(url + "/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["pages_freed"] >= 1
    r = httpx.post(url + "/sleep?level=1", headers=AUTH, timeout=30)
    assert r.status_code == 200 and llm.is_sleeping
    assert httpx.get(url + "/is_sleeping", headers=AUTH, timeout=30).json() == {"is_sleeping": True}
    asleep = _complete(url)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    r = httpx.post(url + "/wake_up", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["has_weights"]
    assert _complete(url).json()["choices"][0]["text"] == before
