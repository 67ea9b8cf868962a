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

`train-toy`, `trace`, `bench` and `eval` live in the `jaxinfer_tools`
package beside the library (installed by the same pyproject.toml); they are
imported only when named. Without that package each of them exits with
status 2 and a line saying what to install.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from jaxinfer.checkpoint.sources import ModelSourceError

USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ModelSourceError)

# command -> (module, the function there that registers its subparser), in help order
COMMANDS = {
    "generate": ("jaxinfer.cli.generate", "add_generate_parser"),
    "serve": ("jaxinfer.cli.serve", "add_serve_parser"),
    "train-toy": ("jaxinfer_tools.toy", "add_train_toy_parser"),
    "trace": ("jaxinfer_tools.trace.run", "add_trace_parser"),
    "bench": ("jaxinfer_tools.bench.run", "add_bench_parser"),
    "eval": ("jaxinfer_tools.eval.run", "add_eval_parser"),
    "disagg": ("jaxinfer.cli.disagg", "add_disagg_parser"),
}

TOOLS_PACKAGE = "jaxinfer_tools"
TOOLS_MISSING = (f"this command lives in the {TOOLS_PACKAGE} package, which is not installed: "
                 "install jaxinfer from its source tree (pip install -e \".[toy]\" in a checkout, "
                 "the toy extra for train-toy, the bench extra for bench's peers and plots)")


def _not_installed(name: str) -> bool:
    """Whether command `name` lives in the tools package and it is not installed."""
    return (COMMANDS[name][0].startswith(TOOLS_PACKAGE + ".")
            and importlib.util.find_spec(TOOLS_PACKAGE) is None)


def _add_parser(sub, name: str) -> None:
    """Register command `name` on `sub`; a tools command without the tools
    package gets a placeholder whose help says so."""
    if _not_installed(name):
        sub.add_parser(name, help=f"(not installed: needs the {TOOLS_PACKAGE} package)")
        return
    module, add_parser = COMMANDS[name]
    getattr(importlib.import_module(module), add_parser)(sub)


def parse_command(argv) -> argparse.Namespace:
    """The parsed arguments of `jaxinfer COMMAND ...` (`args.command`, and
    `args.func` to run it). A known command's arguments are parsed
    intermixed (`argparse.ArgumentParser.parse_known_intermixed_args`), so
    its positional key=value overrides may come before, between and after
    its flags.

    Raises:
      SystemExit: --help (code 0), or a usage error (code 2, the message
        printed as "jaxinfer <command>: error: ..."): a bad flag or value,
        an unknown command, a tools command without the tools package.
    """
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] in COMMANDS and _not_installed(argv[0]):
        print(f"jaxinfer {argv[0]}: error: {TOOLS_MISSING}", file=sys.stderr)
        raise SystemExit(2)
    for name in [argv[0]] if argv and argv[0] in COMMANDS else COMMANDS:
        _add_parser(sub, name)
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
