"""Performance arithmetic (jaxinfer_tools.roofline) on hand-computed tiny configs,
the percentile helper, and the benchmark's writers on fake results.
No timing, no compiled programs."""

import json
import math

import numpy as np
import pytest

from jaxinfer_tools import roofline as metrics
from jaxinfer.config import ModelConfig

def attainable_flops(intensity, peak_flops, bandwidth):
    """Roofline: min(peak FLOP/s, intensity * bandwidth) (Williams et al. 2009)."""
    return min(peak_flops, intensity * bandwidth)


# L=2, D=4, N=2, K=1, H=2, F=8, V=10, tied embeddings.
TINY = ModelConfig(arch="llama", vocab_size=10, num_layers=2, hidden_size=4, num_heads=2,
                   num_kv_heads=1, head_dim=2, intermediate_size=8, tie_word_embeddings=True)
# Same, with one sliding layer (window 2) then one full layer.
TINY_SLIDING = TINY.replace(layer_types=("sliding_attention", "full_attention"), sliding_window=2)


def test_param_counts_by_hand():
    # per layer: q D*N*H=16, k D*K*H=8, v 8, o N*H*D=16 -> 48; mlp 3*D*F=96 -> 144
    assert metrics.layer_matmul_params(TINY) == 144
    assert metrics.layer_vector_params(TINY) == 8  # two RMSNorm scales of D
    assert metrics.param_count(TINY) == {"layers": 304, "embed": 40, "lm_head": 0,
                                         "final_norm": 4, "total": 348}
    untied = metrics.param_count(TINY.replace(tie_word_embeddings=False))
    assert untied["lm_head"] == 40 and untied["total"] == 388
    gemma_like = TINY.replace(arch="gemma3", sandwich_norm=True, qk_norm=True)
    assert metrics.layer_vector_params(gemma_like) == 4 * 4 + 2 * 2
    qwen_like = TINY.replace(attention_bias=True)
    assert metrics.layer_vector_params(qwen_like) == 8 + 2 * (2 + 2)


def test_weight_and_kv_bytes_by_hand():
    # layers 304 + final norm 4 + LM head (the tied table) 40 = 348 floats
    assert metrics.weight_bytes(TINY) == 348 * 4
    assert metrics.weight_bytes(TINY, dtype_bytes=2) == 348 * 2
    assert metrics.kv_bytes_per_position(TINY) == 2 * 2 * 1 * 2 * 4  # 2 (K,V) * L * K * H * 4
    assert metrics.kv_positions_kept(TINY, 3) == 6
    assert metrics.kv_positions_kept(TINY_SLIDING, 3) == 2 + 3


def test_attention_keys_by_hand():
    assert metrics.attended_keys(TINY, 0) == 2        # itself, in each of 2 layers
    assert metrics.attended_keys(TINY, 3) == 8
    assert metrics.attended_keys(TINY_SLIDING, 3) == 2 + 4
    assert metrics.causal_keys(TINY, 3) == 2 * (1 + 2 + 3)
    assert metrics.causal_keys(TINY_SLIDING, 3) == (1 + 2 + 2) + (1 + 2 + 3)
    for t in range(1, 9):  # closed form = explicit sum
        assert metrics.causal_keys(TINY_SLIDING, t) == sum(
            metrics.attended_keys(TINY_SLIDING, p) for p in range(t))


def test_prefill_cost_by_hand():
    c = metrics.prefill_cost(TINY, batch=1, prompt_len=3)
    # matmuls 3 tokens * 2 * L * 144 = 1728; attention 4*N*H * 12 keys = 192;
    # LM head on the last position only 2*D*V = 80
    assert c.flops == 1728 + 192 + 80
    # weights 1392 + embedding gather 3*D*4 = 48 + K/V written 6 entries * 2*K*H*4 = 96
    assert c.bytes == 1392 + 48 + 96
    assert c.tokens == 3
    assert c.intensity == pytest.approx(2000 / 1536)
    c2 = metrics.prefill_cost(TINY, batch=2, prompt_len=3)
    assert c2.flops == 2 * 2000 and c2.bytes == 1392 + 2 * 144


