"""n-gram speculation on SmolLM2-135M-Instruct (slow: the real model) where
drafted blocks cross page boundaries: the copy prompts of issue #52, whose
accepted drafts once ran a row into a page that was never allocated, give
the greedy text of plain decoding through `LLM.stream`, and through the
server streamed and not (the openai client)."""

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TEN = "one two three four five six seven eight nine ten."
PROMPTS = [f"Copy exactly: {TEN} {TEN}",
           "Copy exactly: " + " ".join(["the quick brown fox jumps over the lazy dog."] * 12)]
MAX_NEW = 40


@pytest.fixture(scope="module")
def llms(real_model_path):
    from jaxinfer.serving.llm import LLM

    real_model_path(MODEL)
    make = lambda **kw: LLM.load(MODEL, max_seq_len=512, max_num_seqs=4, progress=False, **kw)
    return make(), make(speculative="ngram")


@pytest.fixture(scope="module")
def plain_texts(llms):
    plain, _ = llms
    return [c.text for c in plain.generate([[{"role": "user", "content": p}] for p in PROMPTS],
                                           chat=True, max_new_tokens=MAX_NEW)]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_streamed_speculation_gives_the_greedy_text(llms, plain_texts, i):
    _, spec = llms
    chat = [{"role": "user", "content": PROMPTS[i]}]
    assert "".join(spec.stream(chat, chat=True, max_new_tokens=MAX_NEW)) == plain_texts[i]
    assert spec.last_stats.accepted > 0


def test_the_server_with_speculation_gives_the_greedy_text(llms, plain_texts):
    from jaxinfer.server import ServerThread, build_server

    _, spec = llms
    server = build_server(spec, model_name=MODEL, max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for prompt, want in zip(PROMPTS, plain_texts):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}],
                          max_tokens=MAX_NEW, temperature=0)
            assert client.chat.completions.create(**kwargs).choices[0].message.content == want
            pieces = [c.choices[0].delta.content or "" for c in
                      client.chat.completions.create(stream=True, **kwargs) if c.choices]
            assert "".join(pieces) == want
