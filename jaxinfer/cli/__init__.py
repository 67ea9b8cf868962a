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
import textwrap
import time
from typing import Iterable

from jaxinfer.checkpoint.sources import ModelSourceError

USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, ModelSourceError)


def _config_keys_help() -> str:
    """The generate --help epilog: every config key with its default and its
    documentation, from `GenerationConfig.key_docs()` (so it cannot go stale)."""
    import dataclasses

    from jaxinfer.config.settings import GenerationConfig
    from jaxinfer.sampling.sample import SamplingParams

    defaults = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
    defaults.update({f.name: f.default for f in dataclasses.fields(SamplingParams)})
    lines = ["config keys (YAML file or key=value; documented in GenerationConfig and "
             "SamplingParams):"]
    for key, doc in GenerationConfig.key_docs().items():
        default = defaults[key]
        shown = "null" if default is None else ("[]" if default == () else str(default).lower()
                                                if isinstance(default, bool) else default)
        lines += textwrap.wrap(f"{key} (default {shown}): {doc}", width=100,
                               initial_indent="  ", subsequent_indent="      ")
    lines += [""] + textwrap.wrap(
        "prompts file: one prompt per line (UTF-8); whitespace-only lines are skipped with a "
        "warning naming the line, and each completion is labelled with its line number.", width=100)
    return "\n".join(lines)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streamed)",
                       epilog=_config_keys_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML generation config (see configs/)")
    p.add_argument("--prompt", help="prompt text (a user turn when chat: true)")
    p.add_argument("--prompts-file", help="one prompt per line; run as one batch")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines and no summary line on stderr")
    p.add_argument("-v", "--verbose", action="store_true", help="print compile counts")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.set_defaults(func=cmd_generate, parser=p)


def _prompt_of(text: str, cfg):
    if cfg.chat and cfg.system_prompt:
        return [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": text}]
    return text


def read_prompts(path: str) -> list[tuple[int, str]]:
    """(line number, text) for each non-empty line of a UTF-8 prompts file.

    Lines holding only whitespace are skipped with a warning on stderr naming
    the line; "\\r\\n" endings are accepted.

    Raises:
      FileNotFoundError / ValueError: naming the file (and the line for bad
        UTF-8), when the file cannot be read or holds no prompt.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"prompts file {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"prompts file {path}: {e.strerror}") from None
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()                       # the newline that ends the last line
    prompts = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            text = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid UTF-8 ({e.reason}: byte "
                             f"0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if not text.strip():
            print(f"jaxinfer generate: warning: {path}:{number}: empty line skipped", file=sys.stderr)
            continue
        prompts.append((number, text))
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def check_prompt_lengths(tokenizer, prompts: Iterable[tuple[str, object]], cfg) -> None:
    """Raise ValueError naming the first prompt whose ids plus max_new_tokens
    exceed max_seq_len (run once the tokenizer is loaded, before the weights)."""
    for label, prompt in prompts:
        ids = tokenizer.encode_prompt(prompt, chat=cfg.chat)
        total = len(ids) + cfg.max_new_tokens
        if total > cfg.max_seq_len:
            raise ValueError(
                f"{label}: prompt length {len(ids)} + max_new_tokens {cfg.max_new_tokens} = {total} "
                f"exceeds max_seq_len {cfg.max_seq_len}; shorten the prompt, lower max_new_tokens "
                "or raise max_seq_len")


def cmd_generate(args) -> int:
    from jaxinfer.config.settings import GenerationConfig
    from jaxinfer.serving.llm import LLM
    from jaxinfer.checkpoint.loading import enable_compilation_cache
    from jaxinfer.progress import Progress

    if (args.prompt is None) == (args.prompts_file is None):
        args.parser.error("give exactly one of --prompt or --prompts-file")   # exits 2
    cfg = GenerationConfig.load(args.config, tuple(args.overrides))  # validated before the load
    if args.prompt is not None:
        lines, labels = [(0, args.prompt)], ["--prompt"]
    else:
        lines = read_prompts(args.prompts_file)
        labels = [f"{args.prompts_file}:{n}" for n, _ in lines]
    prompts = [_prompt_of(text, cfg) for _, text in lines]
    progress = Progress(enabled=False if args.quiet else None)
    enable_compilation_cache()
    t0 = time.perf_counter()
    llm = LLM.from_config(cfg, progress=progress, before_weights=lambda tok: check_prompt_lengths(
        tok, zip(labels, prompts), cfg))
    load_s = time.perf_counter() - t0
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, chat=cfg.chat, stop=cfg.stop,
                  min_tokens=cfg.min_tokens, ignore_eos=cfg.ignore_eos)
    if args.prompt is not None:
        for piece in llm.stream(prompts[0], cfg.sampling, **kwargs):
            progress.enabled = False          # text is streaming: no more progress lines
            print(piece, end="", flush=True)
        print()
    else:
        for (number, _), c in zip(lines, llm.generate(prompts, cfg.sampling, **kwargs)):
            print(f"--- [line {number}] finish_reason={c.finish_reason}\n{c.text}")
    if not args.quiet:
        print(f"[jaxinfer] load {load_s:.2f} s | {llm.last_stats.summary()}", file=sys.stderr)
    if args.verbose:
        print(f"[jaxinfer] compilations so far: {llm.programs.num_compiles}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from jaxinfer.cli.disagg import add_disagg_parser
    from jaxinfer.server.run import add_serve_parser
    from jaxinfer.tools.bench.run import add_bench_parser
    from jaxinfer.tools.eval.run import add_eval_parser
    from jaxinfer.tools.toy import add_train_toy_parser
    from jaxinfer.tools.trace.run import add_trace_parser

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
