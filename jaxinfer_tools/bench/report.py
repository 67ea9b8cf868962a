"""The bench's report: a Markdown summary of a results dict and the files a
run writes.

A run writes its JSON (every sample), its Markdown report and its plot into
an output folder the user names (`--out`), by default a fresh temporary
folder (`default_out`), never into the source tree; names carry the sweep
and the model, not a date. Given `--pages DIR` (docs/bench in a checkout),
it also rewrites that sweep's page, `DIR/<page>.md` (and `<page>.png`), in
place: a header with the run's time, commit, CPU and flags and load
average, then the report with its targets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence
from jaxinfer_tools.bench.machine import cpu_info
from jaxinfer_tools.bench.targets import verdict


def _fmt(x, spec: str = ".3g", scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, str):
        return x
    return format(x * scale, spec)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _peer_cells(entry: dict, peers: Sequence[str], key: str) -> list[str]:
    """'x1.23' ratio cells (jaxinfer / peer, throughput) for each peer."""
    out = []
    for p in peers:
        r = (entry.get("peers") or {}).get(p, {}).get(key)
        out.append("-" if r is None else f"x{r:.2f}")
    return out


def _build(build: dict) -> str:
    return ", ".join(f"{k} {' '.join(str(v).split())}" for k, v in build.items())


def _source(machine: dict, key: str) -> str:
    return f" ({machine[key]})" if machine.get(key) else ""


def format_report(results: dict) -> str:
    """A Markdown report of a results dict (the schema `jaxinfer_tools.bench` writes).

    Every section is optional, so partial results (a --quick run, a crash
    halfway) still format.
    """
    out = [f"# jaxinfer bench: {results.get('model', '?')}", ""]
    env = results.get("env", {})
    if env:
        out.append(f"{env.get('timestamp', '')} | backend {env.get('backend', '?')} | "
                   f"{env.get('cpu_count', '?')} CPUs | jax {env.get('jax_version', '?')} | "
                   f"loadavg start {env.get('loadavg_start')} end {env.get('loadavg_end')}"
                   + (" | QUICK" if env.get("quick") else ""))
        out.append("")
        load, cpus = (env.get("loadavg_start") or [0])[0], env.get("cpu_count") or 1
        if load >= cpus / 2:
            out += [f"**Noisy machine**: load average {load} on {cpus} CPUs when the run started; "
                    "timings (peers' most of all) are not comparable.", ""]
    cpu = env.get("cpu")
    if cpu:
        out += [f"CPU: {cpu.get('model')}, {cpu.get('cores')} cores; features: "
                f"{' '.join(cpu.get('features') or []) or 'none of note'}", ""]
    m = results.get("machine")
    if m:
        stat = (results.get("sweep") or {}).get("stat", "median")
        out.append(f"Roofline (measured, best of {m.get('repeats', '?')} per probe, best probe "
                   f"taken): memory read bandwidth {m['bandwidth_gbps']:.2f} GB/s"
                   f"{_source(m, 'bandwidth_source')}, matmul {m['peak_gflops']:.1f} GFLOP/s"
                   f"{_source(m, 'peak_source')}, ridge {m['ridge']:.1f} FLOP/byte. "
                   f"Latencies: {stat} of repeats.")
        out.append("")
        probes = [("GB/s", m.get("bandwidth_kernels_gbps") or {}),
                  ("GFLOP/s", m.get("matmul_kernels_gflops") or {})]
        out += [f"- probes, {unit}: " + ", ".join(f"{k} {v:.1f}" for k, v in figs.items())
                for unit, figs in probes if figs]
        torch_status = (m.get("torch_probe") or {}).get("status")
        if torch_status and torch_status != "ok":
            out.append(f"- torch matmul probe: {torch_status}")
        kern = m.get("cpu_kernels")
        if kern:
            out.append(f"- CPU kernels: {kern.get('arch')}, panels of {kern.get('panel_width')} "
                       f"columns, {kern.get('row_block')}-row register blocks, bf16 dot product "
                       f"{'on' if kern.get('bf16_dot') else 'off'}")
        out.append("")
    misc = []
    if "load_s" in results:
        misc.append(f"model load {results['load_s']:.2f} s")
    if "peak_rss_bytes" in results:
        misc.append(f"peak host memory {results['peak_rss_bytes'] / 2**20:.0f} MiB")
    if "weight_bytes" in results:
        misc.append(f"weights {results.get('weights') or 'float32'} {results['weight_bytes'] / 2**20:.0f} MiB")
    if results.get("kv_cache"):
        kv = results["kv_cache"]
        misc.append(f"KV cache {kv['bytes_per_token'] / 1024:.1f} KiB/token, "
                    f"{kv['default_bytes'] / 2**20:.0f} MiB at B=1 S={kv['default_max_seq_len']}")
    if misc:
        out += [" | ".join(misc), ""]
    peers = [p for p, s in (results.get("peers") or {}).items() if s.get("status") == "ok"]

    if results.get("prefill"):
        out += ["## Prefill (TTFT = prefill + first token)", ""]
        header = ["B", "T", "TTFT ms", "tok/s", "compile s", "GFLOP/s", "GB/s", "FLOP/B",
                  "bound", "% roof"] + [f"vs {p}" for p in peers]
        rows = [[e["batch"], e["prompt_len"], _fmt(e["ttft_s"], ".1f", 1e3),
                 _fmt(e["tokens_per_s"], ".0f"), _fmt(e.get("compile_s"), ".2f"),
                 _fmt(e["achieved_gflops"], ".1f"), _fmt(e["achieved_gbps"], ".2f"),
                 _fmt(e["intensity"], ".0f"), e["bound"], _fmt(e["roofline_fraction"], ".0%")]
                + _peer_cells(e, peers, "speedup") for e in results["prefill"]]
        out += [_md_table(header, rows), ""]
    if results.get("decode"):
        d0 = results["decode"][0]
        out += [f"## Decode (context {d0['context']:.0f} tokens mean, cache length "
                f"{d0.get('cache_len', '?')})", ""]
        header = ["B", "TPOT ms", "tok/s (all rows)", "compile s", "GFLOP/s", "GB/s", "FLOP/B",
                  "bound", "% roof"] + [f"vs {p}" for p in peers]
        rows = [[e["batch"], _fmt(e["tpot_s"], ".2f", 1e3), _fmt(e["tokens_per_s"], ".1f"),
                 _fmt(e.get("compile_s"), ".2f"), _fmt(e["achieved_gflops"], ".1f"),
                 _fmt(e["achieved_gbps"], ".2f"), _fmt(e["intensity"], ".2f"), e["bound"],
                 _fmt(e["roofline_fraction"], ".0%")] + _peer_cells(e, peers, "speedup")
                for e in results["decode"]]
        out += [_md_table(header, rows), ""]
    e2e = results.get("e2e")
    if e2e:
        out += [f"## End to end ({e2e['num_prompts']} prompts of {e2e['prompt_len_min']}-"
                f"{e2e['prompt_len_max']} tokens, batches of {e2e['batch']}, "
                f"{e2e['new_tokens']} new tokens each)", ""]
        header = ["metric", "p50", "p90", "p99", "mean"]
        rows = [[name, *(_fmt(e2e[key][p], ".1f", 1e3) for p in ("p50", "p90", "p99", "mean"))]
                for name, key in (("TTFT ms (queued)", "ttft_s"), ("TTFT ms (own batch)",
                                  "ttft_batch_s"), ("TPOT ms", "tpot_s")) if key in e2e]
        out += [_md_table(header, rows),
                "", f"throughput {e2e['tokens_per_s']:.1f} generated tokens/s over "
                f"{e2e['wall_s']:.2f} s", ""]
    comp = results.get("compile")
    if comp:
        out += ["## Compile", ""]
        rows = [[k, _fmt(v, ".2f")] for k, v in comp.items()
                if k.endswith("_s") and isinstance(v, (int, float))]
        out += [_md_table(["what", "seconds"], rows), ""]
    status = results.get("peers") or {}
    if status:
        out += ["## Peers", ""]
        out += [f"- {p}: {s.get('status')}" + (f" ({s['detail']})" if s.get("detail") else "")
                + (f"; build {_build(s['build'])}" if s.get("build") else "")
                for p, s in status.items()]
        out.append("")
    if results.get("targets"):
        out += ["## Targets", ""]
        header = ["target", "measured", "goal", "result"]
        rows = [[t["name"], _fmt(t.get("value"), ".4g"), f"{t['op']} {t['goal']:g}",
                 verdict(t.get("value"), t["op"], t["goal"])]
                for t in results["targets"]]
        out += [_md_table(header, rows), ""]
    return "\n".join(out)


def target_row(name: str, value: Optional[float], op: str, goal: float) -> dict:
    """One judged target of a sweep: {"name", "value", "op", "goal",
    "result"}, result `targets.verdict(value, op, goal)`: "PASS", "FAIL", or
    "not measured" when value is None or NaN.

    Raises:
      ValueError: op is not one of ">=", ">", "<=", "<".
    """
    return {"name": name, "value": value, "op": op, "goal": goal,
            "result": verdict(value, op, goal)}


def targets_table(targets: Sequence[dict]) -> list[str]:
    """Markdown lines of a table of targets ({"name", "value", "op", "goal",
    "result"}; value None shows as "-"), after a blank line."""
    lines = ["", "| target | measured | goal | result |", "|---|---|---|---|"]
    for t in targets:
        v = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"| {t['name']} | {v} | {t['op']} {t['goal']:g} | {t['result']} |")
    return lines


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def write_results(results: dict, out_dir: str, stem: str, report: Optional[str] = None) -> dict:
    """Write `<out_dir>/<stem>.json` and `<out_dir>/<stem>.md` (`report`, by
    default `format_report(results)`).

    Returns:
      {"json": path, "md": path}. The directory is created if needed.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "md": os.path.join(out_dir, f"{stem}.md")}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=_json_default, allow_nan=True)
        f.write("\n")
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write((report if report is not None else format_report(results)) + "\n")
    return paths


