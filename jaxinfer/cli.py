"""`jaxinfer` command line.

    jaxinfer generate --config configs/smollm2-135m-instruct.yaml --prompt "..." [key=value ...]
    jaxinfer train-toy --config configs/toy-two-layer.yaml
    jaxinfer trace --config configs/toy-two-layer.yaml --prompt 你好 [--plot DIR]
    jaxinfer bench --config configs/smollm2-135m-instruct.yaml [--quick] [--peers hf,llamacpp]
    jaxinfer eval --config configs/smollm2-135m-instruct.yaml [--weights int8,q4]
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxinfer.checkpoint.sources import ModelSourceError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streamed)")
    p.add_argument("--config", help="YAML generation config (see configs/)")
    p.add_argument("--prompt", help="prompt text (a user turn when chat: true)")
    p.add_argument("--prompts-file", help="one prompt per line; run as one batch")
    p.add_argument("-v", "--verbose", action="store_true", help="print compile counts")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.set_defaults(func=cmd_generate)


def _prompt_of(text: str, cfg):
    if cfg.chat and cfg.system_prompt:
        return [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": text}]
    return text


def cmd_generate(args) -> int:
    from jaxinfer.config import GenerationConfig
    from jaxinfer.llm import LLM
    from jaxinfer.loading import enable_compilation_cache

    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    sampling_params = cfg.sampling_params()  # validate before the model loads
    enable_compilation_cache()
    if (args.prompt is None) == (args.prompts_file is None):
        raise SystemExit("jaxinfer generate: give exactly one of --prompt or --prompts-file")
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    t0 = time.perf_counter()
    llm = LLM.load(cfg.model, dtype=cfg.dtype, max_seq_len=cfg.max_seq_len,
                   decode_chunk=cfg.decode_chunk)
    load_s = time.perf_counter() - t0
    prompts = [_prompt_of(p, cfg) for p in prompts]
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, chat=cfg.chat, stop=cfg.stop)
    if args.prompt is not None:
        for piece in llm.stream(prompts[0], sampling_params, **kwargs):
            print(piece, end="", flush=True)
        print()
    else:
        for i, c in enumerate(llm.generate(prompts, sampling_params, **kwargs)):
            print(f"--- [{i}] finish_reason={c.finish_reason}\n{c.text}")
    print(f"[jaxinfer] load {load_s:.2f} s | {llm.last_stats.summary()}", file=sys.stderr)
    if args.verbose:
        print(f"[jaxinfer] compilations so far: {llm.programs.num_compiles}", file=sys.stderr)
    return 0


def _read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [line.rstrip("\r\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit(f"jaxinfer generate: {path} holds no prompts")
    return prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from jaxinfer.tools.bench.run import add_bench_parser
    from jaxinfer.tools.eval.run import add_eval_parser
    from jaxinfer.tools.toy import add_train_toy_parser
    from jaxinfer.tools.trace.run import add_trace_parser

    add_train_toy_parser(sub)
    add_trace_parser(sub)
    add_bench_parser(sub)
    add_eval_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ModelSourceError) as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
