"""Odd HTTP inputs against `jaxinfer serve` on the trained toy (max_seq_len
32): each case found by a new-user run gets its exact 4xx error JSON
(status, param and message), and what OpenAI accepts is accepted."""

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from toy_server import CHAT, COMPLETIONS, MODEL, toy_server  # noqa: E402


@pytest.fixture(scope="module")
def url(toy_folder):
    with toy_server(toy_folder, max_waiting_requests=8) as (_, url):
        yield url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


def _post(http, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def _user(content):
    return [{"role": "user", "content": content}]


# --- the cases a new user met ---------------------------------------------------------------


ERRORS = [
    # OpenAI refuses null content in a user message ("expected a string, got null"); vLLM
    # would render it as "". The stricter answer names the fault.
    ("content null", CHAT, {"model": MODEL, "messages": _user(None)}, 400, "messages",
     "messages[0]: content must be a string or a list of text parts in a user message, got null"),
    ("content missing", CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "x"},
                                                            {"role": "user"}]},
     400, "messages", "messages[1]: content is required in a user message"),
    # "" is content (OpenAI and vLLM accept it); a prompt of nothing but "" has no tokens on a
    # model without BOS, and that is what the error says.
    ("content empty, nothing else", CHAT, {"model": MODEL, "messages": _user("")}, 400, "messages",
     "messages: empty prompt: this model adds no BOS token, so a prompt needs at least one token"),
    # OpenAI requires `model` on both routes ("you must provide a model parameter"); vLLM
    # would serve its one model.
    ("model missing: chat", CHAT, {"messages": _user("你好")}, 400, "model",
     "you must provide a model parameter; this server serves 'toy'"),
    ("model missing: completions", COMPLETIONS, {"prompt": "你好"}, 400, "model",
     "you must provide a model parameter; this server serves 'toy'"),
    ("model null", COMPLETIONS, {"model": None, "prompt": "你好"}, 400, "model",
     "you must provide a model parameter; this server serves 'toy'"),
    ("prompt over the context: completions", COMPLETIONS,
     {"model": MODEL, "prompt": "你好" * 1500, "max_tokens": 4}, 400, "prompt",
     "the prompt has 3000 tokens, which leaves no room to generate within max_seq_len 32"),
    ("prompt over the context: chat", CHAT,
     {"model": MODEL, "messages": _user("你好" * 1500 + "世"), "max_tokens": 4}, 400, "messages",
     "the prompt has 3001 tokens, which leaves no room to generate within max_seq_len 32"),
    ("prompt + max_tokens over the context", COMPLETIONS,
     {"model": MODEL, "prompt": "你好" * 14, "max_tokens": 5}, 400, "max_tokens",
     "prompt length 28 + max_tokens 5 = 33 exceeds max_seq_len 32"),
    ("min_tokens over max_tokens", COMPLETIONS,
     {"model": MODEL, "prompt": "你好", "max_tokens": 1, "min_tokens": 2}, 400, "min_tokens",
     "min_tokens must be in [0, max_new_tokens = 1], got 2"),
    ("temperature beyond float32", COMPLETIONS,
     {"model": MODEL, "prompt": "x", "temperature": 1e300}, 400, "temperature",
     "SamplingParams.temperature must be at most 3.402823e+38 in magnitude (float32), got 1e+300"),
    # Found by the HTTP fuzz: > 0 but 0 in float32, the device divided by it and sampled nan.
    ("repetition_penalty below float32", COMPLETIONS,
     {"model": MODEL, "prompt": "00", "max_tokens": 2, "temperature": 1.0,
      "repetition_penalty": 2.3115535959631603e-234}, 400, "repetition_penalty",
     "SamplingParams.repetition_penalty must be > 0 and at least 1.175494e-38 (the smallest "
     "normal float32), got 2.3115535959631603e-234"),
    ("temperature 1e400: completions", COMPLETIONS,
     b'{"model": "toy", "prompt": "x", "temperature": 1e400}', 400, "temperature",
     "temperature: Input should be a finite number"),
    ("temperature 1e400: chat", CHAT,
     b'{"model": "toy", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
     400, "temperature", "temperature: Input should be a finite number"),
]


@pytest.mark.parametrize("name,path,body,status,param,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_odd_input_gets_its_exact_error(http, name, path, body, status, param, message):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == message
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_empty_content_beside_other_content_is_accepted(http):
    """An empty system message is accepted (OpenAI and vLLM do)."""
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "你好"}]
    r = _post(http, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "世界"
    assert r.json()["usage"]["prompt_tokens"] == 2


def test_assistant_message_may_have_null_content(http):
    """An assistant turn without content (OpenAI allows it after tool calls) renders as ""."""
    messages = [{"role": "assistant", "content": None}, {"role": "user", "content": "你好"}]
    r = _post(http, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "世界"


def test_more_alternatives_than_the_vocabulary(http):
    """top_logprobs 20 on the toy's 13-token vocabulary: 13 alternatives per
    token (the engine thread used to die: top_k of 20 over 13 logits)."""
    body = {"model": MODEL, "messages": _user("你好"), "max_tokens": 2, "logprobs": True,
            "top_logprobs": 20}
    r = _post(http, CHAT, body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [len(c["top_logprobs"]) for c in content] == [13, 13]
    r = _post(http, COMPLETIONS, {"model": MODEL, "prompt": "你好", "max_tokens": 2, "logprobs": 9})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "世界"


def test_tokenize_refuses_null_user_content(http):
    r = _post(http, "/tokenize", {"messages": _user(None)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == ("messages[0]: content must be a string or a list of "
                                            "text parts in a user message, got null")
