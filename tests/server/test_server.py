"""`jaxinfer serve` on the trained two-layer toy (character vocabulary, 32
positions), checked with the official `openai` client and raw HTTP against
a server on a free loopback port: protocol shapes, equality with the
library, concurrency, faults, admission control, auth and metrics.

One server (4 slots) serves the module; every server a test starts is
stopped by it, and every request loop is bounded in count and time.
"""

import asyncio
import json
import os
import re
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jaxinfer.serving.llm import LLM  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402
from jaxinfer.server import ServerThread, build_server  # noqa: E402
from serve_process import start_serve, stop  # noqa: E402

KEY = "test-key-123"
MODEL = "toy"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # the toy has none: plain concatenation
SLOTS = 4


@pytest.fixture(scope="module")
def llm(toy_folder):
    llm = LLM.load(str(toy_folder), max_seq_len=32, decode_chunk=4, max_num_seqs=SLOTS,
                   prefill_chunk_size=8, progress=False, load_cache=False)
    llm.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def server(llm):
    server = build_server(llm, model_name=MODEL, max_num_seqs=SLOTS, max_waiting_requests=32,
                          api_key=KEY, max_request_bytes=4096, warmup=True)
    with ServerThread(server.app) as url:
        yield server, url


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(url, path, body=None, key=KEY, **kwargs):
    if path.startswith("/v1/") and body is not None:
        body = {"model": MODEL, **body}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kwargs)


