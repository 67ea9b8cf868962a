"""A bounded soak of the OpenAI server on the trained toy (4 slots of 32
tokens, `toy_server`): after a warm-up pass of the mix, two rounds of 2,000
mixed requests, 16 at a time, each leave the server as the warm-up left it.

The mix (fixed seed, so every run sends the same requests): greedy and
seeded-sampling chat and completions, streamed to the end, streams the
client closes after the first chunk, invalid bodies (each with its 4xx),
prompts near max_seq_len, and n > 1. Checked after each round:

- every answer is of the kind its request expects (200 with choices, a
  stream ending in [DONE] with no error event, a client abort, or the exact
  4xx), counted by kind; a greedy answer, streamed or not, equals the
  answer its request got alone before the soak (concurrency, aborts and
  preemption change no value);
- every slot and page is free (nothing running or waiting, the page pool's
  invariants hold, no per-request state left in the scheduler);
- live compiled executables stay at or below the `ProgramCache` cap and
  at the warm-up's count, and the soak compiles nothing (the warm-up pass
  compiled every program the mix needs);
- open file descriptors return to the post-warm-up count within FD_SLACK
  (the server's keep-alive sockets close when the client does), and the
  memory maps other than glibc's malloc arena heaps to at most the
  post-warm-up count, none added (one fewer was seen once in CI: a map
  released or merged with its neighbour is not a leak;
  `jaxinfer_tools.bench.maps`: a heap's maps follow
  the allocator's high-water mark, a heap that fills up one map fewer, a
  new one two more, while its memory is what the resident-memory bound
  below measures), as `benchmarks/serve_soak.py` checks the real server;
- resident memory stays within RSS_BOUND of the post-warm-up value: the
  toy's weights and page pool are kilobytes and allocated before, so what
  2,000 requests may add is Python heap and allocator slack (request
  objects, JSON, event queues), tens of bytes to a few KiB each when
  nothing leaks: a leak of one 16 KiB buffer per request (2,000 x 16 KiB =
  31 MiB) already fails, and the second round must not grow past the first.

It prints the figures (requests, answers by kind, RSS, slots and pages,
executables, memory maps (arena heaps' and others), fds) of each round.
"""

import asyncio
import collections
import gc
import json
import os
import random
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from jaxinfer_tools.bench.maps import count_maps  # noqa: E402
from jaxinfer_tools.toy import CORPUS  # noqa: E402
from toy_server import CHAT, COMPLETIONS, MODEL, assert_idle_and_clean, toy_server  # noqa: E402

pytestmark = pytest.mark.slow

SOAK_REQUESTS = 2000
WARMUP_REQUESTS = 200
CONCURRENCY = 16
MAX_SEQ_LEN = 32               # toy_server's
ROUNDS = 2
RSS_BOUND = 20 * 2**20         # module docstring
FD_SLACK = 4                   # sockets the server may still be closing when we look
SEED = 20261203

PROMPTS = sorted(set(CORPUS) | {line[:2] for line in CORPUS})      # short, in-distribution
GREEDY_MAX_TOKENS = (1, 3, 6)
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
# (body, status): each is refused by validation or admission, never reaching the engine.
INVALID = [
    (b'{"model": "toy", "prompt": ', 400),                                   # broken JSON
    ({"model": "toy", "prompt": "你好", "temperature": -1}, 400),
    ({"model": "toy", "prompt": "你好", "max_tokens": -1}, 400),          # 0 is served (echo)
    ({"model": "toy", "prompt": "你好" * 14, "max_tokens": 5}, 400),        # 28 + 5 > 32
    ({"model": "toy", "prompt": "你好" * 40, "max_tokens": 1}, 400),        # over the context
    ({"model": "nope", "prompt": "你好"}, 404),
    ({"prompt": "你好"}, 400),                                                # model missing
    ({"model": "toy", "messages": [{"role": "user", "content": None}]}, 400),
    ({"model": "toy", "messages": []}, 400),
    ({"model": "toy", "prompt": "你好", "n": 0}, 400),
]


# --- the mix --------------------------------------------------------------------------------


def _route(chat: bool, body: dict) -> tuple[str, dict]:
    """(path, body) for chat or completions of body's "prompt" text."""
    body = {"model": MODEL, **body}
    if not chat:
        return COMPLETIONS, body
    prompt = body.pop("prompt")
    return CHAT, {**body, "messages": [{"role": "user", "content": prompt}]}


