"""One model across processes (jaxinfer.parallel.multiprocess): tp=2 over two
processes of a `jax.distributed` job (one CPU device each, gloo collectives)
against tp=2 over two forced host devices of one process; a process killed
mid-run; bad coordinator settings. The processes run tests/multiprocess_cases.py."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.config import GenerationConfig
from jaxinfer.parallel.multiprocess import JobSettings

TESTS = pathlib.Path(__file__).resolve().parents[1]
CASES = str(TESTS / "multiprocess_cases.py")
TIMEOUT_S = 300          # a hang fails the test instead of CI's whole run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def _start(args, devices: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CASES, *map(str, args)], cwd=TESTS, env=_env(devices),
                            stdout=log, stderr=subprocess.STDOUT)


def _job(tmp_path, name: str, kill_after_calls: int = 0, reference: bool = False):
    """Run the 2-process job (and the one-process reference beside it);
    returns (process 0's JSON, exit codes, the reference's JSON or None)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    out, ref = tmp_path / f"{name}.json", tmp_path / "reference.json"
    logs = [open(tmp_path / f"{name}-{i}.log", "wb") for i in range(3)]
    procs = [_start(["rank", coordinator, i, out, kill_after_calls], 1, logs[i]) for i in range(2)]
    if reference:
        procs.append(_start(["reference", ref], 2, logs[2]))
    try:
        codes = [p.wait(TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    tails = {p.name: p.read_text(errors="replace")[-3000:] for p in tmp_path.glob(f"*.log")}
    assert codes is not None, f"the job hung (killed after {TIMEOUT_S} s): {tails}"
    result = json.loads(out.read_text()) if out.exists() else None
    assert result is not None, f"process 0 wrote nothing (exit codes {codes}): {tails}"
    return result, codes, json.loads(ref.read_text()) if reference and ref.exists() else None


@pytest.mark.slow
def test_two_processes_match_one_process_tp2(tmp_path):
    """Greedy tokens equal, their log-probs within 1e-5, seeded sampled
    tokens equal; every process exits 0 and says goodbye. Before them,
    process 0 refused a structured request, `score` and `update_weights`
    with a message saying why, and the job went on."""
    job, codes, ref = _job(tmp_path, "job", reference=True)
    assert codes == [0, 0, 0] and job["missing"] == []
    across = "is not supported with a model across processes (num_processes > 1)"
    assert job["refused"] == [f"ValueError: structured output {across}",
                              f"RuntimeError: token_logprobs {across}: only the serving "
                              "scheduler's programs run on every process",
                              f"NotImplementedError: update_weights {across}"]
    assert job["greedy"] == ref["greedy"]
    assert job["seeded"] == ref["seeded"]
    for a, b in zip(job["logprobs"], ref["logprobs"]):
        assert len(a) == len(b) == len(job["greedy"][0])
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_killed_process_stops_the_job_with_a_clear_error(tmp_path):
    """Process 1 SIGKILLed after 6 program calls: process 0's engine stops
    with a JobError naming the failed collective, every request in flight
    ends with it (what a client sees), and process 0 exits by itself."""
    result, codes, _ = _job(tmp_path, "kill", kill_after_calls=6)
    assert codes == [0, -9]
    assert result["errors"], result
    for error in result["errors"]:
        assert "the tensor-parallel job of 2 processes stopped" in error, error
    assert result["engine_error"].startswith("JobError('the tensor-parallel job of 2 processes "
                                             "stopped: a step failed on process 0"), result
    assert "Gloo" in result["engine_error"]


@pytest.mark.parametrize("settings, tp, message", [
    (JobSettings("127.0.0.1", 2, 0), 2, "coordinator must be host:port"),
    (JobSettings("127.0.0.1:0", 2, 1), 2,
     "coordinator must be host:port with a port in [1, 65535]"),
    (JobSettings("no-such-host.invalid:1234", 2, 1), 2,
     "host 'no-such-host.invalid' does not resolve"),
    (JobSettings("127.0.0.1:1234", 2, 2), 2, "process_id must be in [0, num_processes=2), got 2"),
    (JobSettings("127.0.0.1:1234", 0, 0), 2, "num_processes must be >= 1, got 0"),
    (JobSettings("127.0.0.1:1234", 2, 1), 3, "tp must be a multiple of num_processes=2"),
    (JobSettings("127.0.0.1:1234", 2, 1, heartbeat_s=0), 2, "must be >= 1 (seconds)"),
])
def test_bad_job_settings_are_refused_before_any_work(settings, tp, message):
    with pytest.raises(ValueError) as e:
        settings.check(tp)
    assert message in str(e.value)


def test_a_coordinator_port_in_use_is_refused_on_process_0():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"process 0 hosts the coordination service on port "
                                             f"{port}, which this host cannot bind"):
            JobSettings(f"127.0.0.1:{port}", 2, 0).check(2)
        JobSettings(f"127.0.0.1:{port}", 2, 1).check(2)     # a follower only connects there


@pytest.mark.parametrize("overrides, message", [
    (dict(num_processes=2), "num_processes > 1 needs coordinator"),
    (dict(num_processes=2, coordinator="h:1", process_id=2),
     "process_id must be in [0, num_processes=2)"),
    (dict(num_processes=2, coordinator="h:1", tp=3), "tp must be a multiple of num_processes=2"),
    (dict(tp=2, weights="q4"), "tp > 1 needs weights float32 or bfloat16"),
    (dict(coordinator=5), "coordinator must be host:port or null, got 5"),
])
def test_config_job_keys_are_checked(overrides, message):
    with pytest.raises(ValueError) as e:
        GenerationConfig(**overrides)
    assert message in str(e.value)


def _serve_process(cfg, process_id: int, coordinator: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--config", str(cfg),
                             "--port", "0", f"coordinator={coordinator}", "num_processes=2",
                             f"process_id={process_id}"],
                            env={**_env(1), "JAXINFER_LOAD_CACHE": "0"}, stdout=log,
                            stderr=subprocess.STDOUT)


