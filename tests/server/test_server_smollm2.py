"""`jaxinfer serve` on SmolLM2-135M-Instruct (slow: the real model): the
openai client's answers equal the library's, and the README's start line,
curl, openai and anthropic examples work as written (on a free port
instead of 8000)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_process import start_serve, stop  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(real_model_path):
    from jaxinfer.serving.llm import LLM

    real_model_path(MODEL)
    return LLM.load(MODEL, max_seq_len=512, max_num_seqs=4, decode_chunk=8, progress=False)


@pytest.fixture(scope="module")
def client(llm):
    from jaxinfer.server import ServerThread, build_server

    server = build_server(llm, model_name=MODEL, max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_equals_the_library(client, llm):
    from jaxinfer.sampling import SamplingParams

    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, logprobs=True,
                                           top_logprobs=3)
    [lib] = llm.generate([QUESTION], max_new_tokens=24, logprobs=3)
    assert reply.choices[0].message.content == lib.text and "Paris" in lib.text
    assert reply.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(QUESTION))
    assert reply.usage.completion_tokens == len(lib.token_ids)
    got = [(c.token, c.logprob) for c in reply.choices[0].logprobs.content]
    assert [t for t, _ in got] == [llm.tokenizer.decode([i], skip_special_tokens=False)
                                   for i, _, _ in lib.logprobs]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp, _ in lib.logprobs], abs=1e-4)
    # seeded sampling, streamed and not
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku about JAX."}],
                  max_tokens=40, temperature=0.8, top_p=0.95, seed=7)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs))
    [lib] = llm.generate([kwargs["messages"]], SamplingParams(temperature=0.8, top_p=0.95, seed=7),
                         max_new_tokens=40)
    assert whole == streamed == lib.text


def _code_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Serving: `jaxinfer serve`"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_readme_examples_work_as_written(real_model_path, tmp_path):
    real_model_path(MODEL)
    start, curl = _code_blocks("bash")
    python, structured, agents = _code_blocks("python")
    connect = python[:python.index("\n", python.index("client = OpenAI("))]
    command = start.split("&&", 1)[1].strip()          # the install step is done already
    assert command.startswith("jaxinfer serve ")
    proc, url = start_serve(command.split()[2:], 1800, cwd=ROOT)
    try:
        out = subprocess.run(curl.replace("http://127.0.0.1:8000", url), shell=True, capture_output=True,
                             text=True, timeout=300, check=True).stdout
        assert "Paris" in json.loads(out)["choices"][0]["message"]["content"]
        script = tmp_path / "example.py"
        script.write_text(python.replace("http://127.0.0.1:8000", url), encoding="utf-8")
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert ran.returncode == 0, ran.stderr[-2000:]
        assert "Paris" in ran.stdout and len(ran.stdout) > 40
        # the structured-output example, then the Messages and streamed-call one, on the first
        # block's client
        script.write_text((connect + "\n" + structured + "\n" + agents).replace(
            "http://127.0.0.1:8000", url), encoding="utf-8")
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert ran.returncode == 0, ran.stderr[-2000:]
        lines = ran.stdout.splitlines()
        (content, call), message, streamed = lines[:2], "\n".join(lines[2:-1]), lines[-1]
        assert "Paris" in message, message
        record = json.loads(content)
        assert sorted(record) == ["city", "country"], content
        assert all(isinstance(v, str) and len(v) <= 20 for v in record.values()), content
        name, arguments = call.split(" ", 1)
        assert name == "get_weather" and list(json.loads(arguments)) == ["city"], call
        assert streamed == arguments         # the same constraint, greedy: the same call, streamed
        proc.terminate()
        assert proc.wait(timeout=120) == 0
    finally:
        stop(proc)