def _metric(url, name, **labels) -> float:
    """A sample's value from /metrics (0 when the series does not exist yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _wait_idle(url, timeout_s=30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (_metric(url, "jaxinfer_slots_used") == 0 and
                _metric(url, "jaxinfer_num_requests_waiting") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


SEEDED = dict(temperature=1.0, top_p=0.9, seed=11)


# --- protocol and equality with the library -------------------------------------------------


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_the_other_token_buckets_compile_once_the_app_has_started(llm):
    """With warmup, `build_server` returns with the smallest and largest token
    buckets ready (and the app built); the others compile only after the app
    starts, so that they do not slow the start down."""
    built = build_server(llm, model_name=MODEL, max_num_seqs=SLOTS, max_waiting_requests=8,
                         warmup=True)
    runner = built.engine.engine.scheduler.runner
    time.sleep(0.5)
    assert runner.warm.ready_buckets == [runner.token_buckets[0], runner.token_buckets[-1]]
    assert len(runner.token_buckets) > 2
    with ServerThread(built.app) as url:
        assert runner.warm.wait_compiled(timeout_s=300)
        assert runner.warm.ready_buckets == list(runner.token_buckets)
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_chat_and_completion_equal_the_library(client, llm):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "你好"}],
                                          max_tokens=6)
    [lib] = llm.generate([[{"role": "user", "content": "你好"}]], max_new_tokens=6)
    assert chat.object == "chat.completion" and chat.model == MODEL and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == lib.text == "世界"
    assert chat.choices[0].finish_reason == lib.finish_reason == "stop"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (
        len(lib.prompt_token_ids), len(lib.token_ids), len(lib.prompt_token_ids) + len(lib.token_ids))
    comp = client.completions.create(model=MODEL, prompt="我爱", max_tokens=9, extra_body={"ignore_eos": True},
                                     **SEEDED)
    [lib] = llm.generate(["我爱"], SamplingParams(**SEEDED), max_new_tokens=9, ignore_eos=True)
    assert comp.object == "text_completion" and comp.choices[0].text == lib.text
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 9
    assert comp.usage.prompt_tokens == len(llm.tokenizer.encode("我爱")) == 2


def test_streamed_pieces_join_to_the_whole_text(client):
    kwargs = dict(model=MODEL, max_tokens=20, extra_body={"ignore_eos": True}, **SEEDED)
    messages = [{"role": "user", "content": "世界"}]
    whole = client.chat.completions.create(messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    # completions, streamed, without usage
    stream = client.completions.create(prompt="大家", stream=True, **kwargs)
    text = "".join(c.choices[0].text for c in stream)
    assert text == client.completions.create(prompt="大家", **kwargs).choices[0].text


def test_stop_strings_are_excluded(client, llm):
    base = dict(model=MODEL, prompt="你好", max_tokens=12, extra_body={"ignore_eos": True}, **SEEDED)
    full = client.completions.create(**base).choices[0].text
    stop = full[3:5]
    assert len(stop) == 2
    cut = client.completions.create(stop=[stop, "不在"], **base)
    [lib] = llm.generate(["你好"], SamplingParams(**SEEDED), max_new_tokens=12, ignore_eos=True,
                         stop=[stop, "不在"])
    assert cut.choices[0].text == full[:full.index(stop)] == lib.text
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **base))
    assert streamed == cut.choices[0].text


def test_n_choices_with_a_seed(client, llm):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "再"}], max_tokens=10, n=3,
                  extra_body={"ignore_eos": True}, temperature=1.5, seed=100)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    lib = [llm.generate([[{"role": "user", "content": "再"}]], SamplingParams(temperature=1.5, seed=100 + j),
                        max_new_tokens=10, ignore_eos=True)[0].text for j in range(3)]
    assert texts == lib and len(set(texts)) > 1
    assert first.usage.prompt_tokens == 1 and first.usage.completion_tokens == 30


def test_logprobs_shapes_and_values(client, llm):
    prompt = [{"role": "user", "content": "大家"}]
    [lib] = llm.generate([prompt], max_new_tokens=6, logprobs=2, ignore_eos=True)
    chat = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=6, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == len(lib.logprobs) == 6
    for item, (token, logprob, alts) in zip(content, lib.logprobs):
        text = llm.tokenizer.decode([token], skip_special_tokens=False)
        assert item.token == text and item.bytes == list(text.encode("utf-8"))
        assert item.logprob == pytest.approx(logprob, abs=1e-5)
        assert [t.token for t in item.top_logprobs] == [
            llm.tokenizer.decode([i], skip_special_tokens=False) for i, _ in alts[:2]]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v for _, v in alts[:2]], abs=1e-5)
    comp = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=5, logprobs=2,
                                     extra_body={"ignore_eos": True})
    [lib] = llm.generate([[5, 6]], max_new_tokens=5, logprobs=2, ignore_eos=True)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in lib.logprobs], abs=1e-5)
    assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t, _, _ in lib.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tops, token in zip(lp.top_logprobs, lp.tokens):
        assert token in tops and 2 <= len(tops) <= 3
    assert chat.choices[0].logprobs is not None and comp.choices[0].text == lib.text


def test_models_health_tokenize_detokenize(url, llm):
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 32
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    tok = _post(url, "/tokenize", {"prompt": "世界很大"}).json()
    assert tok["tokens"] == llm.tokenizer.encode("世界很大") and tok["count"] == 4
    chat = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "你好"}]}).json()
    assert chat["tokens"] == llm.encode_prompt([{"role": "user", "content": "你好"}], chat=True)
    assert _post(url, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "世界很大"}
    assert _post(url, "/detokenize", {"tokens": [10_000]}).status_code == 400


# --- concurrency --------------------------------------------------------------------------------


def test_sixteen_concurrent_streams_equal_the_library_alone(url, llm):
    """16 streamed requests of different lengths and sampling (greedy and
    seeded) against 4 slots: each one's text equals the library's run of
    the same request alone."""
    prompts = ["你好", "世界", "我爱", "大家好", "再见", "很大", "世", "我"]
    cases = []
    for i in range(16):
        sampling = {} if i % 2 == 0 else dict(temperature=0.7 + 0.1 * (i % 5), top_k=5, seed=i)
        cases.append((prompts[i % len(prompts)], min(4 + i, 29), sampling))
    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(prompt, max_tokens, sampling):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                  stream=True, extra_body={"ignore_eos": True, **sampling})
        return "".join([c.choices[0].text async for c in stream])

    async def run_all():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(*c) for c in cases)), 300)
        finally:
            await aclient.close()

    texts = asyncio.run(run_all())
    expected = [llm.generate([p], SamplingParams(**s), max_new_tokens=m, ignore_eos=True)[0].text
                for p, m, s in cases]
    assert texts == expected
    _wait_idle(url)


# --- faults -------------------------------------------------------------------------------------


BAD_INPUTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "toy", "prompt": "x",', 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("wrong type", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("wrong type: messages", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages"),
    ("temperature < 0", "/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("top_p = 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n < 1", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("temperature overflows to inf", "/v1/completions",
     b'{"model": "toy", "prompt": "x", "temperature": 1e400}', 400, "temperature"),
    ("prompt alone fills the context", "/v1/completions", {"prompt": "你好" * 16, "max_tokens": 4}, 400,
     "prompt"),
    ("context", "/v1/completions", {"prompt": "你好", "max_tokens": 31}, 400, "max_tokens"),
    ("context: chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "你好"}], "max_completion_tokens": 40}, 400,
     "max_completion_tokens"),
    ("ids outside the vocabulary", "/v1/completions", {"prompt": [1, 2, 13]}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("unsupported", "/v1/completions", {"prompt": "x", "logit_bias": {"3": 5}}, 400, "logit_bias"),
    ("seed out of range", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("stop: empty string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("body too large", "/v1/completions", {"prompt": "好" * 2000}, 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_error_json(url, name, path, body, status, param):
    before = _metric(url, "jaxinfer_prompt_tokens_total")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()
    r = httpx.post(url + path, content=raw, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert _metric(url, "jaxinfer_prompt_tokens_total") == before       # nothing ran
    ok = _post(url, "/v1/completions", {"prompt": "你好", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "世界"


def test_unknown_route_is_a_404_error_json(url):
    r = httpx.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_auth(url, client):
    body = {"prompt": "你好", "max_tokens": 2}
    assert _post(url, "/v1/completions", body, key=None).status_code == 401
    wrong = _post(url, "/v1/completions", body, key="test-key-124")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert _post(url, "/v1/completions", body).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200       # not a /v1/ route
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="你好", max_tokens=2)


def _slow_steps(server, seconds):
    """Make the server's engine thread sleep before each scheduler step."""
    scheduler = server.engine.engine.scheduler
    step = scheduler.step

    def slow():
        time.sleep(seconds)
        return step()
    scheduler.step = slow
    return lambda: setattr(scheduler, "step", step)


