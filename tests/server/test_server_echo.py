"""Prompt log-probs over HTTP (#54, item 3) on the trained toy: /v1/completions
with `echo` and `logprobs` (OpenAI's legacy shape, the first token's
log-prob null), `max_tokens` 0, and vLLM's `prompt_logprobs` on completions
and chat. The log-probs equal `LLM.score` within 1e-5 and the float64
reference (tests/reference.py) within 1e-4, as the engine's other
log-probs do (tests/serving/test_batch.py); bad combinations are 400s
naming the field. The official `openai` client is the client.
"""

import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import jax  # noqa: E402

import reference  # noqa: E402
from toy_server import CHAT, COMPLETIONS, MODEL, assert_idle_and_clean, toy_server  # noqa: E402

TEXT = "你好世界很大"
MESSAGES = [{"role": "user", "content": "大家好"}, {"role": "assistant", "content": "我爱"}]


@pytest.fixture(scope="module")
def served(toy_folder):
    with toy_server(toy_folder, max_waiting_requests=16) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(served):
    return served[0].llm


@pytest.fixture(scope="module")
def ref_logprobs(toy_trained):
    """ids -> float64 log-probs [T, V] of the reference forward."""
    params = jax.tree.map(np.asarray, toy_trained.params)

    def get(ids):
        logits = reference.forward(params, ids, toy_trained.config)
        logp = logits - logits.max(-1, keepdims=True)
        return logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return get


def _score_each(llm, ids):
    """log p(ids[t] | ids[:t]) for t >= 1, from `LLM.score` one token at a time."""
    return [llm.score([ids[:t]], [[ids[t]]])[0] for t in range(1, len(ids))]


def _post(url, path, body):
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


def test_echo_logprobs_equal_score_and_reference(client, llm, ref_logprobs):
    ids = llm.encode_prompt(TEXT)
    text = llm.tokenizer.decode
    reply = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=3, max_tokens=4)
    plain = client.completions.create(model=MODEL, prompt=TEXT, logprobs=3, max_tokens=4)
    [choice], [alone] = reply.choices, plain.choices
    assert choice.text == TEXT + alone.text
    lp, n = choice.logprobs, len(ids)
    assert lp.tokens[:n] == [text([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the prompt's tokens: LLM.score within 1e-5, the float64 reference within 1e-4
    np.testing.assert_allclose(lp.token_logprobs[1:n], _score_each(llm, ids), atol=1e-5, rtol=0)
    ref = ref_logprobs(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:n], [ref[t - 1, ids[t]] for t in range(1, n)],
                               atol=1e-4, rtol=0)
    for t in range(1, n):
        best = np.argsort(-ref[t - 1], kind="stable")[:3]
        top = lp.top_logprobs[t]
        assert len(top) <= 4 and top[lp.tokens[t]] == lp.token_logprobs[t]
        for i in best:
            assert top[text([int(i)], skip_special_tokens=False)] == pytest.approx(ref[t - 1, i], abs=1e-4)
    # then the generated tokens, as without echo; offsets run on from the prompt's
    assert lp.tokens[n:] == alone.logprobs.tokens
    assert lp.token_logprobs[n:] == alone.logprobs.token_logprobs
    assert lp.top_logprobs[n:] == alone.logprobs.top_logprobs
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == len(lp.tokens) - n


def test_max_tokens_0_echoes_the_prompts(client, llm):
    ids = llm.encode_prompt(TEXT)
    reply = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=0, max_tokens=0)
    [choice] = reply.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(
        llm.score([ids[:1]], [ids[1:]])[0], abs=1e-5)
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    # several prompts as ids, n choices each: each choice echoes its own prompt
    other = llm.encode_prompt("我爱世界")
    reply = client.completions.create(model=MODEL, prompt=[ids, other], echo=True, max_tokens=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [TEXT, TEXT, "我爱世界", "我爱世界"]
    assert all(c.logprobs is None for c in reply.choices)
    # echo without log-probs runs no forward of its own, and max_tokens 0 without echo is empty
    [choice] = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0).choices
    assert choice.text == "" and choice.finish_reason == "length"


def test_prompt_logprobs_on_completions(client, llm, ref_logprobs):
    ids = llm.encode_prompt(TEXT)
    reply = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2,
                                      extra_body={"prompt_logprobs": 2})
    got = reply.choices[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    scores, ref = _score_each(llm, ids), ref_logprobs(ids)
    for t in range(1, len(ids)):
        entry = got[t]
        mine = entry[str(ids[t])]
        assert mine["logprob"] == pytest.approx(scores[t - 1], abs=1e-5)
        assert mine["rank"] == 1 + int((ref[t - 1] > ref[t - 1, ids[t]]).sum())
        assert mine["decoded_token"] == llm.tokenizer.decode([ids[t]], skip_special_tokens=False)
        best = np.argsort(-ref[t - 1], kind="stable")[:2]
        for rank, i in enumerate(best, 1):
            assert entry[str(int(i))]["rank"] == rank
            assert entry[str(int(i))]["logprob"] == pytest.approx(ref[t - 1, i], abs=1e-4)
        assert len(entry) <= 3


def test_prompt_logprobs_on_a_chat_prompt(client, llm):
    ids = llm.encode_prompt(llm.tokenizer.apply_chat_template(MESSAGES))
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})
    got = reply.choices[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    assert [list(e) for e in got[1:]] == [[str(i)] for i in ids[1:]]
    np.testing.assert_allclose([e[str(i)]["logprob"] for e, i in zip(got[1:], ids[1:])],
                               _score_each(llm, ids), atol=1e-5, rtol=0)
    assert reply.model_extra["prompt_logprobs"] == got       # where vLLM puts it in chat


def test_echo_beside_a_running_request(served, client, llm):
    """Prompt log-probs run on the engine thread between steps: a request
    decoding meanwhile gives the tokens it gives alone."""
    kwargs = dict(model=MODEL, prompt="大家", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    alone = client.completions.create(**kwargs).choices[0].text
    out = {}
    runner = threading.Thread(target=lambda: out.update(text=client.completions.create(**kwargs)
                                                      .choices[0].text))
    runner.start()
    for _ in range(4):
        client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    runner.join(120)
    assert out["text"] == alone
    assert_idle_and_clean(served[0])


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": TEXT, "echo": True, "stream": True}, "echo"),
    (COMPLETIONS, {"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": TEXT, "max_tokens": 0, "stream": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": TEXT, "echo": True, "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": TEXT, "prompt_logprobs": -1}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": TEXT, "echo": "yes"}, "echo"),
    (COMPLETIONS, {"prompt": TEXT, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "prompt_logprobs": 21}, "prompt_logprobs"),
    (CHAT, {"messages": MESSAGES, "echo": True}, "echo"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
])
def test_bad_combinations_are_400s_naming_the_field(served, path, body, param):
    r = _post(served[1], path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, stream=True)
    assert info.value.param == "echo"


def test_prompt_logprobs_while_asleep_are_a_503_and_work_after_waking(served, client, llm):
    url = served[1]
    before = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    assert httpx.post(url + "/sleep", json={"level": 1}, timeout=120).status_code == 200
    try:
        r = _post(url, COMPLETIONS, {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 0})
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"], r.text
    finally:
        assert httpx.post(url + "/wake_up", timeout=120).status_code == 200
    after = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    assert after.choices[0].logprobs == before.choices[0].logprobs
