"""The `--serve-load` report: per-server figures from the results dict
(`serve_compare.run_servers`), the targets against vLLM and llama-server,
the Markdown tables and the plot.

Targets (`serve_targets`; "best rate" = the highest Poisson rate run whose
requests all completed with p99 TTFT <= slo_ttft_s and p99 chunk gap <=
slo_gap_s; "saturation tok/s" = the highest output tokens/s of any rate):

    jaxinfer best rate         >= 1.25 x vLLM's, >= 2 x llama-server's
    jaxinfer saturation tok/s  >= 1.2 x vLLM's
    jaxinfer short req/s       >= 1.2 x vLLM's
    jaxinfer long-prompt gap ratio (p99 / median)   <= 3
    jaxinfer healthy after     < 30 s cold, < 5 s warm

A target whose figure cannot be computed is "not measured", never met
(`targets.verdict`): a ratio whose peer met the SLO at no rate (its name
says so), or that lacks jaxinfer's figure or the peer's (skipped, failed).
"""

from __future__ import annotations

import math
from typing import Optional

from jaxinfer_tools.bench.report import target_row, targets_table

PEER_LABELS = {"vllm": "vLLM", "llamacpp": "llama-server"}


def best_rate(server: Optional[dict], slo_ttft_s: float, slo_gap_s: float) -> Optional[float]:
    """The highest offered rate (requests/s) whose run completed every
    request with p99 TTFT <= slo_ttft_s and p99 chunk gap <= slo_gap_s
    (a run with no gaps, one chunk per request, meets the gap); None if none."""
    ok = []
    for run in ((server or {}).get("rates") or {}).values():
        ttft, gap = run.get("ttft_s"), run.get("gap_s")
        if ttft is None or run.get("failed") or "error" in run:
            continue
        if ttft["p99"] <= slo_ttft_s and (gap is None or gap["p99"] <= slo_gap_s):
            ok.append(run["rate"])
    return max(ok, default=None)


def saturation_tokens(server: Optional[dict]) -> Optional[float]:
    """The highest output tokens/s of any rate's run; None without runs."""
    runs = ((server or {}).get("rates") or {}).values()
    return max((r["output_tokens_per_s"] for r in runs if "output_tokens_per_s" in r), default=None)


def short_rps(server: Optional[dict]) -> Optional[float]:
    """Short requests completed per second (None if that run failed or did not run)."""
    short = (server or {}).get("short") or {}
    return short.get("request_throughput") if not short.get("failed") else None


def gap_ratio(server: Optional[dict]) -> Optional[float]:
    """The long-prompt run's p99 / median chat chunk gap (None if it did not run)."""
    return ((server or {}).get("long_prompts") or {}).get("gap_ratio")


def healthy_s(server: Optional[dict], key: str = "start") -> Optional[float]:
    """Seconds from process start to the first 200 from /health in start record `key`."""
    return ((server or {}).get(key) or {}).get("healthy_s")


def _ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    return ours / theirs if ours is not None and theirs else None


def serve_targets(servers: dict, sweep) -> list[dict]:
    """The targets (module docstring) as rows {"name", "value", "op",
    "goal", "result"} (`report.targets_table`); `sweep` gives the SLOs."""
    slo = (sweep.slo_ttft_s, sweep.slo_gap_s)
    ours = servers.get("jaxinfer")
    rate = best_rate(ours, *slo)
    rows = []
    for peer, goal in (("vllm", 1.25), ("llamacpp", 2.0)):
        theirs = servers.get(peer)
        peer_rate = best_rate(theirs, *slo)
        ran = bool((theirs or {}).get("rates"))
        peer_text = "met the SLO at no rate" if ran and peer_rate is None else f"{_fmt(peer_rate)}/s"
        rows.append(target_row(f"best rate (p99 TTFT <= {slo[0]:g} s, p99 gap <= {slo[1] * 1e3:g} "
                               f"ms): jaxinfer {_fmt(rate)}/s / {PEER_LABELS[peer]} {peer_text}",
                               _ratio(rate, peer_rate), ">=", goal))
    vllm = servers.get("vllm")
    rows += [
        target_row("output tok/s at saturation: jaxinfer / vLLM",
                   _ratio(saturation_tokens(ours), saturation_tokens(vllm)), ">=", 1.2),
        target_row(f"short requests ({sweep.short_tokens} tokens, {sweep.short_concurrency} "
                   f"concurrent) req/s: jaxinfer / vLLM", _ratio(short_rps(ours), short_rps(vllm)),
                   ">=", 1.2),
        target_row("jaxinfer chat gap p99 / median while long prompts arrive", gap_ratio(ours),
                   "<=", 3.0),
        target_row("jaxinfer healthy after, cold compile cache (s)", healthy_s(ours, "start_cold"),
                   "<", 30.0),
        target_row("jaxinfer healthy after, warm compile cache (s)", healthy_s(ours), "<", 5.0)]
    return rows