def test_client_disconnect_aborts_and_frees_the_slot(server, url):
    aborts = _metric(url, "jaxinfer_requests_finished_total", finish_reason="abort")
    generated = _metric(url, "jaxinfer_generation_tokens_total")
    restore = _slow_steps(server[0], 0.1)
    try:
        body = {"model": MODEL, "prompt": "你好", "max_tokens": 28, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            assert _metric(url, "jaxinfer_slots_used") == 1
        _wait_idle(url)                               # the connection is closed: abort, slot free
    finally:
        restore()
    assert _metric(url, "jaxinfer_requests_finished_total", finish_reason="abort") == aborts + 1
    assert _metric(url, "jaxinfer_generation_tokens_total") - generated < 28


def test_full_waiting_queue_answers_503(llm):
    server = build_server(llm, model_name=MODEL, max_num_seqs=SLOTS, max_waiting_requests=1)
    gate = threading.Event()
    scheduler = server.engine.engine.scheduler
    step = scheduler.step
    scheduler.step = lambda: (gate.wait(30), step())[1]
    with ServerThread(server.app) as url:
        body = {"model": MODEL, "prompt": "你好", "max_tokens": 3}
        with httpx.Client(timeout=60) as http:
            results = []
            first = threading.Thread(target=lambda: results.append(
                http.post(url + "/v1/completions", json=body)))
            first.start()
            deadline = time.monotonic() + 30
            while server.engine.num_waiting() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            busy = http.post(url + "/v1/completions", json=body)
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "queue_full"
            gate.set()
            first.join(60)
            assert results[0].status_code == 200
            assert http.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == "世界"
            assert _metric(url, "jaxinfer_http_requests_total", route="/v1/completions",
                           status="503") == 1


def test_soak_leaves_nothing_behind(url):
    """A bounded soak: 240 short requests, 8 at a time (streamed and not,
    some aborted by the client): afterwards no slot is used, nothing waits,
    and resident memory grew less than 64 MiB after the first 40."""
    async def soak():
        limits = httpx.Limits(max_connections=8)
        async with httpx.AsyncClient(timeout=60, limits=limits,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            sem = asyncio.Semaphore(8)

            async def one(i):
                body = {"model": MODEL, "prompt": ["你好", "世界", "大家"][i % 3], "max_tokens": 2 + i % 7,
                        "ignore_eos": i % 2 == 0, "stream": i % 3 == 0}
                async with sem:
                    if i % 10 == 9:          # a client that leaves after the first chunk
                        async with http.stream("POST", url + "/v1/completions",
                                               json={**body, "stream": True}) as r:
                            async for _ in r.aiter_lines():
                                break
                        return 200
                    r = await http.post(url + "/v1/completions", json=body)
                    return r.status_code

            first = await asyncio.gather(*(one(i) for i in range(40)))
            rss = _metric(url, "process_resident_memory_bytes")
            rest = await asyncio.gather(*(one(i) for i in range(40, 240)))
            return first + rest, rss

    statuses, rss_before = asyncio.run(asyncio.wait_for(soak(), 600))
    assert statuses == [200] * 240
    _wait_idle(url)
    growth = _metric(url, "process_resident_memory_bytes") - rss_before
    assert growth < 64 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"


def test_metrics_exposition(url, llm):
    # one request of its own first: the request counters and latency histograms
    # have a sample only once a request was served (the test must pass alone)
    r = _post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = httpx.get(url + "/metrics").text
    for name in ("jaxinfer_http_requests_total", "jaxinfer_num_requests_running",
                 "jaxinfer_num_requests_waiting", "jaxinfer_slots_used", "jaxinfer_slots_total",
                 "jaxinfer_kv_cache_usage_ratio", "jaxinfer_prompt_tokens_total",
                 "jaxinfer_generation_tokens_total", "jaxinfer_time_to_first_token_seconds_bucket",
                 "jaxinfer_inter_token_latency_seconds_bucket",
                 "jaxinfer_e2e_request_latency_seconds_bucket"):
        assert re.search(rf"^{name}\{{", text, re.M), name
    assert _metric(url, "jaxinfer_slots_total") == SLOTS
    assert _metric(url, "jaxinfer_time_to_first_token_seconds_count") > 0
    live = _metric(url, "jaxinfer_programs_live")
    assert live == llm.programs.num_programs and 0 < live <= llm.programs.max_programs


# --- the command --------------------------------------------------------------------------------


def test_serve_usage_errors_exit_2(capsys, tmp_path):
    from jaxinfer.cli import main
    from jaxinfer.server.run import bind_socket

    assert main(["serve", "--port", "70000"]) == 2
    assert "jaxinfer serve: error: --port must be in [0, 65535]" in capsys.readouterr().err
    busy = bind_socket("127.0.0.1", 0)
    busy.listen()
    try:
        port = busy.getsockname()[1]
        assert main(["serve", "model=/nonexistent", "--port", str(port)]) == 2
        assert f"jaxinfer serve: error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        busy.close()
    assert main(["serve", "max_waiting_requests=0"]) == 2
    assert "max_waiting_requests must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_serve_command_shuts_down_gracefully(toy_folder, tmp_path, sig):
    """`jaxinfer serve` in a subprocess: serves a request, then on the signal
    lets a running stream finish, refuses new connections and exits 0."""
    cfg = tmp_path / "toy-serve.yaml"
    cfg.write_text(f"model: {toy_folder}\nmax_seq_len: 32\ndecode_chunk: 4\nmax_num_seqs: 2\n"
                   "chat: false\nwarmup: false\n", encoding="utf-8")
    env = {**os.environ, "JAXINFER_API_KEY": KEY, "JAXINFER_LOAD_CACHE": "0"}
    proc, url = start_serve(["--config", str(cfg), "--served-model-name", MODEL], 300, env=env)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        assert client.completions.create(model=MODEL, prompt="你好", max_tokens=3).choices[0].text == "世界"
        stream = client.completions.create(model=MODEL, prompt="你好", max_tokens=28, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(sig)
        rest = list(stream)
        assert first.choices[0].text and rest[-1].choices[0].finish_reason in ("length", "abort")
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        stop(proc)
