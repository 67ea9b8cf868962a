"""What the deterministic mode costs: decode throughput at batch 16 and
TTFT of one prompt, default mode against `deterministic=True`, same model,
same process, same requests.

    python benchmarks/deterministic_cost.py [--model smollm2-135m-instruct] [--repeats 3]

Per mode: one LLM (float32 weights, the CPU kernels), its programs compiled
by a first untimed pass, then `--repeats` timed passes of each workload,
the best kept:
- decode: 16 prompts of 128 random-word tokens, 64 new tokens each, greedy,
  EOS ignored, through `LLM.generate` (one `max_num_seqs=16` batch):
  decoded tokens / decode seconds (`RunStats.decoded_tokens / decode_s`);
- TTFT: one 512-token prompt, 1 new token (`RunStats.ttft_s`).
Prints the CPU, the load average before and after, and the ratios against
the targets (<= 15% lower decode throughput, <= 15% higher TTFT). Run it
alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import random

from jaxinfer import LLM, SamplingParams

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact").split()


def _prompt(llm: LLM, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ids = llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(2 * n)))
    return ids[:n]


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def measure(model: str, deterministic: bool, repeats: int) -> tuple[float, float]:
    """(decode tokens/s at batch 16, TTFT seconds of a 512-token prompt), best of `repeats`."""
    llm = LLM.load(model, max_seq_len=1024, max_num_seqs=16, progress=False,
                   deterministic=deterministic)
    batch = [_prompt(llm, 128, i) for i in range(16)]
    long = [_prompt(llm, 512, 99)]
    greedy = SamplingParams()
    best_tps, best_ttft = 0.0, float("inf")
    for i in range(repeats + 1):                # the first pass compiles
        llm.generate(batch, greedy, max_new_tokens=64, ignore_eos=True)
        stats = llm.last_stats
        tps = stats.decoded_tokens / stats.decode_s
        llm.generate(long, greedy, max_new_tokens=1, ignore_eos=True)
        ttft = llm.last_stats.ttft_s
        if i:
            best_tps, best_ttft = max(best_tps, tps), min(best_ttft, ttft)
    return best_tps, best_ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load average before: {os.getloadavg()}")
    default = measure(args.model, False, args.repeats)
    fixed = measure(args.model, True, args.repeats)
    print(f"load average after: {os.getloadavg()}")
    print(f"{'mode':14s} {'decode tok/s B=16':>18s} {'TTFT 512 (ms)':>14s}")
    for name, (tps, ttft) in (("default", default), ("deterministic", fixed)):
        print(f"{name:14s} {tps:18.1f} {ttft * 1e3:14.1f}")
    drop = 1 - fixed[0] / default[0]
    rise = fixed[1] / default[1] - 1
    print(f"decode throughput {-drop:+.1%} (target: no more than 15% lower); "
          f"TTFT {rise:+.1%} (target: no more than 15% higher)")


if __name__ == "__main__":
    main()
