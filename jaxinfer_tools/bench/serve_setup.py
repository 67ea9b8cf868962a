"""`python -m jaxinfer_tools.bench --setup-peers`: set up `--serve-load`'s
peers (`serve_peers`) ahead of a benchmark run and smoke-test each server
with one streamed completion and one streamed chat request; nothing is
timed beyond the set-up and start-up seconds it reports."""

from __future__ import annotations

import os
import pathlib
import sys
import time
from typing import Optional

from jaxinfer import GenerationConfig
from jaxinfer.testing import XLA_CACHE_ENV, Tokenizer, resolve_model
from jaxinfer_tools.bench.serve_compare import LoadSweep, free_port, peer_names
from jaxinfer_tools.bench.serve_peers import MODEL_NAME, PeerUnavailable, server_command
from jaxinfer_tools.bench.serve_workloads import ServerProcess, first_request
from jaxinfer_tools.bench.serve_peers import peers_dir, setup_info
from jaxinfer_tools.bench.report import default_out


def setup_peers(choice: str, config: str, smoke: bool = True, with_jaxinfer: bool = False,
                out: Optional[str] = None) -> int:
    """Set up the peers of `choice` ("all" or one of PEERS) for `config`'s
    GGUF and, with `smoke`, start each server once (jaxinfer too with
    `with_jaxinfer`, on $JAXINFER_XLA_CACHE_DIR where set, else on an
    empty compilation cache under `out`, by default a new temporary
    folder, as the servers' logs), send it one streamed
    completion and one streamed chat request of 8 tokens, and stop it.
    Prints one JSON line per server ({"server", "setup_s" (this call's
    seconds of set-up, 0 when it was set up before), "setup" (the recorded
    set-up), "completion", "chat" (`serve_workloads.first_request`'s
    dicts), "status"}). Returns 0 when every server answered both, else 1."""
    import json


    cfg = GenerationConfig.load(config, ())
    gguf = str(resolve_model(cfg.model))
    tok = Tokenizer.from_source(gguf)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    logs = pathlib.Path(out or default_out()) / "setup-peers"
    names = (["jaxinfer"] if with_jaxinfer else []) + peer_names(choice)[1:]
    log = lambda msg: print(f"[setup-peers] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    sweep, failed = LoadSweep(), 0
    for name in names:
        row, t0 = {"server": name}, time.perf_counter()
        try:
            cmd, env = server_command(name, free_port(), config=config, overrides=(), gguf=gguf,
                                      max_seq_len=sweep.max_seq_len, max_num_seqs=sweep.max_num_seqs,
                                      threads=os.cpu_count() or 1, log=log)
        except PeerUnavailable as e:
            row["status"], failed = f"skipped: {e}", failed + 1
            print(json.dumps(row), flush=True)
            continue
        row["setup_s"] = round(time.perf_counter() - t0, 1)
        row["setup"] = {"vllm": setup_info(peers_dir() / "vllm-cpu"),
                        "llamacpp": setup_info(peers_dir() / "llama-server")}.get(name)
        if name == "jaxinfer":
            env = {**env, XLA_CACHE_ENV: os.environ.get(XLA_CACHE_ENV) or str(logs / "xla-cache")}
        if smoke:
            row.update(_smoke(name, cmd, env, sweep, count, logs, log))
        failed += row.get("status", "ok") != "ok"
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


def _smoke(name, cmd, env, sweep, count, logs: pathlib.Path, log) -> dict:
    """One start of a server with a streamed completion and chat request
    (`setup_peers`); returns {"completion", "chat", "status", "log"}."""
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    log(f"{name}: starting {' '.join(cmd)}")
    row = {"log": str(logs / f"{name}.log")}
    try:
        with ServerProcess(cmd, url, logs / f"{name}.log", sweep.start_timeout_s, env) as server:
            row["completion"] = first_request(server, MODEL_NAME, "The capital of France is", 8, count)
            row["chat"] = first_request(server, MODEL_NAME, "Say hello.", 8, count, chat=True)
        ok = row["completion"]["ok"] and row["chat"]["ok"]
        row["status"] = "ok" if ok else "failed: " + (row["completion"]["error"] or row["chat"]["error"])
    except RuntimeError as e:
        row["status"] = f"failed: {str(e)[-800:]}"
    return row
