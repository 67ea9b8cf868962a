"""The research API's targets on a real model (issue #54): live weights,
sleep and wake, prompt log-probs, and the differentiable forward against
the engine's own rollouts.

    python benchmarks/research_api.py [--model smollm2-135m-instruct] [--repeats 3]

One process, the model's float weights in the checkpoint layout
(`load_params(prepared=False)`, dequantized from the GGUF):

1. `update_weights` on an LLM with float32 weights and on one with q4
   weights prepared from the same float weights (jaxinfer's own q4 blocks;
   an LLM holding a GGUF's own blocks refuses float updates, docs/research.md):
   each gets the float params back, then perturbed ones. Reported: the
   best of `--repeats` in seconds (targets: < 1 s float32, < 3 s q4,
   re-quantizing included), new compiles (`ProgramCache.num_compiles`,
   target 0), the peak resident memory above the start of the update
   (VmHWM after `/proc/self/clear_refs` reset it) against one layer's
   prepared bytes (target: at most one extra layer), and whether greedy
   tokens after the perturbed update equal a fresh LLM's on those params.
2. `sleep(1)` and `wake_up()` on the float32 LLM, with one scheduler held
   as a server's engine thread holds its own: resident memory freed
   against the KV pools' bytes (target: at least 90%), `wake_up` seconds
   (target: < 1 s) until the held runner's pool is allocated and zeroed
   again (the offline engine's is rebuilt by the next `generate`), greedy
   tokens after waking against before.
3. `LLM.prompt_logprobs` (what `echo` and `prompt_logprobs` serve) against
   `LLM.score`'s per-token log-probs: the largest |difference| (target 1e-5).
4. The engine's sampled rollout log-probs against `jaxinfer.token_logprobs`
   over the same params and tokens: the largest |difference| (target 1e-5).

Prints the CPU and its flags, the load average before and after, and one
line per figure. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams, token_logprobs
from jaxinfer.checkpoint.loading import load_params
from jaxinfer.checkpoint.sources import resolve_model
from jaxinfer.kernels.cpu import cpu_flags
from jaxinfer.serving.control import return_freed_memory
from jaxinfer.serving.loading import load_tokenizer
from jaxinfer.weights.prepare import prepare_params

PROMPTS = ["The three primary colours are", "Write one sentence about the sea.",
           "List four prime numbers:"]
NEW_TOKENS = 16


def _cpu() -> str:
    info = open("/proc/cpuinfo").read().splitlines()
    name = next(line for line in info if line.startswith("model name")).split(":", 1)[1].strip()
    isa = "AVX-512" if "avx512f" in cpu_flags() else "AVX2-only" if "avx2" in cpu_flags() else "no AVX2"
    return f"{name} ({isa}), {os.cpu_count()} cores"


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:     # 5: reset the peak resident set size
        f.write("5")


def _greedy(llm) -> list:
    return [c.token_ids for c in llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)]


def _perturbed(raw, seed: int):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda w: (np.asarray(w) * (1 + 0.01 * rng.standard_normal(w.shape))
                                   ).astype(np.asarray(w).dtype)
                        if jnp.issubdtype(w.dtype, jnp.floating) else w, raw)


def _layer_nbytes(params) -> int:
    """One layer's prepared bytes: the stacked layers' bytes over their count."""
    layers = params["layers"]
    leaves = jax.tree.leaves(layers)
    num = len(layers) if isinstance(layers, (list, tuple)) else leaves[0].shape[0]
    return sum(x.nbytes for x in leaves) // num


def _updates(name, llm, raw, repeats, make_fresh) -> None:
    compiles = llm.programs.num_compiles
    best, peak = float("inf"), 0
    for i in range(repeats):
        new = raw if i % 2 == 0 else _perturbed(raw, i)
        gc.collect()
        start = _status("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        llm.update_weights(new)
        best = min(best, time.perf_counter() - t)
        peak = max(peak, _status("VmHWM") - start)
    new = _perturbed(raw, 1000)
    llm.update_weights(new)
    same = _greedy(llm) == _greedy(make_fresh(new))
    layer = _layer_nbytes(llm.params)
    print(f"update_weights {name}: best of {repeats} {best:.3f} s; new compiles "
          f"{llm.programs.num_compiles - compiles}; peak RSS above the start {peak / 2**20:.1f} MiB "
          f"against one layer {layer / 2**20:.1f} MiB ({peak / layer:.2f} layers); greedy tokens "
          f"after a perturbed update {'equal' if same else 'DIFFER from'} a fresh LLM's", flush=True)


def _pool_nbytes(llm) -> int:
    return sum(x.nbytes for runner in list(llm._runners) if runner.cache is not None
               for x in jax.tree.leaves(runner.cache))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    load_before = os.getloadavg()
    print(f"CPU: {_cpu()}; load average before {load_before[0]:.2f} {load_before[1]:.2f}", flush=True)
    path = resolve_model(args.model)
    config, raw = load_params(path, prepared=False, progress=False)
    raw = jax.tree.map(np.asarray, raw)
    tokenizer = load_tokenizer(path)
    settings = dict(max_seq_len=512, max_num_seqs=4)

    def make(params, weights="float32"):
        return LLM(config, prepare_params(jax.tree.map(jnp.asarray, params), config, weights=weights),
                   tokenizer, **settings)

    f32 = make(raw)
    _greedy(f32)
    _updates("float32", f32, raw, args.repeats, make)
    q4 = make(raw, "q4")
    _greedy(q4)
    _updates("q4", q4, raw, args.repeats, lambda p: make(p, "q4"))
    del q4
    gc.collect()

    f32.update_weights(raw)
    before = _greedy(f32)
    # held as a server's engine thread holds its scheduler: sleep frees its
    # pool and wake_up allocates it again (the offline one is rebuilt lazily)
    engine = f32.scheduler()
    pools = _pool_nbytes(f32)
    gc.collect()
    return_freed_memory()          # what earlier parts freed leaves the count first
    rss = _status("VmRSS")
    f32.sleep(1)
    freed = rss - _status("VmRSS")
    t = time.perf_counter()
    f32.wake_up()
    woken = list(f32._runners)
    jax.block_until_ready([runner.cache for runner in woken])
    woke = time.perf_counter() - t
    print(f"sleep(1): RSS fell {freed / 2**20:.1f} MiB against KV pools of {pools / 2**20:.1f} MiB "
          f"({freed / pools:.0%}); wake_up {woke:.3f} s until {len(woken)} held runner's pool "
          f"of {_pool_nbytes(f32) / 2**20:.1f} MiB was allocated and zeroed; greedy tokens after "
          f"waking {'equal' if _greedy(f32) == before else 'DIFFER from'} those before", flush=True)
    del engine

    ids = [f32.encode_prompt(p) for p in PROMPTS]
    echoed = f32.prompt_logprobs(ids)
    worst = 0.0
    for row, p in enumerate(ids):
        for n in range(1, len(p)):
            scored = f32.score([p[:n]], [p[n:n + 1]])[0]
            worst = max(worst, abs(scored - echoed[row][n].logprob))
    print(f"prompt log-probs (echo) against LLM.score, every prompt token: max |diff| {worst:.2e}",
          flush=True)

    outs = f32.generate(PROMPTS, SamplingParams(temperature=1.0, seed=5), max_new_tokens=NEW_TOKENS,
                        logprobs=0, ignore_eos=True)
    full = [o.prompt_token_ids + o.token_ids for o in outs]
    tokens = np.zeros((len(full), max(map(len, full))), np.int32)
    for row, seq in enumerate(full):
        tokens[row, :len(seq)] = seq
    logp = np.asarray(token_logprobs(f32.config, jax.tree.map(jnp.asarray, raw), tokens,
                                     np.array([len(s) for s in full])))
    diff = max(float(np.abs(logp[row, len(o.prompt_token_ids):len(full[row])]
                            - np.array([lp for _, lp, _ in o.logprobs], np.float32)).max())
               for row, o in enumerate(outs))
    print(f"rollout log-probs against token_logprobs (float32): max |diff| {diff:.2e}", flush=True)
    load_after = os.getloadavg()
    print(f"load average after {load_after[0]:.2f} {load_after[1]:.2f}")


if __name__ == "__main__":
    main()