def test_chunk_flops_by_hand():
    # positions 1 and 2: matmuls 2 tokens * 2*L*144 = 1152; keys (2 + 3) per
    # full layer, (2 + 2) on the sliding one (window 2); 4*N*H = 16 FLOPs a key
    assert metrics.chunk_flops(TINY, 1, 2) == (1152, 16 * 2 * 5)
    assert metrics.chunk_flops(TINY_SLIDING, 1, 2) == (1152, 16 * (4 + 5))
    # a prompt's chunks add up to its prefill without the LM head
    assert sum(metrics.chunk_flops(TINY, 0, 1) + metrics.chunk_flops(TINY, 1, 2)) == 2000 - 80
    assert metrics.chunk_flops(TINY, 5, 0) == (0, 0)
    with pytest.raises(ValueError, match="start >= 0 and length >= 0, got -1, 2"):
        metrics.chunk_flops(TINY, -1, 2)


def test_chunk_cost_and_the_long_chunk_it_allows_by_hand():
    from jaxinfer.serving import chunking

    assert chunking.ATTENTION_FLOP_COST == 2.5 and chunking.LONG_CHUNK_GROWTH == 1.5
    assert chunking.chunk_cost(TINY, 1, 2) == 1152 + 2.5 * 160
    # cost = length * (1 + start): the limit is 1.5 * 4 = 6 for tokens = 4
    cost = lambda start, length: length * (1 + start)  # noqa: E731
    assert [chunking.long_chunk(cost, s, 4) for s in (0, 1, 2, 5, 9)] == [4, 3, 2, 1, 1]
    assert (chunking.long_chunk(cost, 9, 1), chunking.long_chunk(cost, 9, 0)) == (1, 0)


def test_decode_cost_by_hand():
    c = metrics.decode_cost(TINY, batch=2, context=3)
    # per row: matmuls 2*L*144 = 576, LM head 80, attention 4*N*H * 8 keys = 128
    assert c.flops == 2 * (576 + 80 + 128)
    # weights 1392 + gather 2*D*4 = 32 + K/V read 2 rows * 6 entries * 16 = 192 + written 2*L*16 = 64
    assert c.bytes == 1392 + 32 + 192 + 64
    assert c.flops_per_token == 784
    # an engine reading the whole 8-slot buffer reads 2 rows * 16 entries * 16 bytes
    assert metrics.decode_cost(TINY, 2, 3, cache_len=8).bytes == 1392 + 32 + 512 + 64
    # sliding layer: at most W=2 cached entries read, W keys attended
    s = metrics.decode_cost(TINY_SLIDING, batch=1, context=5)
    assert s.flops == 576 + 80 + 16 * (2 + 6)
    assert s.bytes == 1392 + 16 + (2 + 5) * 16 + 2 * 16
    # fractional (mean) contexts interpolate linearly on full layers
    mid = metrics.decode_cost(TINY, 1, 3.5)
    assert mid.flops == pytest.approx((metrics.decode_cost(TINY, 1, 3).flops
                                       + metrics.decode_cost(TINY, 1, 4).flops) / 2)


def test_decode_is_memory_bound_and_prefill_compute_bound_on_real_shapes():
    smollm2 = ModelConfig(arch="llama", vocab_size=49152, num_layers=30, hidden_size=576,
                          num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                          tie_word_embeddings=True)
    assert metrics.param_count(smollm2)["total"] == 134_515_008  # the GGUF's tensor sizes
    peak, bw = 100e9, 10e9
    d1 = metrics.decode_cost(smollm2, 1, 256)
    assert d1.intensity == pytest.approx(0.5, rel=0.05)  # 2 FLOPs per 4-byte weight
    assert metrics.bound(d1.intensity, peak, bw) == "memory"
    p = metrics.prefill_cost(smollm2, 1, 512)
    assert metrics.bound(p.intensity, peak, bw) == "compute"


