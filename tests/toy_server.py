"""The trained toy model's OpenAI server on a thread, for the HTTP input and
fuzz tests: 4 slots of 32 tokens, a chat template that concatenates the
messages' contents, warmed up, served as model "toy"."""

import contextlib

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
                   min_kv_bucket=16, progress=False, load_cache=False)
    llm.tokenizer.hf_tokenizer.chat_template = TEMPLATE
    server = build_server(llm, model_name=MODEL, max_num_seqs=4,
                          max_waiting_requests=max_waiting_requests, max_request_bytes=1 << 16,
                          warmup=True)
    with ServerThread(server.app) as url:
        yield server, url
