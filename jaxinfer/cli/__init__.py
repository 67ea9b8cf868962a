"""`jaxinfer` command line.

    jaxinfer generate --config configs/smollm2-135m-instruct.yaml --prompt "..." [key=value ...]
    jaxinfer serve --config configs/smollm2-135m-instruct.yaml [--port 8000] [key=value ...]
    jaxinfer train-toy --config configs/toy-two-layer.yaml
    jaxinfer trace --config configs/toy-two-layer.yaml --prompt 你好 [--plot DIR]
    jaxinfer bench --config configs/smollm2-135m-instruct.yaml [--quick] [--peers hf,llamacpp]
    jaxinfer eval --config configs/smollm2-135m-instruct.yaml [--weights int8,q4]
    jaxinfer disagg --config configs/smollm2-135m-instruct.yaml --prefill-workers 1 [--prompts-file F]

Every usage error (a bad flag, config key or value, prompts file, model name,
or a prompt too long for max_seq_len) prints one line,
`jaxinfer <command>: error: ...`, to stderr and exits with status 2, before
the model's weights are loaded where it can be checked that early.
"""

from __future__ import annotations

import argparse
import sys

from jaxinfer.checkpoint.sources import ModelSourceError
from jaxinfer.cli.disagg import add_disagg_parser
from jaxinfer.cli.generate import add_generate_parser
from jaxinfer.cli.serve import add_serve_parser
from jaxinfer.tools.bench.run import add_bench_parser
from jaxinfer.tools.eval.run import add_eval_parser
from jaxinfer.tools.toy import add_train_toy_parser
from jaxinfer.tools.trace.run import add_trace_parser

USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ModelSourceError)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_train_toy_parser(sub)
    add_trace_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    add_disagg_parser(sub)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:   # reported by the command's own parser: "jaxinfer <command>: error: ..."
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
        return args.func(args)
    except SystemExit as e:           # argparse: --help (0) or a usage error (2, message printed)
        return e.code
    except USAGE_ERRORS as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
