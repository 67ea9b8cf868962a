"""The peers: Hugging Face transformers and llama.cpp on the same prompts,
each in its own worker subprocess (`--peer-probe`), and the orchestration
that runs them and attaches their figures to jaxinfer's rows."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import tempfile
import time

import numpy as np

from jaxinfer_tools.bench.common import (headline, loadavg1, peak_rss_bytes, random_prompts,
                                         run_worker)


class HFPeer:
    """Hugging Face transformers (PyTorch, float32) on the same checkpoint:
    prefill = one forward with `logits_to_keep=1` + argmax; decode = forward
    of one token per row over a DynamicCache + argmax (generate's inner loop
    without its logits processors)."""

    name = "hf"

    def __init__(self, path: pathlib.Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        t0 = time.perf_counter()
        kwargs = {"dtype": torch.float32}
        if path.is_dir():
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, **kwargs)
        self.model.eval()
        self.load_s = time.perf_counter() - t0
        self.info = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
                     "mkldnn": bool(torch.backends.mkldnn.is_available())}
        # transformers >= 5.2x names the KV cache argument `cache` (was `past_key_values`)
        names = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"

    def _forward(self, ids, past=None):
        kwargs = {} if past is None else {self._cache_arg: past}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        past = out.get("cache")
        return out.logits[:, -1].argmax(-1), past if past is not None else out.get("past_key_values")

    def prefill(self, tokens: np.ndarray) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self._forward(self.torch.from_numpy(tokens.astype(np.int64)))
            return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, batch: int, warmup: int, steps: int) -> list[float]:
        """Per-step seconds of `steps` greedy steps after `warmup` untimed ones,
        at `batch` rows all continuing `prompt` [1, T]."""
        torch = self.torch
        with torch.inference_mode():
            tok, past = self._forward(torch.from_numpy(prompt.astype(np.int64)))
            if batch > 1:
                if not hasattr(past, "batch_repeat_interleave"):
                    raise RuntimeError("this transformers' cache has no batch_repeat_interleave")
                past.batch_repeat_interleave(batch)
                tok = tok.repeat(batch)
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                tok, past = self._forward(tok[:, None], past)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            return times


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the same GGUF (its own quantized
    kernels), one sequence: prefill = `eval(prompt)` + argmax of the last
    logits; decode = `eval([token])` + argmax per step."""

    name = "llamacpp"

    def __init__(self, path: pathlib.Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        if path.is_dir():
            raise RuntimeError("llama.cpp needs a .gguf file, not a Hugging Face folder")
        t0 = time.perf_counter()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx),
                         n_threads=threads, n_threads_batch=threads, logits_all=False,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.load_s = time.perf_counter() - t0
        self.info = llama_cpp_build()

    def _argmax(self) -> int:
        """Greedy token from the last evaluated position's logits (read from the
        context: with logits_all=False llama-cpp-python does not copy them to `scores`)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prefill(self, tokens: np.ndarray) -> float:
        if tokens.shape[0] != 1:
            raise RuntimeError("llama-cpp-python runs one sequence at a time")
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(tokens[0].tolist())
        self._argmax()
        return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, batch: int, warmup: int, steps: int) -> list[float]:
        if batch != 1:
            raise RuntimeError("llama-cpp-python runs one sequence at a time")
        self.llm.reset()
        self.llm.eval(prompt[0].tolist())
        tok, times = self._argmax(), []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            self.llm.eval([tok])
            tok = self._argmax()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times


def llama_cpp_build() -> dict:
    """The installed llama-cpp-python's version and its llama.cpp build's
    `llama_print_system_info()` (the CPU features it was compiled for: AVX2,
    AVX512, AVX512_BF16, AMX ..., i.e. the effect of its CMAKE_ARGS)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp_python_version": llama_cpp.__version__,
            "system_info": info.decode(errors="replace") if isinstance(info, bytes) else str(info)}


def load_peer(name: str, path: pathlib.Path, threads: int, n_ctx: int):
    """Instantiate one peer. Returns (peer or None, status dict): status is
    {"status": "ok", "load_s", "threads"} or {"status": "skipped: why", "detail"}."""
    try:
        peer = HFPeer(path, threads) if name == "hf" else LlamaCppPeer(path, threads, n_ctx)
    except ImportError as e:
        pkg = "torch" if name == "hf" else "llama-cpp-python"
        extra = "bench" if name == "hf" else "llamacpp"
        return None, {"status": "skipped: not installed",
                      "detail": f"{e}; pip install {pkg} (or `pip install -e .[{extra}]`)"}
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        return None, {"status": f"skipped: failed to load: {type(e).__name__}", "detail": str(e)[:300]}
    return peer, {"status": "ok", "load_s": peer.load_s, "threads": threads, "build": peer.info}


