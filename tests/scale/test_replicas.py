"""Replicas on Ray Serve (`jaxinfer.scale`) with the trained toy: two replicas
behind the prefix-aware router answer the OpenAI client, requests sharing
a prefix land on one replica, and a killed replica fails its requests
without a hang while Ray brings it back. One local Ray instance (2 CPUs)
for the module. Needs the `ray` extra; Ray is imported only by the fixture,
so collecting this module in the default run imports no Ray."""

import json
import socket
import time

import httpx
import openai
import pytest

from jaxinfer.serving.llm import LLM

pytestmark = pytest.mark.slow

MODEL = "toy"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # plain concatenation
PAGE = 4                                                            # page_size: tokens (characters)
REPLICA = "x-jaxinfer-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(toy_folder, tmp_path_factory):
    """(ray, serve, url, proxy url) of 2 toy replicas behind the prefix
    router: url is the ingress's own HTTP server (`jaxinfer serve
    --replicas`), proxy url Ray Serve's proxy (`serve run`)."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from ray import serve
    from jaxinfer.scale.deployment import ReplicaSettings, build

    template = tmp_path_factory.mktemp("scale") / "concat.jinja"
    template.write_text(TEMPLATE)
    settings = ReplicaSettings(served_model_name=MODEL, overrides=(
        f"model={toy_folder}", "max_seq_len=32", "max_num_seqs=4", f"page_size={PAGE}",
        "prefill_chunk_size=8", "max_num_batched_tokens=32", f"chat_template={template}",
        "max_waiting_requests=16", "warmup=false"))
    ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    port, listen = _free_port(), _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(settings, replicas=2, replica_cpus=1, health_check_period_s=1,
                        listen=("127.0.0.1", listen)), name="jaxinfer", route_prefix="/")
        yield ray, serve, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[2] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(toy_folder):
    """The toy's greedy text for a prompt, in this process."""
    llm = LLM.load(str(toy_folder), max_seq_len=32, max_num_seqs=1, progress=False,
                   load_cache=False)
    return lambda prompt, n: llm.generate([prompt], max_new_tokens=n, ignore_eos=True)[0].text


def test_two_replicas_answer_the_openai_client(cluster, client, reference):
    prompt = "我爱世界"
    want = reference(prompt, 8)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == want and done.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == want
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == want and len(pieces) > 1     # streamed token by token, not at once
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    with pytest.raises(openai.BadRequestError, match="max_seq_len|max_tokens"):   # the server's own 400
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=64)
    proxied = openai.OpenAI(base_url=cluster[3] + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = proxied.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]   # the same through Ray's proxy
    assert "".join(pieces) == want and len(pieces) > 1


def test_prefix_affinity(cluster, capsys):
    """Five prefixes of two pages, four requests each, interleaved: every
    request after a prefix's first lands on the replica that served the
    first, and new prefixes spread over both replicas. Round-robin over the
    same sequence sends a request to a replica that served its prefix
    before only 2 times in 3."""
    url = cluster[2]
    prefixes = ["你好世界很大我爱", "世界很大我爱家再", "我爱世界大家好见", "大家好再见你好世",
                "再见我爱你好世界"]          # 8 characters of the toy's vocabulary: 2 pages
    served: dict[int, list[str]] = {g: [] for g in range(len(prefixes))}
    sequence = [(r, g) for r in range(4) for g in range(len(prefixes))]
    for r, g in sequence:
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prefixes[g] + "好家见大"[r], "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        served[g].append(reply.headers[REPLICA])

    def hit_rate(replica_of) -> float:
        seen, hits, total = {}, 0, 0
        for i, (r, g) in enumerate(sequence):
            replica = replica_of(i, r, g)
            if r > 0:
                total += 1
                hits += replica in seen[g]
            seen.setdefault(g, set()).add(replica)
        return hits / total

    routed = hit_rate(lambda i, r, g: served[g][r])
    round_robin = hit_rate(lambda i, r, g: i % 2)
    with capsys.disabled():
        print(f"\nprefix affinity: {routed:.0%} of repeated prefixes on a replica holding them "
              f"(round-robin over the same sequence: {round_robin:.0%})")
    assert routed == 1.0 and round_robin == pytest.approx(2 / 3)
    assert all(len(set(s)) == 1 for s in served.values())
    assert len({s[0] for s in served.values()}) == 2          # both replicas hold prefixes


def _replica_actor(ray, replica_id: str):
    return ray.get_actor(f"SERVE_REPLICA::jaxinfer#JaxinferReplica#{replica_id}", namespace="serve")



