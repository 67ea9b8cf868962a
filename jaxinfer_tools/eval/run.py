"""`jaxinfer eval`: accuracy of quantized weights (and KV caches) against float32.

    jaxinfer eval --config configs/smollm2-135m-instruct.yaml [--weights int8,q4]
                  [--out DIR] [--pages docs/bench]

Loads the model once per weight format (`weights.prepare.prepare_params(weights=...)`;
"q4" and "int8" start from a GGUF file's blocks, `load_gguf(keep_quantized=True)`), then
reports against the float32 reference (`accuracy` has the formulas):

- perplexity on a fixed public-domain text: Jane Austen, *Pride and
  Prejudice* (1813), chapters 1 and 2 (`TEXT`; Project Gutenberg's text as
  packaged in the janeaustenr R package), ~2,300-2,400 tokens, in chunks of
  `--chunk` tokens;
- mean and max KL divergence of the next-token distribution at every scored
  position;
- greedy agreement: `--prompts` windows of the same text (`--prompt-len`
  tokens each), `--new-tokens` greedy tokens, matching tokens before the
  first divergence;
- llama.cpp's perplexity of the same GGUF file on the same token chunks,
  where llama-cpp-python is installed (skipped with a note otherwise).

Writes `<out>/eval-<model>.json` and `.md` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Optional, Sequence

import numpy as np

from jaxinfer_tools.bench.machine import cpu_info
from jaxinfer_tools.bench.report import default_out, source_commit, write_page
from jaxinfer_tools.eval import accuracy
from jaxinfer import GenerationConfig
from jaxinfer.testing import (WEIGHT_FORMATS, enable_compilation_cache, load_gguf, load_model,
                              prepare_params, quant, resolve_model)

# The weight formats, and "q4-a8": q4 weights with int8 activations (`activations=int8`).
VARIANTS = (*WEIGHT_FORMATS, "q4-a8")
TEXT = pathlib.Path(__file__).with_name("pride-and-prejudice-ch1-2.txt")
KV_CACHE_DTYPES = ("float32", "bfloat16", "int8")
TEXT_SOURCE = ("Jane Austen, Pride and Prejudice (1813), chapters 1-2: Project Gutenberg's "
               "text as packaged in the janeaustenr R package (public domain)")


def load_variants(source: str, weights: Sequence[str]):
    """(config, tokenizer, gguf path or None, {weights: prepared params}),
    float32 first. "q4" and "int8" of a GGUF file are prepared from its
    blocks (`load_gguf(keep_quantized=True)`: kept blocks, a kept Q8_0 LM
    head); everything else from the float32 load.

    Raises:
      ValueError: an unknown weight format (see `VARIANTS`).
    """

    bad = [w for w in weights if w not in VARIANTS]
    if bad:
        raise ValueError(f"unknown weight formats {bad}; expected some of {VARIANTS}")
    path = resolve_model(source)
    config, raw, tokenizer = load_model(source)
    prepared = {"float32": prepare_params(raw, config)}
    blocks = None
    for w in weights:
        base = "q4" if w == "q4-a8" else w
        if base in ("q4", "int8") and path.suffix == ".gguf":
            blocks = blocks or load_gguf(path, keep_quantized=True)[1]
            prepared[w] = prepare_params(blocks, config, weights=base)
        elif w != "float32":
            prepared[w] = prepare_params(raw, config, weights=base)
        if w == "q4-a8":
            prepared[w] = quant.with_activations(prepared[w], "int8")
    return config, tokenizer, (path if path.suffix == ".gguf" else None), prepared


def llamacpp_perplexity(gguf_path, chunks: Sequence[np.ndarray], threads: int) -> dict:
    """llama.cpp's perplexity of the GGUF file on the same token chunks
    (llama-cpp-python, all logits), scored like `accuracy.compare_on_text`.

    Returns:
      {"ppl", "tokens", "llama_cpp_version"}, or {"skipped": reason}.
    """
    try:
        import llama_cpp
    except ImportError as err:
        return {"skipped": f"llama-cpp-python is not installed ({err})"}
    n_ctx = max(len(c) for c in chunks)
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
                          n_threads=threads, verbose=False)
    nll = []
    for tokens in chunks:
        llm.reset()
        llm.eval(tokens.tolist())
        logits = np.asarray(llm.scores[:len(tokens) - 1], np.float64)
        top = logits.max(axis=-1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
        nll.append(logz - logits[np.arange(len(tokens) - 1), tokens[1:]])
    nll = np.concatenate(nll)
    return {"ppl": float(np.exp(nll.mean())), "tokens": int(nll.size),
            "llama_cpp_version": getattr(llama_cpp, "__version__", "?")}


def _loadavg() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_eval(source: str, weights: Sequence[str], kv_cache_dtypes: Sequence[str], chunk: int,
             prompts: int, prompt_len: int, new_tokens: int, llamacpp: bool = True) -> dict:
    """Every measure for every variant (weights x KV cache dtype) of one model; a dict
    ready for JSON (see `format_report`).

    Raises:
      ValueError: an unknown weight format or KV cache dtype (before any loading), or a
        KV cache dtype this engine's `init_cache` does not offer (when first used).
    """
    bad = [kv for kv in kv_cache_dtypes if kv not in KV_CACHE_DTYPES]
    if bad or not kv_cache_dtypes:
        raise ValueError(f"KV cache dtypes must be some of {KV_CACHE_DTYPES}, got {list(kv_cache_dtypes)}")
    t0 = time.perf_counter()
    config, tokenizer, gguf_path, prepared = load_variants(source, weights)
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    ids = tokenizer.encode(TEXT.read_text())
    chunks = accuracy.text_chunks(ids, chunk, bos)
    variants = {_name(w, kv): (prepared[w], kv) for w in ["float32", *weights]
                for kv in kv_cache_dtypes if (w, kv) != ("float32", "float32")}
    text = accuracy.compare_on_text(config, prepared["float32"], variants, chunks)
    windows = accuracy.text_prompts(ids, prompts, prompt_len, bos)
    greedy = accuracy.greedy_agreement(config, prepared["float32"], variants, windows, new_tokens)
    peer = (llamacpp_perplexity(gguf_path, chunks, os.cpu_count() or 1) if llamacpp and gguf_path
            else {"skipped": "not a GGUF file" if llamacpp else "--no-llamacpp"})
    return {"model": source, "text": TEXT_SOURCE, "text_tokens": len(ids), "chunk": chunk,
            "chunks": len(chunks), "perplexity": text, "greedy": greedy, "llamacpp": peer,
            "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "seconds": time.perf_counter() - t0, "loadavg_end": _loadavg(),
            "timestamp": time.strftime("%Y-%m-%d %H:%M:%S")}


def _name(weights: str, kv: str) -> str:
    return weights if kv == "float32" else f"{weights} + KV {kv}"


def format_report(result: dict) -> str:
    """The Markdown table of one `run_eval` result."""
    ref = result["perplexity"]["reference"]
    lines = [f"### {result['model']}: accuracy against float32",
             "",
             f"Text: {result['text']}; {result['text_tokens']} tokens in {result['chunks']} chunks "
             f"of up to {result['chunk']}, {ref['tokens']} scored positions. Greedy: "
             f"{result['prompts']} prompts of {result['prompt_len']} tokens from the same text, "
             f"{result['new_tokens']} new tokens each.",
             "",
             "| config | perplexity | vs float32 | mean KL (nats) | max KL | greedy match "
             "(mean / min) | prompts matching all |",
             "|---|---|---|---|---|---|---|",
             f"| float32 | {ref['ppl']:.4f} | - | - | - | - | - |"]
    for name, row in result["perplexity"].items():
        if name == "reference":
            continue
        g = result["greedy"][name]
        lines.append(f"| {name} | {row['ppl']:.4f} | {100 * row['ppl_rel_change']:+.2f}% | "
                     f"{row['kl_mean']:.2e} | {row['kl_max']:.2e} | {g['mean']:.1f} / {g['min']} | "
                     f"{g['all_match']} / {g['prompts']} |")
    peer = result["llamacpp"]
    lines.append("")
    lines.append(f"llama.cpp on the same file and chunks: perplexity {peer['ppl']:.4f} "
                 f"(llama-cpp-python {peer['llama_cpp_version']})" if "ppl" in peer
                 else f"llama.cpp perplexity: skipped ({peer['skipped']})")
    lines.append(f"Run {result['timestamp']}, {result['seconds']:.0f} s, load average at the end "
                 f"{result['loadavg_end']}.")
    return "\n".join(lines) + "\n"


def cmd_eval(args) -> int:

    model = args.model or GenerationConfig.load(args.config).model
    enable_compilation_cache()
    result = run_eval(model, _csv(args.weights), _csv(args.kv_cache_dtypes), args.chunk,
                      args.prompts, args.prompt_len, args.new_tokens, not args.no_llamacpp)
    result.update(commit=source_commit(), cpu=cpu_info())
    out = pathlib.Path(args.out or default_out())
    out.mkdir(parents=True, exist_ok=True)
    stem = f"eval-{pathlib.Path(model).stem}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    report = format_report(result)
    (out / f"{stem}.md").write_text(report)
    if args.pages:
        write_page(result, report, args.pages, "eval")
    print(report)
    page = f", {args.pages}/eval.md" if args.pages else ""
    print(f"[jaxinfer eval] wrote {out}/{stem}.json, .md{page}", file=sys.stderr)
    return 0


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register `jaxinfer eval` on an argparse subparsers object."""
    p = subparsers.add_parser("eval", help="accuracy of quantized weights / KV cache vs float32")
    _add_arguments(p)
    p.set_defaults(func=cmd_eval)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml",
                   help="generation YAML naming the model")
    p.add_argument("--model", help="override the config's model (name, .gguf or folder)")
    p.add_argument("--weights", default="int8,q4",
                   help="weight formats to compare with float32 (float32,bfloat16,int8,q4; "
                        "q4-a8: q4 with int8 activations)")
    p.add_argument("--kv-cache-dtypes", default="float32",
                   help="KV cache dtypes to run each format with (float32, and int8 where the "
                        "engine has it)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per perplexity chunk")
    p.add_argument("--prompts", type=int, default=32, help="greedy-agreement prompts")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per greedy prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp's perplexity")
    p.add_argument("--out", help="folder for the JSON and Markdown report (default: a new temporary "
                                 "folder)")
    p.add_argument("--pages", metavar="DIR",
                   help="also rewrite DIR/eval.md in place (docs/bench in a checkout)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxinfer_tools.eval")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return cmd_eval(args)
