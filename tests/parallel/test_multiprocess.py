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
    tokens equal; every process exits 0 and says goodbye."""
    job, codes, ref = _job(tmp_path, "job", reference=True)
    assert codes == [0, 0, 0] and job["missing"] == []
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
