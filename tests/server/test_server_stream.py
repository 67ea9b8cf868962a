"""Streaming through `jaxinfer serve` on the trained toy: every generated
token leaves as its own Server-Sent Event, also while other requests decode
beside it and a long prompt is prefilled in the same steps."""

import json
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from jaxinfer.serving.llm import LLM  # noqa: E402
from jaxinfer.server import ServerThread, build_server  # noqa: E402


@pytest.fixture(scope="module")
def url(toy_folder):
    llm = LLM.load(str(toy_folder), max_seq_len=32, max_num_seqs=4, prefill_chunk_size=4,
                   max_num_batched_tokens=16, progress=False, load_cache=False)
    server = build_server(llm, model_name="toy", max_num_seqs=4, max_waiting_requests=8)
    with ServerThread(server.app) as url:
        yield url


def _stream(url, prompt, max_tokens, out):
    """POST a streamed completion with log-probs; append (the tokens of each
    event that carries any, usage) to out. (Text alone cannot tell: the toy
    emits special tokens whose text is empty.)"""
    body = {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
            "logprobs": 0}
    chunks, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                tokens = (choice.get("logprobs") or {}).get("tokens")
                if tokens:
                    chunks.append(tokens)
    out.append((chunks, usage))


def test_each_token_is_its_own_event(url):
    out = []
    _stream(url, "你好", 10, out)
    [(chunks, usage)] = out
    assert usage["completion_tokens"] == 10 and [len(c) for c in chunks] == [1] * 10


def test_each_token_is_its_own_event_under_load(url):
    """Three streams at once and a prompt that takes several steps to
    prefill: still one event per token for every stream."""
    out = []
    threads = [threading.Thread(target=_stream, args=(url, p, n, out))
               for p, n in (("你好", 12), ("我们", 12), ("你们好", 9), ("好" * 20, 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == 4
    for chunks, usage in out:
        assert [len(c) for c in chunks] == [1] * usage["completion_tokens"]
    assert sorted(usage["completion_tokens"] for _, usage in out) == [6, 9, 12, 12]
