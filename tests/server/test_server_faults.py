"""One request's fault never stops the server (`serving.faults`): on the
toy over real HTTP, a request whose token processing raises answers 500
with OpenAI's error JSON (streamed: an error event, then [DONE]) while
concurrent requests get exactly their fault-free text; a fault in a step
shared by every row fails the requests in it and the server answers the
next ones; every slot and page is free afterwards."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from jaxinfer.serving import request as request_module  # noqa: E402
from jaxinfer.serving.llm import LLM  # noqa: E402
from jaxinfer.server import ServerThread, build_server  # noqa: E402
from toy_server import assert_idle_and_clean  # noqa: E402

SLOTS = 4
FAULTY_MAX_TOKENS = 7          # the request the fault is injected into is the one asking for 7
CASES = [("你好", 12), ("我爱", 20), ("世界", 9)]


@pytest.fixture(scope="module")
def served(toy_folder):
    llm = LLM.load(str(toy_folder), max_seq_len=32, decode_chunk=4, max_num_seqs=SLOTS,
                   prefill_chunk_size=8, progress=False, load_cache=False)
    server = build_server(llm, model_name="toy", max_num_seqs=SLOTS, max_waiting_requests=32,
                          warmup=True)
    with ServerThread(server.app) as url:
        yield server, url


def _body(prompt, max_tokens, stream=False):
    return {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}


async def _post_all(url, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.wait_for(asyncio.gather(
            *(client.post("/v1/completions", json=b) for b in bodies)), 300)


def _texts(responses):
    return [r.json()["choices"][0]["text"] for r in responses]


def test_one_request_s_fault_is_its_500_and_the_others_are_unchanged(served, monkeypatch):
    server, url = served
    want = _texts(asyncio.run(_post_all(url, [_body(p, n) for p, n in CASES])))
    add = request_module.RequestState.add

    def faulty(self, token, logprob=None):
        if self.request.max_new_tokens == FAULTY_MAX_TOKENS and len(self.token_ids) == 1:
            raise RuntimeError("injected stop-string fault")
        add(self, token, logprob)
    monkeypatch.setattr(request_module.RequestState, "add", faulty)

    bodies = [_body(p, n) for p, n in CASES]
    bodies.insert(1, _body("大家好", FAULTY_MAX_TOKENS))
    responses = asyncio.run(_post_all(url, bodies))
    failed = responses.pop(1)
    assert failed.status_code == 500
    assert failed.json() == {"error": {
        "message": "the request failed: processing its tokens: RuntimeError: injected stop-string fault",
        "type": "server_error", "param": None, "code": "request_failed"}}
    assert [r.status_code for r in responses] == [200] * 3 and _texts(responses) == want

    with httpx.stream("POST", url + "/v1/completions", json=_body("大家好", FAULTY_MAX_TOKENS, True),
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:]) == failed.json()          # the same error, as an event
    assert all("error" not in json.loads(line[6:]) for line in lines[:-2])

    monkeypatch.setattr(request_module.RequestState, "add", add)
    again = asyncio.run(_post_all(url, [_body(p, n) for p, n in CASES]))
    assert _texts(again) == want
    assert_idle_and_clean(server)


def test_a_shared_step_fault_fails_its_rows_and_the_server_answers_the_next(served, monkeypatch):
    server, url = served
    want = _texts(asyncio.run(_post_all(url, [_body(p, n) for p, n in CASES])))
    runner = server.engine.engine.scheduler.runner
    step, fired = runner.step, []

    def faulty(segments, tables, num_logprobs=-1):
        if not fired and any(len(s.tokens) == 3 for s in segments):     # 大家好's prompt chunk
            fired.append(True)
            raise RuntimeError("injected step fault")
        return step(segments, tables, num_logprobs)
    monkeypatch.setattr(runner, "step", faulty)
    [failed] = asyncio.run(_post_all(url, [_body("大家好", 5)]))
    assert fired == [True] and failed.status_code == 500
    assert failed.json()["error"] == {
        "message": "the request failed: the engine step failed: RuntimeError: injected step fault",
        "type": "server_error", "param": None, "code": "request_failed"}
    again = asyncio.run(_post_all(url, [_body(p, n) for p, n in CASES]))
    assert [r.status_code for r in again] == [200] * 3 and _texts(again) == want
    assert_idle_and_clean(server)


def _sse_lines(url, body):
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_a_streamed_request_whose_step_fails_in_fetch_ends_with_an_error_event(served, monkeypatch):
    """A fault while reading a step's outputs (`ModelRunner.fetch`, where a
    kernel's check surfaces) ends a streamed request with OpenAI's error
    object in a `data:` line before `[DONE]`, never with `[DONE]` alone."""
    server, url = served
    runner = server.engine.engine.scheduler.runner
    fetch, fired = runner.fetch, []

    def faulty(dispatched):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected fetch fault")
        return fetch(dispatched)
    monkeypatch.setattr(runner, "fetch", faulty)
    lines = _sse_lines(url, _body("大家好", 5, stream=True))
    assert fired == [True] and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"] == {
        "message": "the request failed: the engine step failed: RuntimeError: injected fetch fault",
        "type": "server_error", "param": None, "code": "request_failed"}
    monkeypatch.undo()
    again = asyncio.run(_post_all(url, [_body(p, n) for p, n in CASES]))
    assert [r.status_code for r in again] == [200] * 3
    assert_idle_and_clean(server)