def _wait_for(path, pattern: str, procs, timeout_s: float = TIMEOUT_S) -> str:
    import re
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace"))
        if found:
            return found.group(1)
        assert all(p.poll() is None for p in procs), path.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {path} after {timeout_s} s")


@pytest.mark.slow
def test_serve_over_two_processes_then_a_killed_one_ends_it(toy_folder, tmp_path):
    """`jaxinfer serve` as two commands (tp=2, one device each): process 0
    answers the OpenAI client as one process does ("你好" -> "世界",
    streamed too); after process 1 is SIGKILLed the next request gets an
    error naming the stopped job (500 from its failed step, or 503 when an
    earlier step found the job gone first) and process 0 exits with status 1."""
    import openai

    cfg = tmp_path / "toy-tp2.yaml"
    cfg.write_text(f"model: {toy_folder}\nmax_seq_len: 32\ndecode_chunk: 4\nmax_num_seqs: 2\n"
                   "chat: false\nwarmup: false\ntp: 2\n", encoding="utf-8")
    coordinator = f"127.0.0.1:{_free_port()}"
    paths = [tmp_path / f"serve-{i}.log" for i in range(2)]
    logs = [open(p, "wb") for p in paths]
    procs = [_serve_process(cfg, i, coordinator, logs[i]) for i in range(2)]
    try:
        url = _wait_for(paths[0], r"at (http://127\.0\.0\.1:\d+)/v1", procs)
        follower = int(_wait_for(paths[1], r"\(pid (\d+)\): following process 0", procs))
        assert follower == procs[1].pid
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = str(toy_folder)
        reply = client.completions.create(model=model, prompt="你好", max_tokens=3)
        assert reply.choices[0].text == "世界"
        pieces = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="你好", max_tokens=3, stream=True) if c.choices]
        assert "".join(pieces) == "世界"
        procs[1].kill()
        assert procs[1].wait(30) == -9
        with pytest.raises(openai.APIError) as e:
            client.completions.create(model=model, prompt="你好", max_tokens=3)
        assert "the tensor-parallel job of 2 processes stopped" in str(e.value)
        assert procs[0].wait(120) == 1
        assert "the tensor-parallel job of 2 processes stopped" in paths[0].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def test_launch_starts_n_processes_with_the_job_keys(tmp_path):
    """The local launcher appends coordinator, num_processes and process_id
    to each process's command and, when asked, pins process i to its own
    cores; a failing process's status is the launcher's."""
    from jaxinfer.cli import launch

    script = ("import os, sys, pathlib; keys = dict(a.split('=') for a in sys.argv[1:]); "
              f"pathlib.Path(r'{tmp_path}', keys['process_id'])"
              ".write_text(' '.join(sys.argv[1:]) + ' ' + repr(sorted(os.sched_getaffinity(0)))); "
              "sys.exit(3 if keys['process_id'] == '1' and 'fail' in keys else 0)")
    allowed = sorted(os.sched_getaffinity(0))
    cores = [allowed[:len(allowed) // 2], allowed[len(allowed) // 2:2 * (len(allowed) // 2)]]
    if len(allowed) < 2:
        cores = [allowed, allowed]              # fewer cores than processes: no pinning
    assert launch.run([sys.executable, "-c", script], 2, coordinator="127.0.0.1:5555",
                      cpus_per_process=None) == 0
    assert [(tmp_path / str(i)).read_text() for i in range(2)] == [
        f"coordinator=127.0.0.1:5555 num_processes=2 process_id={i} {cores[i]}" for i in range(2)]
    assert launch.run([sys.executable, "-c", script], 2) == 0          # default: not pinned
    assert [(tmp_path / str(i)).read_text().endswith(f" {allowed}") for i in range(2)] == [True] * 2
    assert launch.run([sys.executable, "-c", script, "fail=1"], 2) == 3
    with pytest.raises(ValueError, match="need num_processes >= 1 and a command"):
        launch.run([], 2)
    with pytest.raises(ValueError, match=f"2 processes x {len(allowed)} cores need "
                                         f"{2 * len(allowed)}, only {len(allowed)} allowed"):
        launch.run([sys.executable, "-c", script], 2, cpus_per_process=len(allowed))
    with pytest.raises(ValueError, match="cpus_per_process must be >= 0, got -1"):
        launch.core_sets(2, -1)


def test_serve_refuses_bad_coordinator_settings_before_loading(capsys):
    """A usage error (status 2, one line) before any model is read or port bound."""
    from jaxinfer.cli import main

    assert main(["serve", "model=no-such-model", "tp=2", "num_processes=2", "process_id=1",
                 "coordinator=127.0.0.1"]) == 2
    assert ("jaxinfer serve: error: coordinator must be host:port with a port in [1, 65535], got "
            "'127.0.0.1'") in capsys.readouterr().err


def test_host_inputs_are_sent_as_their_changed_rows():
    """The codec sends a leaf whole the first time and when over half its
    rows changed, else the changed rows; decoding gives back every call's
    inputs exactly, other leaves (None, scalars) as they are."""
    import pickle

    from jaxinfer.parallel.multiprocess.codec import Changed, HostCodec

    leader, follower = HostCodec(), HostCodec()
    tables = np.arange(32, dtype=np.int32).reshape(8, 4)
    calls = [tables, tables.copy(), np.where(np.arange(8)[:, None] == 3, -1, tables),
             np.zeros((8, 4), np.int32), np.zeros((4, 4), np.int32)]
    sent_kinds = []
    for x in calls:
        tree = {"tables": x, "tokens": np.array([1, 2, 3]), "none": None, "n": 5}
        sent = pickle.loads(pickle.dumps(leader.encode("step", 3, tree)))
        sent_kinds.append(type(sent["tables"]).__name__)
        got = follower.decode("step", 3, sent)
        np.testing.assert_array_equal(got["tables"], x)
        assert got["none"] is None and got["n"] == 5
        np.testing.assert_array_equal(got["tokens"], [1, 2, 3])
    assert sent_kinds == ["ndarray", "Changed", "Changed", "ndarray", "ndarray"]
    with pytest.raises(ValueError, match="without its previous value"):
        HostCodec().decode("step", 0, Changed(np.array([0]), np.zeros((1, 4), np.int32)))


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "Hi", "tp=2"], "tp and num_processes are jaxinfer serve's"),
    (["disagg", "tp=2"], "disagg takes --prefill-tp and --decode-tp"),
])
def test_commands_other_than_serve_refuse_the_job_keys(argv, message, capsys):
    from jaxinfer.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