def _fmt(x: Optional[float], spec: str = "g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _q(summary: Optional[dict], q: str, scale: float = 1.0, spec: str = ".3g") -> str:
    v = (summary or {}).get(q)
    return "-" if v is None else format(v * scale, spec)


def _load(pair) -> str:
    return "/".join("-" if not p else f"{p[0]:g}" for p in pair)


def _rates_table(results: dict) -> list[str]:
    lines = ["| server | rate /s | req/s | output tok/s | TTFT p50/p99 s | gap p50/p99 ms "
             "| tokens/chunk p50/max | ITL p99 ms | E2E p99 s | done/failed | compiled | load 1m before/after |",
             "|" + "---|" * 12]
    for name, server in results["servers"].items():
        if not server.get("rates"):
            lines.append(f"| {name} | {server.get('status', '?')[:160]} |" + " |" * 10)
            continue
        for key, r in server["rates"].items():
            if "error" in r:
                lines.append(f"| {name} | {key} | {r['error']} |" + " |" * 9)
                continue
            c = r.get("compiled_during_run")
            lines.append(
                f"| {name} | {key} | {r['request_throughput']:.3f} | {r['output_tokens_per_s']:.1f} | "
                f"{_q(r['ttft_s'], 'p50')}/{_q(r['ttft_s'], 'p99')} | "
                f"{_q(r['gap_s'], 'p50', 1e3, '.0f')}/{_q(r['gap_s'], 'p99', 1e3, '.0f')} | "
                f"{_q(r['tokens_per_chunk'], 'p50', 1, 'g')}/{_q(r['tokens_per_chunk'], 'max', 1, 'g')} | "
                f"{_q(r['itl_s'], 'p99', 1e3, '.0f')} | {_q(r['e2e_s'], 'p99')} | "
                f"{r['completed']}/{r['failed']} | {'-' if c is None else f'{c[0]:.0f} ({c[1]:.1f} s)'} | "
                f"{_load((r.get('loadavg_before'), r.get('loadavg_after')))} |")
        if "saturated_at" in server:
            lines.append(f"| {name} | higher rates skipped: saturated at {server['saturated_at']:g}/s |"
                         + " |" * 10)
    return lines


def _summary_table(results: dict, sweep: dict) -> list[str]:
    slo = (sweep["slo_ttft_s"], sweep["slo_gap_s"])
    lines = ["", "| server | status | best rate /s | saturation tok/s | short req/s (load) "
             "| long-prompt gap p50/p99 ms, ratio (load) | healthy s | first request s "
             "| load 1m start/end |", "|" + "---|" * 9]
    for name, s in results["servers"].items():
        short, long = s.get("short") or {}, s.get("long_prompts") or {}
        starts = [k for k in ("start_cold", "start") if s.get(k)]
        label = {"start_cold": "cold ", "start": "warm " if "start_cold" in s else ""}
        healthy = ", ".join(f"{label[k]}{_fmt(s[k].get('healthy_s'), '.1f')}" for k in starts) or "-"
        first = ", ".join(f"{label[k]}{_fmt(s[k].get('first_request_s'), '.1f')}" for k in starts) or "-"
        gap = long.get("gap_s")
        lines.append(
            f"| {name} | {s.get('status', '?')[:100]} | {_fmt(best_rate(s, *slo))} | "
            f"{_fmt(saturation_tokens(s), '.1f')} | {_fmt(short_rps(s), '.2f')} "
            f"({_load((short.get('loadavg_before'), short.get('loadavg_after')))}) | "
            f"{_q(gap, 'p50', 1e3, '.0f')}/{_q(gap, 'p99', 1e3, '.0f')}, {_fmt(gap_ratio(s), '.2f')} "
            f"({_load((long.get('loadavg_before'), long.get('loadavg_after')))}) | {healthy} | {first} | "
            f"{_load((s.get('loadavg_start'), s.get('loadavg_end')))} |")
    return lines


def _footprint_table(results: dict) -> list[str]:
    """Per server, what its process tree held after the workloads."""
    lines = ["", "| server (after the workloads) | processes | memory maps | RSS MiB | open fds "
             "| programs held / compiled |", "|" + "---|" * 6]
    for name, s in results["servers"].items():
        f = s.get("after_workloads")
        if not f:
            continue
        programs = (f"{f['programs_live']:.0f} / {f['programs_compiled']:.0f}"
                    if "programs_live" in f else "-")
        lines.append(f"| {name} | {f['pids']} | {f['maps']} | {f['rss_mib']:.0f} | {f['fds']} "
                     f"| {programs} |")
    return lines if len(lines) > 3 else []


def format_load(results: dict) -> str:
    """The Markdown report: CPU and workload, the per-rate table, the
    per-server summary and the targets."""
    sw, cpu = results["sweep"], results.get("cpu") or {}
    head = [f"# serve-load: {results.get('model', '?')}", "",
            f"{results.get('timestamp', '')} | CPU {cpu.get('model', '?')}, {results.get('cpu_count')} "
            f"cores | load average start {results.get('loadavg_start')} end {results.get('loadavg_end')}",
            "", f"{sw['num_requests']} requests per Poisson rate, prompts {sw['prompt_len'][0]}-"
            f"{sw['prompt_len'][1]} tokens, outputs {sw['output_len'][0]}-{sw['output_len'][1]} "
            f"(log-uniform), {sw['max_num_seqs']} sequences of up to {sw['max_seq_len']} tokens per "
            f"server; short: {sw['short_requests']} chat requests of {sw['short_tokens']} tokens, "
            f"{sw['short_concurrency']} concurrent; long prompts: {sw['long_prompts']} of "
            f"{sw['long_prompt_tokens']} tokens every {sw['long_every_s']:g} s under "
            f"{sw['long_streams']} chat streams of {sw['long_chat_tokens']} tokens.", ""]
    return "\n".join(head + _rates_table(results) + _summary_table(results, sw)
                     + _footprint_table(results) + targets_table(results["targets"]))


def plot_load(results: dict, path: str) -> str:
    """Output tokens/s, p99 TTFT and p99 chunk gap against the offered
    rate, one line per server, the SLOs dashed; saved as PNG; returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    sw = results["sweep"]
    for name, server in results["servers"].items():
        runs = [r for r in (server.get("rates") or {}).values() if "error" not in r]
        if not runs:
            continue
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["output_tokens_per_s"] for r in runs], "o-", label=name)
        for ax, key in ((axes[1], "ttft_s"), (axes[2], "gap_s")):
            ax.plot(rates, [(r.get(key) or {}).get("p99", math.nan) for r in runs], "o-", label=name)
    axes[1].axhline(sw["slo_ttft_s"], color="red", ls="--", lw=1, label=f"SLO {sw['slo_ttft_s']:g} s")
    axes[2].axhline(sw["slo_gap_s"], color="red", ls="--", lw=1, label=f"SLO {sw['slo_gap_s']:g} s")
    titles = ("output tokens/s", "p99 TTFT (s)", "p99 gap between streamed chunks (s)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.savefig(path, dpi=110)
    return path
