"""Plots of a results dict: the roofline with every call on it, decode
latency vs batch, TTFT vs prompt length (matplotlib, Agg); and the serving
bench's throughput and latency bars (`plot_serving`)."""

from __future__ import annotations

import numpy as np


def plot_results(results: dict, path: str) -> str:
    """Three panels: the roofline with every prefill and decode call on it;
    decode TPOT vs batch; TTFT vs prompt length; each with the roofline's
    lower bound on latency. Saved as PNG (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = results["machine"]
    peak, bw = m["peak_gflops"], m["bandwidth_gbps"]
    pre, dec = results.get("prefill") or [], results.get("decode") or []
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))

    ax = axes[0]
    xs = np.logspace(-1.5, 4, 200)
    ax.loglog(xs, np.minimum(peak, xs * bw), "k-", lw=2,
              label=f"roofline ({bw:.1f} GB/s, {peak:.0f} GFLOP/s)")
    ax.axvline(m["ridge"], color="gray", ls=":", lw=1)
    ax.text(m["ridge"], peak * 0.02, f" ridge {m['ridge']:.1f}", color="gray", fontsize=8)
    for e in dec:
        ax.plot(e["intensity"], e["achieved_gflops"], "o", color="tab:blue")
        ax.annotate(f"B={e['batch']}", (e["intensity"], e["achieved_gflops"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    for e in pre:
        ax.plot(e["intensity"], e["achieved_gflops"], "s", color="tab:red")
        ax.annotate(f"{e['batch']}x{e['prompt_len']}", (e["intensity"], e["achieved_gflops"]),
                    fontsize=7, xytext=(3, 3 if e["batch"] == 1 else -10), textcoords="offset points")
    ax.plot([], [], "o", color="tab:blue", label="decode step (B)")
    ax.plot([], [], "s", color="tab:red", label="prefill (B x T)")
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved GFLOP/s",
           title="Roofline: memory-bound decode, compute-bound prefill")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    if dec:
        b = [e["batch"] for e in dec]
        ax.plot(b, [e["tpot_s"] * 1e3 for e in dec], "o-", color="tab:blue", label="jaxinfer TPOT")
        ax.plot(b, [e["roofline_s"] * 1e3 for e in dec], "k--_", ms=14, label="roofline bound")
        _plot_peer_lines(ax, dec, "batch", "tpot_s")
        ax2 = ax.twinx()
        ax2.plot(b, [e["tokens_per_s"] for e in dec], "^:", color="tab:green",
                 label="tokens/s (all rows)")
        ax2.set_ylabel("aggregate tokens/s", color="tab:green")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax2.set_ylim(bottom=0)
        ax.set(xlabel="batch size", ylabel="ms per decode step (log)",
               title=f"Decode at context ~{dec[0]['context']:.0f}")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, alpha=0.3)

    ax = axes[2]
    for batch, color in zip(sorted({e["batch"] for e in pre}), ("tab:red", "tab:purple", "tab:brown")):
        rows = [e for e in pre if e["batch"] == batch]
        t = [e["prompt_len"] for e in rows]
        ax.loglog(t, [e["ttft_s"] * 1e3 for e in rows], "s-", color=color, label=f"TTFT B={batch}")
        ax.loglog(t, [e["roofline_s"] * 1e3 for e in rows], "--_", ms=14, color=color, alpha=0.6,
                  label=f"roofline bound B={batch}")
        _plot_peer_lines(ax, rows, "prompt_len", "ttft_s", suffix=f" B={batch}")
    ax.set(xlabel="prompt length (tokens)", ylabel="ms", title="Prefill: TTFT vs prompt length")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"jaxinfer bench: {results.get('model')} ({results.get('dtype', '')}), "
                 f"loadavg {results.get('env', {}).get('loadavg_start')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_peer_lines(ax, rows, xkey: str, ykey: str, suffix: str = ""):
    """Peer latencies (seconds in the rows) as ms lines."""
    for peer, style in (("hf", "x:"), ("llamacpp", "+:")):
        pts = [(r[xkey], r["peers"][peer][ykey] * 1e3) for r in rows
               if ykey in (r.get("peers") or {}).get(peer, {})]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{peer}{suffix}")


def plot_serving(results: dict, path: str) -> str:
    """Bars of request throughput and p99 latencies per run (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = {k: v for k, v in results["runs"].items() if "request_throughput" in v}
    names = list(runs)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.barh(names, [runs[n]["request_throughput"] for n in names], color="#4477aa")
    ax1.set_xlabel("requests / s")
    ax1.set_title("request throughput")
    kind = lambda r: r.get("chat") or r.get("request")
    for i, (key, label) in enumerate((("ttft_s", "TTFT p99"), ("itl_s", "ITL p99 x 10"))):
        scale = 10 if key == "itl_s" else 1
        ax2.barh([j + i * 0.4 for j in range(len(names))],
                 [kind(runs[n])[key]["p99"] * scale for n in names], height=0.4, label=label)
    ax2.set_yticks(range(len(names)), names)
    ax2.set_xlabel("seconds")
    ax2.set_title("p99 latency (chat requests in the mixed runs)")
    ax2.legend()
    fig.savefig(path, dpi=110)
    return path