def test_roofline_by_hand():
    peak, bw = 100.0, 10.0
    assert metrics.ridge_point(peak, bw) == 10.0
    assert attainable_flops(5.0, peak, bw) == 50.0
    assert attainable_flops(20.0, peak, bw) == 100.0
    assert metrics.bound(5.0, peak, bw) == "memory"
    assert metrics.bound(10.0, peak, bw) == "compute"
    assert metrics.bound(20.0, peak, bw) == "compute"
    pt = metrics.roofline_point(metrics.Cost(1000.0, 100.0, 1), 20.0, peak, bw)
    assert pt["roofline_s"] == 10.0 and pt["roofline_fraction"] == 0.5
    assert pt["achieved_gflops"] == pytest.approx(50 / 1e9)
    assert pt["achieved_gbps"] == pytest.approx(5 / 1e9)
    assert pt["compute_fraction"] == 0.5 and pt["memory_fraction"] == 0.5
    # roofline_fraction is achieved / attainable FLOP/s
    for cost in (metrics.Cost(1000.0, 100.0, 1), metrics.Cost(100.0, 100.0, 1)):
        pt = metrics.roofline_point(cost, 20.0, peak, bw)
        attainable = attainable_flops(cost.intensity, peak, bw)
        assert pt["roofline_fraction"] == pytest.approx(cost.flops / 20.0 / attainable)
    mem = metrics.roofline_point(metrics.Cost(100.0, 100.0, 1), 20.0, peak, bw)
    assert mem["bound"] == "memory" and mem["roofline_s"] == 10.0
    assert mem["memory_fraction"] == 0.5 and mem["compute_fraction"] == 0.05


def test_percentile():
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)
    assert metrics.percentile([1, 2, 3, 4], 0) == 1 and metrics.percentile([1, 2, 3, 4], 100) == 4
    assert metrics.percentile([7.0], 99) == 7.0
    xs = np.random.default_rng(0).exponential(size=101)
    for q in (1, 37, 50, 90, 99):
        assert metrics.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    with pytest.raises(ValueError):
        metrics.percentile([], 50)
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)
    s = metrics.summarize([1, 2, 3, 4])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5 and s["max"] == 4


def _fake_results():
    machine = {"bandwidth_gbps": 10.0, "peak_gflops": 100.0, "ridge": 10.0, "repeats": 3,
               "peak_source": "torch_square_2048", "bandwidth_source": "cpp_read_sum",
               "matmul_kernels_gflops": {"xla_square_2048": 80.0, "torch_square_2048": 100.0},
               "bandwidth_kernels_gbps": {"xla_gemv": 9.0, "cpp_read_sum": 10.0}}
    pre = {"batch": 1, "prompt_len": 512, "ttft_s": 2.0, "tokens_per_s": 256.0, "compile_s": 3.0}
    pre.update(metrics.roofline_point(metrics.Cost(140e9, 0.6e9, 512), 2.0, 100e9, 10e9))
    pre["peers"] = {"hf": {"ttft_s": 3.0, "speedup": 1.5}}
    decs = []
    for b, tpot in ((1, 0.08), (32, 0.5)):
        d = {"batch": b, "context": 300.0, "cache_len": 512, "tpot_s": tpot, "tokens_per_s": b / tpot,
             "compile_s": 2.0, "steps": 64,
             "peers": {"hf": {"tpot_s": 0.2, "speedup": 2.5}, "llamacpp": {"tokens_per_s": 20.0}}}
        d.update(metrics.roofline_point(metrics.Cost(b * 0.27e9, 0.55e9, b), tpot, 100e9, 10e9))
        decs.append(d)
    e2e = {"num_prompts": 8, "batch": 4, "new_tokens": 17, "prompt_len_min": 16,
           "prompt_len_max": 120, "wall_s": 3.0, "tokens_per_s": 45.3,
           "ttft_s": metrics.summarize([0.1, 0.2, 0.9]), "ttft_batch_s": metrics.summarize([0.1, 0.2]),
           "tpot_s": metrics.summarize([0.05, 0.06])}
    return {"model": "tiny", "dtype": "float32",
            "env": {"timestamp": "2025-01-01 00:00:00", "backend": "cpu", "cpu_count": 2,
                    "cpu": {"model": "Test CPU 9000", "cores": 2, "features": ["avx2", "avx512_bf16"]},
                    "jax_version": "0", "loadavg_start": [1.0, 1.0, 1.0], "quick": True},
            "machine": machine, "load_s": 1.5, "peak_rss_bytes": 2**30, "weight_bytes": 2**29,
            "kv_cache": {"bytes_per_token": 46080, "default_max_seq_len": 2048,
                         "default_bytes": 94371840},
            "prefill": [pre], "decode": decs, "e2e": e2e,
            "compile": {"first_start_compile_s": 12.0, "second_start_compile_s": 1.0},
            "peers": {"hf": {"status": "ok"}, "llamacpp": {"status": "ok"}},
            "sweep": {"prefill_lengths": (32, 512)}}