def _waiting(url: str, replica: str) -> float:
    """jaxinfer_num_requests_waiting of one replica (its /metrics, pinned)."""
    text = httpx.get(url + "/metrics", headers={REPLICA: replica}, timeout=60).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("jaxinfer_num_requests_waiting{"))


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _replica_ids(ray) -> set[str]:
    """The ids of the live replica actors."""
    prefix = "SERVE_REPLICA::jaxinfer#JaxinferReplica#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def _running_replicas(serve) -> int:
    deployment = serve.status().applications["jaxinfer"].deployments["JaxinferReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def test_killed_replica_fails_its_requests_and_comes_back(cluster, client):
    """With one replica's engine paused (the pinned /pause), requests wait
    there: a client leaving aborts its request; killing the replica ends a
    waiting stream with the replica_failed event, new requests go to the
    other replica, and Ray starts a replacement that takes requests."""
    ray, serve, url, _ = cluster
    victim = httpx.get(url + "/v1/models", timeout=60).headers[REPLICA]
    before = _replica_ids(ray)
    assert victim in before and len(before) == 2
    pause = httpx.post(url + "/pause", json={"mode": "wait"}, headers={REPLICA: victim}, timeout=60)
    assert pause.status_code == 200 and pause.headers[REPLICA] == victim, pause.text
    body = {"model": MODEL, "prompt": "我爱", "max_tokens": 4, "stream": True}
    # A client that leaves mid-stream aborts its request on the replica, as with one server.
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={REPLICA: victim},
                      timeout=60) as stream:
        assert stream.status_code == 200
        _wait_for(lambda: _waiting(url, victim) == 1)
    _wait_for(lambda: _waiting(url, victim) == 0)
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={REPLICA: victim},
                      timeout=60) as stream:                 # waits in the paused engine
        assert stream.status_code == 200 and stream.headers[REPLICA] == victim
        ray.kill(_replica_actor(ray, victim), no_restart=True)
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - t0 < 30
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "replica_failed", error
    # New requests go to the live replica meanwhile, and the victim's id is gone.
    for _ in range(3):
        done = client.completions.with_raw_response.create(model=MODEL, prompt="大家", max_tokens=2)
        assert done.parse().choices[0].text and done.headers[REPLICA] != victim
    gone = httpx.get(url + "/v1/models", headers={REPLICA: victim}, timeout=60)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "replica_not_found"
    deadline = time.monotonic() + 60              # Ray starts a replacement, which takes requests
    while True:
        new = _replica_ids(ray) - before
        if new:
            reply = httpx.get(url + "/v1/models", headers={REPLICA: min(new)}, timeout=60)
            if reply.status_code == 200:
                break
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)
    assert victim not in _replica_ids(ray) and _running_replicas(serve) == 2


def test_router_ranks_holders_first_unless_they_are_far_busier():
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from collections import namedtuple
    from jaxinfer.scale.router import PrefixAffinityRouter
    from jaxinfer.serving.pages import page_hashes

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)    # rank() needs no Ray state
    router.initialize_state(imbalance=2)
    loads = {"a": 0, "b": 0, "c": 0}
    router._load = lambda r: loads[r.replica_id]
    a, b, c = (namedtuple("Replica", "replica_id")(n) for n in "abc")
    hashes = page_hashes(range(8), 4)
    router.table.record(hashes[:1], "b")
    router.table.record(hashes, "c")
    assert router.rank([c, b, a], hashes) == [[c], [a, b, c]]      # equal loads: fewest pages first
    assert router.rank([c, b, a], hashes[:1]) == [[b, c], [a, b, c]]
    assert router.rank([a, b], hashes) == [[b], [a, b]]             # c gone: the next-longest match
    loads["c"] = 2
    assert router.rank([a, b, c], hashes) == [[c], [a, b, c]]      # 2 busier: within the imbalance
    loads["c"] = 3
    assert router.rank([a, b, c], hashes) == [[a, b, c]]           # 3 busier: load wins
    assert router.rank([a, b, c], page_hashes(range(9, 13), 4)) == [[a, b, c]]   # no holder
    with pytest.raises(ValueError, match="imbalance must be >= 0"):
        router.initialize_state(imbalance=-1)


def test_serve_run_arguments():
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from jaxinfer.scale.run import app

    with pytest.raises(ValueError, match="replicas='two': expected int"):
        app({"replicas": "two"})
    with pytest.raises(ValueError, match="listen='8000': expected host:port"):
        app({"listen": "8000"})
    with pytest.raises(ValueError, match="router must be one of"):
        app({"router": "round_robin"})
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        app({"replicas": "0"})
    with pytest.raises(ValueError, match="unknown config keys"):
        app({"replicas": "2", "no_such_key": "1"})
    with pytest.raises(ValueError, match="tp=2 and num_processes=1 are not supported"):
        app({"replicas": "2", "tp": "2"})
