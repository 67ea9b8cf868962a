"""The library's phases on whatever `jax.devices()` holds, against that
device's roofline: decode at batch 1 and 32 as a fraction of its memory
bandwidth, prefill of 512 tokens as a fraction of its FLOP/s.

    python benchmarks/accelerator.py [--model smollm2-135m-instruct] [--dtype bfloat16]
        [--peak-bandwidth BYTES_PER_S --peak-flops FLOP_PER_S] [--repeats 5] [--json out.json]

Meant for a GPU or TPU machine (the attention backend there is Pallas,
`engine.ragged.choose_backend`); CI does not run it. On a CPU it runs too,
given --peak-bandwidth and --peak-flops (otherwise the fractions are left out).

Workloads and timing: `phases_speed.measure` (same folder). Costs: the cost
model of `jaxinfer_tools.roofline` (`decode_cost` with the 128 cached
tokens per row, `prefill_cost`), weights and K/V counted at --dtype's
bytes. Peaks: vendors' datasheet figures for the device kinds in PEAKS
(dense bfloat16 FLOP/s, HBM bytes/s), or the flags.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import phases_speed
from jaxinfer import LLM
from jaxinfer_tools import roofline

# device_kind substring -> (HBM bytes/s, dense bfloat16 FLOP/s), vendors' datasheets
PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),          # SXM
    "A100-SXM4-80GB": (2.039e12, 312e12),
    "A100-SXM4-40GB": (1.555e12, 312e12),
    "A100": (1.935e12, 312e12),         # PCIe 80GB
    "L4": (0.3e12, 121e12),
    "TPU v6 lite": (1.64e12, 918e12),
    "TPU v5p": (2.765e12, 459e12),
    "TPU v5 lite": (0.819e12, 197e12),
    "TPU v4": (1.2e12, 275e12),
}


def device_peaks(kind: str) -> tuple[float, float] | None:
    """(bytes/s, FLOP/s) of the first PEAKS key found in `kind`, else None."""
    return next((v for k, v in PEAKS.items() if k in kind), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", help="activations, KV cache and weights")
    ap.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s")
    ap.add_argument("--peak-flops", type=float, default=None, help="FLOP/s")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = jax.devices()[0]
    peaks = device_peaks(device.device_kind)
    bandwidth = args.peak_bandwidth or (peaks and peaks[0])
    flops = args.peak_flops or (peaks and peaks[1])
    llm = LLM.load(args.model, dtype=args.dtype, weights=args.dtype, progress=False)
    dtype = llm.cache_dtype
    seconds = phases_speed.measure(llm.config, llm.params, args.repeats, dtype)
    width = jnp.dtype(args.dtype).itemsize         # the weights' bytes (on CPU activations stay float32)
    costs = {"decode_b1": roofline.decode_cost(llm.config, 1, phases_speed.CONTEXT, width),
             "decode_b32": roofline.decode_cost(llm.config, 32, phases_speed.CONTEXT, width),
             "prefill_512": roofline.prefill_cost(llm.config, 1, phases_speed.PREFILL, width)}
    rows = {}
    for name, cost in costs.items():
        row = {"seconds": seconds[name], "tokens_per_s": round(cost.tokens / seconds[name], 1),
               "achieved_gbps": round(cost.bytes / seconds[name] / 1e9, 2),
               "achieved_tflops": round(cost.flops / seconds[name] / 1e12, 4)}
        if bandwidth and flops:
            point = roofline.roofline_point(cost, seconds[name], flops, bandwidth)
            row.update(memory_fraction=round(point["memory_fraction"], 4),
                       compute_fraction=round(point["compute_fraction"], 4), bound=point["bound"])
        rows[name] = row
    report = {"device": f"{device.platform}: {device.device_kind}", "devices": len(jax.devices()),
              "backend": str(llm.backend), "model": args.model, "dtype": args.dtype,
              "peak_bandwidth": bandwidth, "peak_flops": flops,
              "peaks_from": "flags" if args.peak_bandwidth else ("datasheet" if peaks else None),
              "load_average": os.getloadavg(), "workloads": rows}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
