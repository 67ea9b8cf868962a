"""`jaxinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on
the continuous-batching engine. Needs the `serve` extra
(`pip install -e ".[serve]"`: fastapi, uvicorn, prometheus_client).

    from jaxinfer.server import build_server, ServerThread
    server = build_server(llm, model_name="m", max_num_seqs=8, max_waiting_requests=64)
    with ServerThread(server.app) as url:     # http://127.0.0.1:<port>; /v1/... routes
        ...

Modules: `app` (routes, errors, auth, body limit), `protocol` (request
models), `responses` (OpenAI response shapes), `turns` (a reply read as
reasoning, content and tool calls, streamed or whole), `tools` (Hermes-style
calls), `messages` (Anthropic's Messages API), `responses_api` (OpenAI's
Responses API, stateless), `async_engine` (the engine thread seen from
asyncio), `prometheus` (metrics), `prompt_scores` (echo, max_tokens 0 and
prompt log-probs), `run` (the command, warm-up, uvicorn).
"""

from jaxinfer.server.run import ServerThread, build_server, warm_up

__all__ = ["ServerThread", "build_server", "warm_up"]