def default_out() -> str:
    """A fresh temporary folder for one run's JSON, report, plots and logs."""
    return tempfile.mkdtemp(prefix="jaxinfer-bench-")


def source_commit() -> Optional[str]:
    """The commit of the jaxinfer checkout this code runs from, with
    "+changes" when its tree differs from it; None outside a git checkout
    (an installed wheel) or without git."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True,  # noqa: E731
                                        text=True, timeout=10)
        head = run("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _loadavgs(results: dict) -> tuple:
    env = results.get("env") or {}
    return (env.get("loadavg_start", results.get("loadavg_start")),
            env.get("loadavg_end", results.get("loadavg_end")))


def page_header(results: dict, page: str) -> str:
    """The lines a results page starts with: title, then the run's time,
    commit, CPU (model, cores, feature flags) and load average at start and
    end; whatever the results do not hold reads "not recorded"."""
    env = results.get("env") or {}
    cpu = results.get("cpu") or env.get("cpu") or {}
    start, end = _loadavgs(results)
    missing = "not recorded"
    flags = " ".join(cpu.get("features") or []) or missing
    rows = [("run", results.get("timestamp") or env.get("timestamp") or missing),
            ("commit", results.get("commit") or missing),
            ("CPU", f"{cpu.get('model', missing)}, {cpu.get('cores', '?')} cores" if cpu else missing),
            ("CPU flags", flags if cpu else missing),
            ("load average", f"start {start or missing}, end {end or missing}")]
    return "\n".join([f"# {page}: {results.get('model', '?')}", "", "| | |", "|---|---|"]
                     + [f"| {k} | {v} |" for k, v in rows])


def write_page(results: dict, report: str, pages_dir: str, page: str,
               png: Optional[str] = None) -> str:
    """Rewrite `<pages_dir>/<page>.md` with `page_header` and `report` (and
    copy `png` to `<pages_dir>/<page>.png`); returns the page's path."""
    os.makedirs(pages_dir, exist_ok=True)
    path = os.path.join(pages_dir, f"{page}.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page_header(results, page) + "\n\n" + report.rstrip("\n") + "\n")
    if png:
        shutil.copyfile(png, os.path.join(pages_dir, f"{page}.png"))
    return path


def publish(results: dict, cfg, out_dir: Optional[str], kind: str, format_fn, plot_fn=None,
            pages: Optional[str] = None) -> int:
    """Finish a sweep's results (model, CPU, timestamp, commit), write them
    as `<out_dir>/<kind>-<model>.json` / `.md` (the report from
    `format_fn(results)`; out_dir None: `default_out()`) and, given
    `plot_fn(results, path)`, a `.png`; given `pages`, rewrite the page
    `<pages>/<kind>.md` (`write_page`). Print the report and return 0 (the
    exit status)."""
    results.update(model=cfg.model, cpu=cpu_info(), timestamp=time.strftime("%Y-%m-%d %H:%M:%S"),
                   commit=source_commit())
    out_dir = out_dir or default_out()
    stem = f"{kind}-{pathlib.Path(cfg.model).stem}"
    report = format_fn(results)
    paths = write_results(results, out_dir, stem, report=report)
    if plot_fn is not None:
        paths["png"] = plot_fn(results, f"{out_dir}/{stem}.png")
    if pages:
        paths["page"] = write_page(results, report, pages, kind, paths.get("png"))
    print(report)
    print("[jaxinfer bench] wrote " + ", ".join(str(p) for p in paths.values() if p), file=sys.stderr)
    return 0
