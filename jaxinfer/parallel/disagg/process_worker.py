"""A prefill worker process (`python -m jaxinfer.parallel.disagg.process_worker
<json>`), started and supervised by the decode process
(`process.ProcessPrefillClient`): it joins the job, loads its model, then
serves requests through the coordination service's key-value store (the
keys are listed in `process`) until told to stop. It exits by itself when
its parent, the decode process, is gone.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from typing import Optional, Sequence

from jaxinfer.parallel.disagg.process import WorkerSpec, _kv, _try_get, build_llm, configure_host
from jaxinfer.parallel.disagg.scheduler import PrefillResult
from jaxinfer.parallel.disagg.transfer import PullTransport
from jaxinfer.parallel.disagg.worker import PrefillWorker


def worker_main(argv: Sequence[str]) -> None:
    """Join the job, load the model, serve until told to stop."""
    cfg = json.loads(argv[0])
    if cfg.get("parent_pid"):
        _exit_with_parent(cfg["parent_pid"])
    spec = WorkerSpec(**{**cfg["spec"], "llm_kwargs": tuple(map(tuple, cfg["spec"]["llm_kwargs"])),
                         "cpus": tuple(cfg["spec"]["cpus"]) if cfg["spec"]["cpus"] else None})
    configure_host(spec.tp)
    import jax

    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(cfg["coordinator"], num_processes=cfg["num_processes"],
                               process_id=cfg["process_id"],
                               initialization_timeout=cfg["init_timeout_s"],
                               heartbeat_timeout_seconds=cfg["heartbeat_s"])

    client, ns = _kv(), cfg["namespace"]
    llm = build_llm(spec, jax.local_devices()[:spec.tp])
    transport = PullTransport(spec.host)
    worker = PrefillWorker(llm, transport, cfg["worker"])
    if spec.stall_on_prompt_len:
        _stall_hook(worker, spec)
    client.key_value_set(f"{ns}/address", transport.address)
    client.key_value_set(f"{ns}/ready", "1")
    _serve(client, ns, worker, transport, cfg["hold_timeout_s"])


def _exit_with_parent(parent_pid: int, every_s: float = 0.5) -> None:
    """Exit this process (code 1) within `every_s` of its parent, the decode
    process, being gone, in every phase (joining, loading, serving). JAX
    ends a serving worker itself when the coordinator goes, but one still
    joining waits out its start-up timeout (minutes)."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        print(f"prefill worker: the decode process (pid {parent_pid}) is gone; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _stall_hook(worker: PrefillWorker, spec: WorkerSpec) -> None:
    """Fault injection (tests): sleep `spec.stall_s` in a step that prefills
    a prompt of `spec.stall_on_prompt_len` tokens."""
    original = worker.runner.step

    def step(segments, *args, **kwargs):
        jobs = [worker.slots[s.slot] for s in segments]
        if any(j is not None and len(j.request.prompt_ids) == spec.stall_on_prompt_len for j in jobs):
            time.sleep(spec.stall_s)
        return original(segments, *args, **kwargs)

    worker.runner.step = step


def _serve(client, ns: str, worker: PrefillWorker, transport, hold_timeout_s: float) -> None:
    """The worker's loop: free acknowledged KV, take new requests (waiting
    up to 50 ms only when idle), drop cancelled ones, mark the requests the
    next step prefills as started, run the step. Returns when told to stop."""
    seq, seqs, held_reported = 0, {}, -1

    def answer(rid, result):
        client.key_value_set_bytes(f"{ns}/done/{seqs.pop(rid)}", pickle.dumps(result))

    while _try_get(client, f"{ns}/stop") is None:
        for key in transport.held_keys():                  # acknowledged pulls: free the buffers
            if _try_get(client, f"{ns}/ack/{key}") is not None:
                transport.release(key)
                client.key_value_delete(f"{ns}/ack/{key}")
        transport.expire(hold_timeout_s)
        if transport.num_held != held_reported:
            held_reported = transport.num_held
            client.key_value_set(f"{ns}/held", str(held_reported), allow_overwrite=True)
        while (raw := _next_request(client, f"{ns}/req/{seq}", wait=not worker.busy)) is not None:
            rid, request = pickle.loads(raw)
            seqs[rid] = seq
            client.key_value_delete(f"{ns}/req/{seq}")
            seq += 1
            if _try_get(client, f"{ns}/cancel/{rid}") is not None:
                answer(rid, PrefillResult(rid, error="cancelled", worker=worker.worker_id))
            else:
                worker.add(rid, request)
        for rid in worker.request_ids():
            if _try_get(client, f"{ns}/cancel/{rid}") is not None and worker.cancel(rid):
                answer(rid, PrefillResult(rid, error="cancelled", worker=worker.worker_id))
        for rid in worker.starting():                      # the next step prefills these
            client.key_value_set(f"{ns}/started/{seqs[rid]}", "1", allow_overwrite=True)
        for result in worker.step():
            answer(result.request_id, result)


def _next_request(client, key: str, wait: bool) -> Optional[bytes]:
    if not wait:
        return _try_get(client, key)
    try:
        return client.blocking_key_value_get_bytes(key, 50)
    except Exception as e:  # noqa: BLE001
        if "DEADLINE_EXCEEDED" in str(e):
            return None
        raise


if __name__ == "__main__":
    worker_main(sys.argv[1:])