def _request(rng) -> tuple[str, str, object]:
    """(kind, path, body) of one request of the mix."""
    kind = rng.choices(["greedy", "sampled", "stream", "abort", "invalid", "long", "n"],
                       weights=[20, 10, 20, 15, 15, 10, 10])[0]
    prompt = rng.choice(PROMPTS)
    if kind == "invalid":
        body, status = rng.choice(INVALID)
        chat = isinstance(body, dict) and "messages" in body
        return kind, CHAT if chat else COMPLETIONS, (body, status)
    if kind in ("greedy", "stream"):
        body = {"prompt": prompt, "max_tokens": rng.choice(GREEDY_MAX_TOKENS),
                "stream": kind == "stream"}
    elif kind == "sampled":
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 8), "seed": rng.randint(0, 99),
                **SAMPLED}
    elif kind == "abort":        # long enough that the client leaves while it decodes
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "stream": True}
    elif kind == "long":         # a prompt filling max_seq_len but for max_tokens
        n = rng.randint(24, MAX_SEQ_LEN - 1)
        text = "".join(rng.choice("".join(CORPUS)) for _ in range(n))
        body = {"prompt": text, "max_tokens": MAX_SEQ_LEN - n, "ignore_eos": True}
    else:
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 6), "n": rng.randint(2, 3),
                "seed": rng.randint(0, 99), **SAMPLED}
    return (kind, *_route(rng.random() < 0.5, body))


def _key(path: str, body: dict) -> tuple:
    """A greedy request's identity for its reference answer."""
    prompt = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
    return path, prompt, body["max_tokens"]


def _events(lines: list[str]) -> list:
    return [line[6:] for line in lines if line.startswith("data: ")]


def _stream_text(events: list[str]) -> str:
    assert events[-1] == "[DONE]", events[-3:]
    text = []
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def _text(path: str, choice: dict) -> str:
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"]


async def _send(http, kind: str, path: str, body) -> tuple[str, object]:
    """(outcome, value): outcome "200", "aborted" or "<status>" (a 4xx), the
    value the answer's text (greedy and stream) or None. An answer not of
    the kind its request expects raises AssertionError."""
    if kind == "invalid":
        body, want = body
        raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        r = await http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == want, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
        return str(r.status_code), None
    if body.get("stream"):
        async with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, (body, r.status_code)
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if kind == "abort" and _events(lines):
                    return "aborted", None         # leaving the block closes the connection
        return "200", _stream_text(_events(lines))
    r = await http.post(path, json=body)
    assert r.status_code == 200, (body, r.status_code, r.text)
    choices = r.json()["choices"]
    assert len(choices) == body.get("n", 1), choices
    assert all(c["finish_reason"] in ("stop", "length") for c in choices), choices
    if kind == "long":
        assert r.json()["usage"]["total_tokens"] == MAX_SEQ_LEN
    return "200", _text(path, choices[0]) if kind == "greedy" else None


