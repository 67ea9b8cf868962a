"""`jaxinfer trace`: watch prefill and decode happen, with the engine's own numbers.

    jaxinfer trace --config configs/toy-two-layer.yaml --prompt 你好 --steps 2 [--chunk 1] [--plot DIR]

Prefills the prompt (whole with `engine.prefill`, or with `--chunk N` in
chunks of N tokens with `engine.extend`), then runs one `engine.decode_step`
per step (greedy), and prints per call and per layer the Q/K/V, the raw
scores, the mask added, the softmax weights, what was written into the KV
cache and what each layer's cache holds, and the last-position logits. The
numbers are recorded by the tracer's own attention (`tracer.py`) and checked
against the compiled phase run on the same cache; see `tracer.py` for the
checks.

The config may be a toy config (`kind: toy`, see `jaxinfer_tools.toy`; the model
is trained first if its folder is missing) or a GenerationConfig YAML for a
real model; real models print shapes, norms and top tokens instead of full
matrices. The prompt is raw text (no chat template).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

import jax.numpy as jnp

from jaxinfer_tools.trace.plots import plot_trace
from jaxinfer_tools.trace.printer import format_trace
from jaxinfer_tools.trace.tracer import run_trace
from jaxinfer import GenerationConfig
from jaxinfer.testing import load_model, read_yaml_mapping
from jaxinfer_tools.toy import ToyConfig
from jaxinfer_tools import toy


def load_trace_config(path: str | os.PathLike):
    """("toy", ToyConfig) for a YAML with `kind: toy`, else ("generation",
    GenerationConfig). Raises ValueError for unknown keys or an unknown kind."""

    values = read_yaml_mapping(path)
    kind = values.get("kind")
    if kind == "toy":
        return "toy", ToyConfig.from_dict(values)
    if kind is not None:
        raise ValueError(f"{path}: unknown kind {kind!r} (only 'toy'; GenerationConfig YAMLs "
                         "have no kind)")
    return "generation", GenerationConfig.from_dict(values)


def load_for_trace(config_path: str | os.PathLike, model: Optional[str] = None,
                   log: Callable[[str], None] = print):
    """(ModelConfig, params, Tokenizer, title) for a toy or generation YAML;
    `model` overrides the YAML's model (a folder for toy configs)."""
    kind, cfg = load_trace_config(config_path)
    if kind == "toy":

        folder = toy.ensure_model(cfg, model, log=log)
        config, params, tokenizer = toy.load_folder(folder)
        return config, params, tokenizer, str(folder)

    source = model or cfg.model
    config, params, tokenizer = load_model(source, dtype=jnp.dtype(cfg.dtype))
    return config, params, tokenizer, str(source)


def trace_main(config_path: str, prompt: str = "你好", steps: int = 2,
               plot: Optional[str] = None, model: Optional[str] = None,
               detail: Optional[bool] = None, chunk: Optional[int] = None,
               draft: Optional[str] = None) -> int:
    """Load, trace, print (and plot). Returns 0 when every check passed, else 1."""
    config, params, tokenizer, title = load_for_trace(config_path, model)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    drafts = tokenizer.encode(draft, add_special_tokens=False) if draft else ()
    trace = run_trace(config, params, ids, steps, stop_ids=tuple(tokenizer.eos_token_ids),
                      prefill_chunk=chunk, drafts=drafts)
    token_text = lambda i: tokenizer.decode([i], skip_special_tokens=False)
    label = lambda i: repr(token_text(i))
    print(format_trace(trace, label, title, detail, text=tokenizer.decode))
    if plot:
        for path in plot_trace(trace, plot, token_text):
            print(f"wrote {path}")
    return 0 if trace.ok else 1


def add_trace_parser(subparsers) -> None:
    """Register `jaxinfer trace` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "trace", help="print prefill and decode step by step (Q/K/V, scores, mask, cache)")
    p.add_argument("--config", required=True,
                   help="toy YAML (kind: toy) or a generation YAML for a real model")
    p.add_argument("--prompt", default="你好", help="raw prompt text (no chat template)")
    p.add_argument("--steps", type=int, default=2, help="greedy decode steps (default 2)")
    p.add_argument("--chunk", type=int, metavar="N",
                   help="prefill the prompt in chunks of N tokens (engine.extend) instead of whole")
    p.add_argument("--draft", metavar="TEXT",
                   help="after the prefill, verify these drafted tokens in one speculative step")
    p.add_argument("--plot", metavar="DIR", help="also write PNG heatmaps and a cache diagram")
    p.add_argument("--model", help="override the config's model (folder, .gguf or name)")
    detail = p.add_mutually_exclusive_group()
    detail.add_argument("--full", dest="detail", action="store_true", default=None,
                        help="print full vectors and matrices (default for tiny models)")
    detail.add_argument("--brief", dest="detail", action="store_false",
                        help="one line per layer (default for real models)")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    return trace_main(args.config, args.prompt, args.steps, args.plot, args.model, args.detail,
                      args.chunk, args.draft)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jaxinfer_tools.trace --config ...`: the same as `jaxinfer trace`."""
    import argparse

    parser = argparse.ArgumentParser(prog="jaxinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    add_trace_parser(sub)
    parsed = parser.parse_args(["trace"] + list(sys.argv[1:] if argv is None else argv))
    return parsed.func(parsed)
