"""`jaxinfer generate`: load a model from a config, stream or batch-generate
text for one prompt or a prompts file."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import time
from typing import Iterable

from jaxinfer.config import GenerationConfig, SamplingParams
from jaxinfer.config.paths import read_user_file
from jaxinfer.progress import Progress
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import enable_compilation_cache


def _config_keys_help() -> str:
    """The generate --help epilog: every config key with its default and its
    documentation, from `GenerationConfig.key_docs()` (so it cannot go stale)."""
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


def add_generate_parser(sub) -> None:
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
    data = read_user_file(path, label=f"prompts file {path}",
                          missing=f"prompts file {path}: no such file", binary=True)
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
    if (args.prompt is None) == (args.prompts_file is None):
        args.parser.error("give exactly one of --prompt or --prompts-file")   # exits 2
    cfg = GenerationConfig.load(args.config, tuple(args.overrides))  # validated before the load
    if cfg.tp > 1 or cfg.num_processes > 1:
        args.parser.error("tp and num_processes are jaxinfer serve's (docs/scaling.md); "
                          "generate runs in one process on one device")
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
