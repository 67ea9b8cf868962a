"""`jaxinfer disagg`: the disaggregated engine from the command line.

    jaxinfer disagg --config configs/smollm2-135m-instruct.yaml --prefill-workers 1 \\
        [--prefill-tp 1] [--decode-tp 1] [--prefill-cpus 0] [--decode-cpus 1] \\
        [--heartbeat-s 60] [--prompts-file FILE] [key=value ...]

This process becomes the decode worker (jax.distributed process 0), starts
and supervises `--prefill-workers` prefill processes, then reads prompts
(one per line, from the file or stdin), submits each as soon as it is read
(so later prompts arrive while earlier ones decode) and prints each
completion when it finishes: `--- [line N] finish_reason=... ttft=...s`
and the text, or `--- [line N] error: ...` (a prompt too long for
max_seq_len is reported so and skipped; the exit code is then 1). The
workers' health goes to stderr at the end. The HTTP server's disaggregated mode builds the same
engine (`disagg.engine.start_process_engine`) in place of its
`EngineThread`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from jaxinfer.cache import resolve_layout
from jaxinfer.parallel.disagg.engine import start_process_engine
from jaxinfer.parallel.disagg.process import DEFAULT_HEARTBEAT_S, WorkerSpec
from jaxinfer.config import GenerationConfig
from jaxinfer.cli.generate import read_prompts
from jaxinfer.tokenizer.chat import read_template


def add_disagg_parser(sub) -> None:
    p = sub.add_parser("disagg", help="prefill/decode disaggregation over processes")
    p.add_argument("--config", help="YAML generation config (see configs/)")
    add_worker_args(p, default_workers=1)
    p.add_argument("--prompts-file", help="one prompt per line (default: stdin)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up after this long")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.set_defaults(func=cmd_disagg, parser=p)


def add_worker_args(p, default_workers: int) -> None:
    """The worker flags `jaxinfer disagg` and `jaxinfer serve` share."""
    p.add_argument("--prefill-workers", type=int, default=default_workers,
                   help=f"prefill processes (default {default_workers}"
                        + ("; 0: prefill and decode in this process)" if default_workers == 0 else ")"))
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of each prefill worker")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of the decode worker")
    p.add_argument("--prefill-cpus", default="", help="cores for the prefill workers, e.g. 0 or 0-1")
    p.add_argument("--decode-cpus", default="", help="cores for the decode worker, e.g. 1")
    p.add_argument("--heartbeat-s", type=int, default=DEFAULT_HEARTBEAT_S,
                   help="a process of the job stalled this long is aborted "
                        f"(jax.distributed heartbeat timeout; default {DEFAULT_HEARTBEAT_S})")


def start_engine(cfg, args, *, start: bool = True):
    """The process-disaggregated engine for a `GenerationConfig` and the
    worker flags of `add_worker_args` (`disagg.engine.start_process_engine`).

    Raises:
      ValueError: --prefill-workers < 1, --heartbeat-s < 1, a bad CPU list, an
        unknown layout or kv_cache_dtype, or a layout without page transfer.
    """

    if args.prefill_workers < 1:
        raise ValueError(f"--prefill-workers must be >= 1, got {args.prefill_workers}")
    check_heartbeat(args.heartbeat_s)
    check_cache(cfg)
    prefill_cpus, decode_cpus = parse_cpus(args.prefill_cpus), parse_cpus(args.decode_cpus)
    llm_kwargs = (("max_seq_len", cfg.max_seq_len), ("decode_chunk", cfg.decode_chunk),
                  ("prefill_chunk_size", cfg.prefill_chunk_size), ("max_num_seqs", cfg.max_num_seqs),
                  ("kv_cache_dtype", cfg.kv_cache_dtype), ("layout", cfg.cache.layout))
    if cfg.page_size is not None:              # both sides must agree on it
        llm_kwargs += (("page_size", cfg.page_size),)
    llm_kwargs += (("grammar_cache_bytes", cfg.grammar_cache_bytes),)
    if cfg.chat_template is not None:          # checked here, before any worker starts
        read_template(cfg.chat_template)
        llm_kwargs += (("chat_template", os.path.abspath(cfg.chat_template)),)
    spec = dict(source=cfg.model, dtype=cfg.dtype, llm_kwargs=llm_kwargs)
    prefill = [WorkerSpec(tp=args.prefill_tp, cpus=prefill_cpus, **spec)
               for _ in range(args.prefill_workers)]
    decode = WorkerSpec(tp=args.decode_tp, cpus=decode_cpus, **spec)
    return start_process_engine(prefill, decode, max_num_seqs=cfg.max_num_seqs,
                                max_waiting_requests=cfg.max_waiting_requests, start=start,
                                heartbeat_s=args.heartbeat_s)


def check_heartbeat(seconds: int) -> None:
    """Raises ValueError unless `--heartbeat-s` is at least 1 second."""
    if seconds < 1:
        raise ValueError(f"--heartbeat-s must be >= 1 (seconds), got {seconds}")


def parse_cpus(text: str):
    """"0", "0,2", "0-3" -> (0,), (0, 2), (0, 1, 2, 3); "" -> None.

    Raises:
      ValueError: for anything else, or cores this process may not run on.
    """
    if not text:
        return None
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected e.g. 0, 0,2 or 0-3")
        out += list(range(int(lo), int(hi or lo) + 1))
    missing = sorted(set(out) - os.sched_getaffinity(0))
    if missing:
        raise ValueError(f"bad CPU list {text!r}: this process may run on cores "
                         f"{sorted(os.sched_getaffinity(0))} only, not {missing}")
    return tuple(out)


def check_cache(cfg) -> None:
    """Raise ValueError, before any process starts, for a layout or
    kv_cache_dtype not registered (`cache.resolve_layout`) or a layout
    without page transfer."""
    layout, _ = resolve_layout(cfg.cache)
    layout.require("page_transfer", "disaggregated prefill (a KV page transfer)")


def cmd_disagg(args) -> int:

    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    if cfg.tp > 1 or cfg.num_processes > 1:
        args.parser.error("tp and num_processes are jaxinfer serve's; disagg takes --prefill-tp "
                          "and --decode-tp")
    parse_cpus(args.prefill_cpus), parse_cpus(args.decode_cpus)     # usage errors first
    check_heartbeat(args.heartbeat_s)
    check_cache(cfg)
    lines = _prompt_lines(args.prompts_file)
    engine = start_engine(cfg, args)
    try:
        rejected = _run(engine, cfg, lines, time.monotonic() + args.timeout_s)
    finally:
        print(json.dumps(engine.health()), file=sys.stderr)
        engine.stop()
    return 1 if rejected else 0


def _prompt_lines(path):
    if path is None:
        return ((n, line.rstrip("\n")) for n, line in enumerate(sys.stdin, 1))

    return iter(read_prompts(path))


def _run(engine, cfg, lines, deadline: float) -> int:
    """Submit each line as read, print each completion; returns the number
    of lines rejected before they ran (their error printed in their place)."""
    done = threading.Event()
    rejected = 0
    outstanding = [0]
    lock = threading.Lock()

    def printer(number):
        parts = []

        def on_event(event):
            if isinstance(event, BaseException):
                print(f"--- [line {number}] error: {event!r}", flush=True)
            else:
                parts.append(event.text)
                if not event.finished:
                    return
                if event.finish_reason == "error":
                    print(f"--- [line {number}] error: {event.error}", flush=True)
                else:
                    print(f"--- [line {number}] finish_reason={event.finish_reason} "
                          f"ttft={event.timings.ttft:.3f}s\n{''.join(parts)}", flush=True)
            with lock:
                outstanding[0] -= 1
                if outstanding[0] == 0:
                    done.set()
        return on_event

    for number, text in lines:
        if not text.strip():
            continue
        try:
            [request] = engine.llm.requests([text], cfg.sampling, max_new_tokens=cfg.max_new_tokens,
                                            chat=cfg.chat, stop=cfg.stop, min_tokens=cfg.min_tokens,
                                            ignore_eos=cfg.ignore_eos)
        except ValueError as e:          # too long for max_seq_len: this line only
            print(f"--- [line {number}] error: {str(e).removeprefix('row 0: ')}", flush=True)
            rejected += 1
            continue
        with lock:
            outstanding[0] += 1
            done.clear()
        engine.submit(request, printer(number))
    with lock:
        if outstanding[0] == 0:
            return rejected
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("requests did not finish before --timeout-s")
    return rejected