class _Store:
    """The coordination service's key-value calls Liveness makes, in a dict."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.values
        self.values[key] = value.encode()

    def key_value_try_get_bytes(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_liveness_reports_a_follower_not_heard_from_for_stall_s():
    """Process 0 sees each follower's beat count change; one whose count
    stops (or never starts) for more than stall_s is reported with how long."""
    from jaxinfer.parallel.multiprocess import Liveness

    store, now = _Store(), [0.0]
    clock = lambda: now[0]                                   # noqa: E731
    leader = Liveness(3, 0, stall_s=5, client=store, clock=clock)
    one, two = (Liveness(3, rank, stall_s=5, client=store, clock=clock) for rank in (1, 2))
    for t in (1, 2, 3, 4):
        now[0] = t
        one.beat()
        two.beat()
        assert leader.stalled() == []
    for t in (5, 7, 9):                # process 2 stops beating at t=4
        now[0] = t
        one.beat()
        assert leader.stalled() == []
    now[0] = 10
    one.beat()
    assert leader.stalled() == [(2, 6.0)]
    quiet = Liveness(2, 0, stall_s=5, client=store, clock=clock)   # rank 1 beats no more
    now[0] = 16
    assert quiet.stalled() == []       # its count, first seen now
    now[0] = 22
    assert quiet.stalled() == [(1, 6.0)]
    with pytest.raises(ValueError, match="stall_s and every_s must be > 0"):
        Liveness(2, 0, stall_s=0, client=store)
