"""The trained toy model's OpenAI server on a thread, for the HTTP input,
fuzz, fault and soak tests: 4 slots of 32 tokens, a chat template that
concatenates the messages' contents, warmed up, served as model "toy";
and the check that a server is idle with every slot and page free."""

import contextlib
import time

from jaxinfer.serving.llm import LLM
from jaxinfer.server import ServerThread, build_server

MODEL = "toy"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # plain concatenation
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@contextlib.contextmanager
def toy_server(folder, max_waiting_requests: int):
    """Yields (OpenAIServer, url) of the toy HF folder `folder` (the
    `toy_folder` fixture) while a `ServerThread` serves it."""
    llm = LLM.load(str(folder), max_seq_len=32, max_num_seqs=4, prefill_chunk_size=8,
                   progress=False, load_cache=False)
    llm.tokenizer.chat_template = TEMPLATE
    server = build_server(llm, model_name=MODEL, max_num_seqs=4,
                          max_waiting_requests=max_waiting_requests, max_request_bytes=1 << 16,
                          warmup=True)
    with ServerThread(server.app) as url:
        yield server, url


def assert_idle_and_clean(server, timeout_s: float = 30.0):
    """Wait up to timeout_s for `server` (an OpenAIServer) to be idle, then
    assert it is: no running or waiting request, no page held (every page
    free or cached for prefix hits), the engine running. Returns the last
    `EngineStats`."""
    scheduler = server.engine.engine.scheduler
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.engine.stats
        if stats.running == 0 and stats.pages_used == 0 and not scheduler.has_unfinished():
            break
        time.sleep(0.05)
    stats = server.engine.stats
    assert stats.running == 0 and stats.pages_used == 0
    assert stats.pages_free + stats.pages_cached == stats.num_pages
    assert server.engine.running
    return stats