def test_report_and_json_writer(tmp_path):
    from jaxinfer_tools.bench import report, targets

    results = _fake_results()
    results["targets"] = targets.compute_targets(results)
    assert results["targets"][0]["passed"] is False  # 0.55 GB / 10 GB/s / 0.08 s = 0.69
    assert results["targets"][0]["value"] == pytest.approx(0.6875)
    assert results["targets"][1]["value"] == 2.5 and results["targets"][1]["passed"]
    assert results["targets"][3]["value"] == pytest.approx(64 / 20)   # 64 tok/s vs llama.cpp 20
    by_measure = {t["measure"]: t for t in results["targets"]}
    assert by_measure["compile.first_start_compile_s"]["passed"]
    assert by_measure["compile.second_start_compile_s"]["passed"]
    b1 = by_measure["prefill[batch=1,prompt_len=512].peers.hf.speedup"]
    assert b1["value"] == 1.5 and b1["passed"]
    assert by_measure["prefill[batch=1,prompt_len=512].compute_fraction"]["value"] == pytest.approx(0.7)
    assert by_measure["prefill[batch=8,prompt_len=2048].peers.hf.speedup"]["value"] is None
    paths = report.write_results(results, str(tmp_path / "out"), "tiny-1")
    loaded = json.loads(open(paths["json"]).read())
    assert loaded["decode"][1]["batch"] == 32 and loaded["sweep"]["prefill_lengths"] == [32, 512]
    md = open(paths["md"]).read()
    for piece in ("## Prefill", "## Decode", "## End to end", "## Targets", "| 512 |", "x1.50",
                  "FAIL", "PASS", "TTFT ms (queued)", "Noisy machine",
                  "CPU: Test CPU 9000, 2 cores; features: avx2 avx512_bf16",
                  "matmul 100.0 GFLOP/s (torch_square_2048)", "10.00 GB/s (cpp_read_sum)",
                  "probes, GFLOP/s: xla_square_2048 80.0, torch_square_2048 100.0"):
        assert piece in md, piece


