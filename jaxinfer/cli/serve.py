"""`jaxinfer serve`: load a model once, warm its programs, serve HTTP.

    jaxinfer serve --config configs/smollm2-135m-instruct.yaml [--host 127.0.0.1] [--port 8000]
                   [--api-key KEY] [--served-model-name NAME] [key=value ...]
    jaxinfer serve --config ... --replicas N [--router prefix|pow2] [--replica-cpus C]

With --replicas, N copies of the server run as Ray Serve replicas behind a
router that sends a request to the replica holding its prompt's first
pages (`jaxinfer.scale`; the `ray` extra; docs/scaling.md).

The config's keys mean what they mean for `jaxinfer generate` (model,
dtype, max_seq_len, decode_chunk, max_num_seqs, prefill_chunk_size,
sampling defaults) plus the server's own (max_waiting_requests, warmup);
max_new_tokens, chat, system_prompt, stop, min_tokens and ignore_eos are
per-request fields of the API and the config's values are not used.

uvicorn serves the app on a socket bound before the model loads (a busy
port is a usage error at once). SIGINT or SIGTERM stops accepting
connections, lets running requests finish for up to `--shutdown-timeout`
seconds, aborts the rest, stops the engine thread and exits with status 0.

With tp > 1 the model is sharded over tp devices; with num_processes > 1
over the devices of a job of processes, one command each (`cli.job`):

    jaxinfer serve --config C tp=2 coordinator=HOST:PORT num_processes=2 process_id=0   # serves
    jaxinfer serve --config C tp=2 coordinator=HOST:PORT num_processes=2 process_id=1   # follows

Process 0 serves HTTP; when the job fails (a process is gone) it stops
serving and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jaxinfer.cli import job as job_cli
from jaxinfer.cli.disagg import add_worker_args, start_engine
from jaxinfer.config import GenerationConfig
from jaxinfer.progress import Progress
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import enable_compilation_cache

API_KEY_ENV = "JAXINFER_API_KEY"


def add_serve_parser(subparsers):
    """Register `serve` on a `jaxinfer` subparsers object."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="config keys: as `jaxinfer generate --help` lists them")
    p.add_argument("--config", help="YAML generation config (see configs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/ routes "
                                     f"(default: ${API_KEY_ENV} when set)")
    p.add_argument("--served-model-name", help="the model name clients pass (default: the config's model)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body, bytes (default 1 MiB; HTTP 413 beyond)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let running requests finish before they "
                        "are aborted (default 30)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress, warnings only")
    add_worker_args(p, default_workers=0)
    p.add_argument("--replicas", type=int, default=0,
                   help="serve N replicas on Ray Serve with prefix-aware routing (needs the ray "
                        "extra; docs/scaling.md); 0: this process alone (default)")
    p.add_argument("--router", default="prefix", choices=("prefix", "pow2"),
                   help="with --replicas: prefix (the replica holding the prompt's first pages, "
                        "load as the tiebreak; default) or pow2 (Ray's power of two choices)")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="with --replicas: Ray CPUs each replica takes (default 1)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.set_defaults(func=cmd_serve, parser=p)
    return p


def cmd_serve(args) -> int:
    # The serve extra (FastAPI, uvicorn, prometheus_client) is imported here, the one place
    # that needs it, so that the other commands run with the core dependencies only.
    from jaxinfer.server import run as server

    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    if not 0 <= args.port <= 65535:
        args.parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1 or args.shutdown_timeout < 0:
        args.parser.error("--max-request-bytes must be >= 1 and --shutdown-timeout >= 0")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    log = (lambda msg: None) if args.quiet else (
        lambda msg: print(f"[jaxinfer serve] {msg}", file=sys.stderr, flush=True))
    if args.replicas:
        return serve_replicas(args, api_key, log)
    sharded = cfg.tp > 1 or cfg.num_processes > 1
    if sharded and args.prefill_workers:
        args.parser.error("tp > 1 or num_processes > 1 cannot be combined with --prefill-workers")
    job_cli.job_settings(cfg, args.heartbeat_s)   # bad coordinator settings: a usage error, first
    sock = server.bind_socket(args.host, args.port) if cfg.process_id == 0 else None
    job = None
    progress = Progress(enabled=False if args.quiet else None)
    enable_compilation_cache()
    t0 = time.perf_counter()
    model_name = args.served_model_name or cfg.model
    if args.prefill_workers < 0:
        args.parser.error(f"--prefill-workers must be >= 0, got {args.prefill_workers}")
    if args.prefill_workers:
        engine = start_engine(cfg, args, start=False)
        app = server.build_engine_server(engine.llm, engine, model_name=model_name,
                                         defaults=cfg.sampling, api_key=api_key,
                                         max_request_bytes=args.max_request_bytes)
        log(f"{args.prefill_workers} prefill worker process(es) and this decode process up in "
            f"{time.perf_counter() - t0:.1f} s")
    else:
        if sharded:
            llm, job = job_cli.sharded_llm(cfg, progress=progress, heartbeat_s=args.heartbeat_s)
            if job is not None and not job.leader:
                return job_cli.leave(job, job_cli.follow(llm, job, log))
        else:
            llm = LLM.from_config(cfg, progress=progress)
        log(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f} s")
        app = server.build_server(llm, model_name=model_name, max_num_seqs=cfg.max_num_seqs,
                              max_waiting_requests=cfg.max_waiting_requests, defaults=cfg.sampling,
                              api_key=api_key, max_request_bytes=args.max_request_bytes,
                              warmup=cfg.warmup, long_prefill_chunk_size=cfg.long_prefill_chunk_size,
                              log=log)
    host, port = sock.getsockname()[:2]
    log(f"serving {app.settings.model_name!r} at http://{host}:{port}/v1 ({cfg.max_num_seqs} slots, "
        f"max_seq_len {cfg.max_seq_len}, api key {'required' if api_key else 'off'})")
    uvicorn = server.uvicorn_server(app.app, "warning" if args.quiet else "info",
                                    args.shutdown_timeout)
    failed = job_cli.watch(job, app.engine.engine, uvicorn, log) if job is not None else []
    uvicorn.run(sockets=[sock])
    log("stopped")
    if job is not None:
        job_cli.leave(job, 1 if failed else 0)
    return 1 if failed else 0


def serve_replicas(args, api_key, log) -> int:
    """`jaxinfer serve --replicas N`: the replicas on Ray Serve until SIGINT/SIGTERM."""
    if args.replicas < 0 or args.replica_cpus < 0:
        args.parser.error(f"--replicas and --replica-cpus must be >= 0, got {args.replicas} and "
                          f"{args.replica_cpus}")
    if args.prefill_workers:
        args.parser.error("--replicas and --prefill-workers cannot be combined")
    try:
        from jaxinfer.scale.deployment import ReplicaSettings
        from jaxinfer.scale.run import serve_replicas as run
    except ImportError as e:
        args.parser.error(f"--replicas needs Ray Serve: pip install -e \".[ray]\" ({e})")
    settings = ReplicaSettings(config=os.path.abspath(args.config) if args.config else None,
                               overrides=tuple(args.overrides),
                               served_model_name=args.served_model_name, api_key=api_key,
                               max_request_bytes=args.max_request_bytes)
    run(settings, replicas=args.replicas, host=args.host, port=args.port, router=args.router,
        replica_cpus=args.replica_cpus, log=log)
    log("stopped")
    return 0
