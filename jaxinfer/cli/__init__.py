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

key=value config overrides may come anywhere among a command's flags
(`jaxinfer generate model=x --prompt Hi temperature=0`): the command's
arguments are parsed intermixed (`parse_command`).

Only the named command's module is imported (with its parser); `jaxinfer`
without a known command builds every parser, so help and "invalid choice"
list them all.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jaxinfer.checkpoint.sources import ModelSourceError

USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ModelSourceError)

# command -> (module, the function there that registers its subparser), in help order
COMMANDS = {
    "generate": ("jaxinfer.cli.generate", "add_generate_parser"),
    "serve": ("jaxinfer.cli.serve", "add_serve_parser"),
    "train-toy": ("jaxinfer.tools.toy", "add_train_toy_parser"),
    "trace": ("jaxinfer.tools.trace.run", "add_trace_parser"),
    "bench": ("jaxinfer.tools.bench.run", "add_bench_parser"),
    "eval": ("jaxinfer.tools.eval.run", "add_eval_parser"),
    "disagg": ("jaxinfer.cli.disagg", "add_disagg_parser"),
}


def parse_command(argv) -> argparse.Namespace:
    """The parsed arguments of `jaxinfer COMMAND ...` (`args.command`, and
    `args.func` to run it). A known command's arguments are parsed
    intermixed (`argparse.ArgumentParser.parse_known_intermixed_args`), so
    its positional key=value overrides may come before, between and after
    its flags.

    Raises:
      SystemExit: --help (code 0), or a usage error (code 2, the message
        printed as "jaxinfer <command>: error: ..."): a bad flag or value,
        an unknown command.
    """
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in [argv[0]] if argv and argv[0] in COMMANDS else COMMANDS:
        module, add_parser = COMMANDS[name]
        getattr(importlib.import_module(module), add_parser)(sub)
    if not (argv and argv[0] in COMMANDS):   # no command, an unknown one, top-level help: exits
        return parser.parse_args(argv)
    command = sub.choices[argv[0]]
    args, unknown = command.parse_known_intermixed_args(argv[1:])
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command = argv[0]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_command(argv)
        return args.func(args)
    except SystemExit as e:           # argparse: --help (0) or a usage error (2, message printed)
        return e.code
    except USAGE_ERRORS as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
