"""llama.cpp's `llama-server` under the structured-output row's schema: the
same chat prompts, greedy, one request at a time (one slot), unconstrained
and then with `response_format` {"type": "json_schema"}, which llama-server
turns into a GBNF grammar applied on the host.

Decode tokens/s is counted as `RunStats.decode_tokens_per_s` counts it for
jaxinfer: the tokens after each request's first, over the time from its
first token to its end. From llama-server's own `timings` of each response,
that is (predicted_n - 1) / predicted_ms, summed over the timed requests
(`predicted_ms` starts when the prompt is processed and the first token
sampled). One warm-up request per configuration comes first.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Callable, Optional

from jaxinfer_tools.bench.common import loadavg1
from jaxinfer_tools.bench.serve_compare import free_port
from jaxinfer_tools.bench.serve_peers import MODEL_NAME, PeerUnavailable, server_command
from jaxinfer_tools.bench.serve_workloads import ServerProcess

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def response_format(schema: dict) -> dict:
    """The OpenAI `response_format` that asks for `schema` (strict)."""
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


def decode_from_timings(responses: list[dict]) -> tuple[int, float]:
    """(tokens after each response's first, seconds from each first token to
    its end), summed over llama-server chat responses with `timings`.

    Raises:
      KeyError: a response without llama-server's `timings`.
    """
    tokens = sum(max(int(r["timings"]["predicted_n"]) - 1, 0) for r in responses)
    seconds = sum(float(r["timings"]["predicted_ms"]) for r in responses) / 1e3
    return tokens, seconds


def run_llama_server(gguf: str, texts: list[str], new_tokens: int, max_seq_len: int, schema: dict,
                     logs: pathlib.Path, setup: bool = True,
                     log: Callable[[str], None] = lambda m: None) -> dict:
    """Both configurations on one llama-server (one slot, all cores):
    {"runs": [{"constrained", "decoded_tokens", "decode_s", "decode_tokens_per_s",
    "outputs", "stopped", "parsed_json", "loadavg_1m"}, ...]}, or
    {"skipped": why} when llama-server is not set up (and `setup` is False)
    or cannot be built."""
    import httpx

    port = free_port()
    try:
        cmd, env = server_command("llamacpp", port, config="", overrides=(), gguf=gguf,
                                  max_seq_len=max_seq_len, max_num_seqs=1,
                                  threads=os.cpu_count() or 1, setup=setup, log=log)
    except PeerUnavailable as e:
        return {"skipped": str(e)}
    url = f"http://127.0.0.1:{port}"
    runs = []
    with ServerProcess(cmd, url, logs / "llama-server-structured.log", START_TIMEOUT_S, env), \
            httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        for constrained in (False, True):
            log(f"llama-server batch=1 {'constrained' if constrained else 'unconstrained'}")
            extra = {"response_format": response_format(schema)} if constrained else {}

            def ask(text: str) -> dict:
                body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
                        "max_tokens": new_tokens, "temperature": 0.0, **extra}
                reply = client.post(url + "/v1/chat/completions", json=body)
                reply.raise_for_status()
                return reply.json()

            ask(texts[0])   # warm-up
            responses = [ask(t) for t in texts]
            tokens, seconds = decode_from_timings(responses)
            texts_out = [r["choices"][0]["message"]["content"] or "" for r in responses]
            runs.append({"batch": 1, "constrained": constrained, "decoded_tokens": tokens,
                         "decode_s": seconds, "decode_tokens_per_s": tokens / seconds if seconds else None,
                         "outputs": len(texts),
                         "stopped": sum(r["choices"][0]["finish_reason"] == "stop" for r in responses),
                         "parsed_json": sum(_is_object(t) for t in texts_out), "loadavg_1m": loadavg1()})
    return {"runs": runs, "command": cmd}


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def peer_speed(peer: Optional[dict], constrained: bool) -> Optional[float]:
    """llama-server's batch-1 decode tokens/s (None: not measured)."""
    runs = (peer or {}).get("runs", ())
    return next((r["decode_tokens_per_s"] for r in runs if r["constrained"] == constrained), None)