def test_publish_rewrites_its_page_in_place_and_keeps_json_out_of_it(tmp_path, monkeypatch, capsys):
    """A sweep's results go to the output folder under names without a date;
    --pages rewrites <pages>/<kind>.md in place, headed by the run's time,
    commit, CPU and flags and load average ("not recorded" where absent)."""
    import types

    from jaxinfer_tools.bench import report

    monkeypatch.setattr(report, "cpu_info", lambda: {"model": "Test CPU 9000", "cores": 2,
                                                      "features": ["avx2", "avx512f"]})
    monkeypatch.setattr(report, "source_commit", lambda: "abc1234")
    cfg = types.SimpleNamespace(model="models/tiny.gguf")
    out, pages = tmp_path / "out", tmp_path / "pages"
    for value in (1.5, 2.5):
        results = {"loadavg_start": [0.5, 0.4, 0.3],
                   "targets": [report.target_row("a ratio", value, ">=", 2.0)]}
        assert report.publish(results, cfg, str(out), "paged", lambda r: report_text(r),
                              pages=str(pages)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["paged-tiny.json", "paged-tiny.md"]
    assert sorted(p.name for p in pages.iterdir()) == ["paged.md"]
    page = (pages / "paged.md").read_text()
    assert page.startswith("# paged: models/tiny.gguf\n")
    for piece in ("| commit | abc1234 |", "| CPU | Test CPU 9000, 2 cores |", "| CPU flags | avx2 avx512f |",
                  "| load average | start [0.5, 0.4, 0.3], end not recorded |", "| a ratio | 2.5 |"):
        assert piece in page, piece
    assert "| 1.5 |" not in page and json.loads((out / "paged-tiny.json").read_text())["commit"] == "abc1234"
    capsys.readouterr()
    monkeypatch.setattr(report.tempfile, "mkdtemp", lambda prefix: str(tmp_path / f"{prefix}tmp"))
    report.publish({}, cfg, None, "structured", lambda r: "x")
    assert (tmp_path / "jaxinfer-bench-tmp" / "structured-tiny.json").exists()


def report_text(results: dict) -> str:
    from jaxinfer_tools.bench import report

    return "\n".join(report.targets_table(results["targets"]))


def test_report_formats_partial_and_unmeasured_results(capsys):
    from jaxinfer_tools.bench import report, targets

    assert report.format_report({}).startswith("# jaxinfer bench")
    results = {"model": "m", "decode": [], "targets": targets.compute_targets({})}
    assert all(t["passed"] is None for t in results["targets"])
    assert "| not measured |" in report.format_report(results)
    targets.print_targets(results["targets"])
    assert capsys.readouterr().out.count("not measured") == len(results["targets"])
    # a NaN-containing result still serialises
    assert "NaN" in json.dumps({"x": math.nan})


def test_report_names_the_weights_format_it_measured():
    from jaxinfer_tools.bench import report

    text = report.format_report({"model": "m", "load_s": 1.0, "weights": "q4", "weight_bytes": 92 * 2**20})
    assert "model load 1.00 s | weights q4 92 MiB" in text
    assert "weights float32 92 MiB" in report.format_report({"model": "m", "weight_bytes": 92 * 2**20})


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxinfer_tools.bench import plots

    path = plots.plot_results(_fake_results(), str(tmp_path / "plot.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_parser_registers_subcommand():
    import argparse

    from jaxinfer_tools.bench import common
    from jaxinfer_tools.bench import run as bench

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    bench.add_bench_parser(sub)
    args = parser.parse_args(["bench", "--config", "c.yaml", "--quick", "--peers", "none",
                              "--decode-batches", "1,2", "max_seq_len=256"])
    assert args.func is bench.cmd_bench and args.quick and args.overrides == ["max_seq_len=256"]
    sweep = bench._sweep_from_args(args)
    assert sweep.decode_batches == (1, 2) and sweep.prefill_lengths == bench.QUICK.prefill_lengths
    assert common.headline([3.0, 1.0, 2.0, 10.0], "median") == 2.5
    assert common.headline([3.0, 1.0, 2.0, 10.0], "min") == 1.0
    with pytest.raises(ValueError):
        common.headline([1.0], "mean")
    assert bench._sweep_from_args(parser.parse_args(
        ["bench", "--config", "c", "--stat", "min"])).stat == "min"
    assert bench._model_stem("/a/b/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"


def test_missing_or_unusable_peer_is_skipped_with_reason(monkeypatch, tmp_path):
    import sys

    from jaxinfer_tools.bench import peers

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    peer, status = peers.load_peer("llamacpp", tmp_path / "m.gguf", 1, 16)
    assert peer is None and status["status"] == "skipped: not installed"
    assert "llama-cpp-python" in status["detail"]
    monkeypatch.delitem(sys.modules, "llama_cpp")
    pytest.importorskip("llama_cpp")
    peer, status = peers.load_peer("llamacpp", tmp_path, 1, 16)  # a folder, not a .gguf
    assert peer is None and status["status"].startswith("skipped: failed to load")


def test_target_measures_and_cpu_facts():
    from jaxinfer_tools.bench import machine, targets

    results = {"decode": [{"batch": 1, "x": 2.0, "peers": {"hf": {"y": 8.0}}}, {"batch": 32, "x": 4.0}]}
    assert targets.measure_value(results, "decode[batch=32].x") == 4.0
    assert targets.measure_value(results, "decode[batch=32].x / decode[batch=1].peers.hf.y") == 0.5
    assert targets.measure_value(results, "decode[batch=2].x") is None
    assert targets.measure_value(results, "prefill[batch=1].x") is None
    with pytest.raises(ValueError, match="bad measure path step 'x-y'"):
        targets.measure_value(results, "decode[batch=1].x-y")
    info = machine.cpu_info()
    assert isinstance(info["model"], str) and info["model"]
    assert set(info["features"]) <= set(machine.FEATURES)