async def _run(url: str, requests: list, concurrency: int) -> list:
    """[(kind, path, body, outcome, value)] of every request, `concurrency` at a time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        gate = asyncio.Semaphore(concurrency)

        async def one(kind, path, body):
            async with gate:
                return (kind, path, body, *await _send(http, kind, path, body))
        return await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), 900)


# --- what is measured -----------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled_fds(target: int, timeout_s: float = 15.0) -> int:
    """Open fds once at most target (or after timeout_s: the last count)."""
    deadline = time.monotonic() + timeout_s
    while (n := _fds()) > target and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def _figures(server, finished: collections.Counter) -> dict:
    gc.collect()
    programs, stats = server.llm.programs, assert_idle_and_clean(server, timeout_s=60)
    scheduler = server.engine.engine.scheduler
    return {"rss": _rss(), "fds": _fds(), **count_maps(),
            "slots_free": sum(r is None for r in scheduler.slots), "slots": len(scheduler.slots),
            "pages_free": stats.pages_free, "pages_cached": stats.pages_cached,
            "num_pages": stats.num_pages, "programs": programs.num_programs,
            "compiles": programs.num_compiles, "max_programs": programs.max_programs,
            "preempted": stats.num_preempted,
            "engine_aborts": finished["abort"]}


@pytest.fixture(scope="module")
def server(toy_folder):
    with toy_server(toy_folder, max_waiting_requests=4 * CONCURRENCY) as (server, url):
        engine = server.engine.engine
        assert engine.scheduler.runner.warm.wait_compiled(600)     # the background token buckets
        finished, on_step = collections.Counter(), engine.on_step

        def counting(engine, events):      # the engine's finish reasons (on its thread)
            finished.update(e.finish_reason for e in events if e.finished)
            on_step(engine, events)
        engine.on_step = counting
        yield server, url, finished
    assert server.engine.engine.error is None


def test_soak_leaves_nothing_behind(server):
    server, url, finished = server
    rng = random.Random(SEED)
    # references: each greedy request alone; then the warm-up pass compiles what the mix needs
    greedy = [_route(chat, {"prompt": prompt, "max_tokens": n})
              for prompt in PROMPTS for n in GREEDY_MAX_TOKENS for chat in (False, True)]
    alone = asyncio.run(_run(url, [("greedy", p, b) for p, b in greedy], concurrency=1))
    want = {_key(path, body): value for _, path, body, _, value in alone}
    assert want[COMPLETIONS, "你好", 3].startswith("世界")
    asyncio.run(_run(url, [_request(rng) for _ in range(WARMUP_REQUESTS)], CONCURRENCY))
    warm = _figures(server, finished)
    for round_ in range(1, ROUNDS + 1):
        _soak_round(server, url, finished, rng, want, warm, round_)


def _soak_round(server, url, finished, rng, want, warm, round_):
    """SOAK_REQUESTS of the mix; then check the module docstring's list
    against `warm`, the figures after the warm-up."""
    before = _figures(server, finished)
    t0 = time.monotonic()
    requests = [_request(rng) for _ in range(SOAK_REQUESTS)]
    results = asyncio.run(_run(url, requests, CONCURRENCY))
    seconds = time.monotonic() - t0
    after = _figures(server, finished)
    after["fds"] = _settled_fds(warm["fds"] + FD_SLACK)

    outcomes = collections.Counter(outcome for *_, outcome, _ in results)
    kinds = collections.Counter(kind for kind, *_ in results)
    print(f"\nsoak round {round_}: {len(results)} requests in {seconds:.0f} s, {CONCURRENCY} at a "
          f"time; by kind {dict(sorted(kinds.items()))}; answers {dict(sorted(outcomes.items()))}")
    for name, unit in (("rss", 2**20), ("fds", 1), ("maps", 1), ("heap_maps", 1), ("other_maps", 1),
                       ("programs", 1), ("compiles", 1)):
        print(f"soak round {round_}: {name} after warm-up {warm[name] / unit:.1f}, before "
              f"{before[name] / unit:.1f}, after {after[name] / unit:.1f}")
    print(f"soak round {round_}: slots free {after['slots_free']}/{after['slots']}; pages free "
          f"{after['pages_free']} + cached {after['pages_cached']} of {after['num_pages']}; "
          f"executables {after['programs']} (cap {after['max_programs']}); cut short in the "
          f"engine {after['engine_aborts'] - before['engine_aborts']} of the aborted streams; "
          f"preempted {after['preempted'] - before['preempted']}")

    # answers: of the kind each request expects (`_send`), and greedy values unchanged
    assert len(results) == SOAK_REQUESTS
    assert outcomes["aborted"] == kinds["abort"] > 0
    # a stream the client left is aborted in the engine (its slot freed early) unless it
    # had finished already
    assert 0 < after["engine_aborts"] - before["engine_aborts"] <= kinds["abort"]
    assert sum(n for o, n in outcomes.items() if o.startswith("4")) == kinds["invalid"] > 0
    assert outcomes["200"] == SOAK_REQUESTS - kinds["abort"] - kinds["invalid"]
    mismatched = [(path, body, value) for kind, path, body, _, value in results
                  if kind in ("greedy", "stream") and value != want[_key(path, body)]]
    assert not mismatched, mismatched[:5]
    # nothing left behind: the state after the warm-up, again
    scheduler = server.engine.engine.scheduler
    assert after["slots_free"] == after["slots"] == warm["slots"]
    assert after["pages_free"] + after["pages_cached"] == after["num_pages"] == warm["num_pages"]
    scheduler.kv_pages.check()
    assert not scheduler.seqs and not scheduler.waiting and not scheduler.streaming
    assert after["programs"] <= after["max_programs"]
    assert after["programs"] == warm["programs"] and after["compiles"] == warm["compiles"]
    assert after["fds"] <= warm["fds"] + FD_SLACK
    assert after["other_maps"] <= warm["other_maps"], (warm["other_maps"], after["other_maps"])
    growth = after["rss"] - warm["rss"]
    assert growth < RSS_BOUND, f"resident memory grew {growth / 2**20:.1f} MiB since the warm-up"