def peer_prefill(peer, batch: int, length: int, vocab: int, repeats: int,
                 stat: str = "median") -> dict:
    """The peer on the same prompts as jaxinfer's (batch, length) prefill cell;
    one warm-up call, then the median of `repeats`."""
    tokens = random_prompts(vocab, batch, length, seed=length)
    try:
        peer.prefill(tokens)
        times = [peer.prefill(tokens) for _ in range(repeats)]
    except RuntimeError as e:
        return {"skipped": str(e)}
    ttft = headline(times, stat)
    return {"ttft_s": ttft, "times_s": times, "tokens_per_s": tokens.size / ttft,
            "loadavg_1m": loadavg1()}


def peer_decode(peer, batch: int, prompt_len: int, steps: int, chunk: int, vocab: int,
                stat: str = "median") -> dict:
    """The peer continuing jaxinfer's decode prompt at `batch` rows for the same
    step counts and contexts (`chunk` untimed steps, then `steps` timed)."""
    prompt = random_prompts(vocab, 1, prompt_len, seed=prompt_len)
    try:
        times = peer.decode(prompt, batch, chunk, steps)
    except RuntimeError as e:
        return {"skipped": str(e)}
    tpot = headline(times, stat)
    return {"tpot_s": tpot, "tpot_mean_s": sum(times) / len(times), "tpot_min_s": min(times),
            "tokens_per_s": batch / tpot,
            "loadavg_1m": loadavg1()}


def peer_worker(name: str, path: str, spec: dict) -> dict:
    """Run in a fresh process (`--peer-probe`): one peer over the cells in
    `spec` ({"threads", "n_ctx", "vocab", "chunk", "repeats", "prefill": [[B, T]],
    "decode": [[B, prompt_len, steps]]}). Peers get a process each because
    two OpenMP runtimes in one process (PyTorch's and llama.cpp's) slow each
    other down by up to 10x here."""
    import warnings

    warnings.filterwarnings("ignore")
    peer, status = load_peer(name, pathlib.Path(path), spec["threads"], spec["n_ctx"])
    if peer is None:
        return status
    stat = spec.get("stat", "median")
    status["prefill"] = [peer_prefill(peer, b, t, spec["vocab"], spec["repeats"], stat)
                         for b, t in spec["prefill"]]
    status["decode"] = [peer_decode(peer, b, t, n, spec["chunk"], spec["vocab"], stat)
                        for b, t, n in spec["decode"]]
    status["peak_rss_bytes"] = peak_rss_bytes()
    return status


def run_peers(results: dict, names, path, sweep, chunk: int, vocab: int,
              timeout: float = 3600) -> None:
    """Each peer in its own subprocess (`peer_worker`) on the prefill cells
    with B*T <= peer_max_tokens and the decode batches <= peer_max_decode_batch
    (llama.cpp: batch 1 only). Fills results["peers"] and each row's
    "peers" entry; "speedup" = peer seconds / jaxinfer seconds."""
    pre = [r for r in results["prefill"] if r["batch"] * r["prompt_len"] <= sweep.peer_max_tokens]
    dec = [r for r in results["decode"] if r["batch"] <= sweep.peer_max_decode_batch]
    spec = {"threads": os.cpu_count() or 1, "vocab": vocab, "chunk": chunk,
            "repeats": max(1, min(sweep.repeats, 2)), "stat": sweep.stat,
            "n_ctx": max([r["prompt_len"] for r in pre] + [r["cache_len"] for r in dec] + [256]),
            "prefill": [[r["batch"], r["prompt_len"]] for r in pre],
            "decode": [[r["batch"], r["prompt_len"], r["steps"]] for r in dec]}
    results["peers"] = {}
    for name in names:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        try:
            out = run_worker(["--peer-probe", name, "--model", str(path), "--spec", f.name], timeout)
        except RuntimeError as e:
            out = {"status": "skipped: worker failed", "detail": str(e)[-500:]}
        except subprocess.TimeoutExpired:
            out = {"status": f"skipped: timed out after {timeout:.0f} s"}
        finally:
            os.unlink(f.name)
        for rows, key, measured in ((pre, "ttft_s", out.pop("prefill", [])),
                                    (dec, "tpot_s", out.pop("decode", []))):
            for row, m in zip(rows, measured):
                if key in m:
                    m["speedup"] = m[key] / row[key]
                row.setdefault("peers", {})[name] = m
        results["peers"][name] = out


