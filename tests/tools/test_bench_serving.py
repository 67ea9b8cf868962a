"""The in-process benchmarks' pure parts on hand-made inputs, and their
serving-step drivers on a tiny random model: the serving traces fit the
max_seq_len the bench loads the model with (a 2,048-token prompt + 16 new
tokens once overflowed the config's 2,048 after 17 minutes of running),
`tools.bench.steps` (prompt packing, block tables, filled slots), the
targets and reports of --paged, --serving and --speculative, and
--serve-load's traces, request bodies and targets (no server is started)."""

import math

import numpy as np
import pytest

from jaxinfer_tools.bench.serving import LONG_OUTPUT, QUICK_SERVING, ServingSweep, make_trace, mixed_trace


@pytest.mark.parametrize("sweep,expected", [(ServingSweep(), 2048 + LONG_OUTPUT),
                                            (QUICK_SERVING, 256 + LONG_OUTPUT)])
def test_every_trace_request_fits_the_sweeps_max_seq_len(sweep, expected):
    assert sweep.max_seq_len == expected
    traces = [make_trace(1000, sweep.num_requests, sweep.prompt_len, sweep.output_len, sweep.rate,
                         sweep.seed),
              make_trace(1000, sweep.num_requests, sweep.prompt_len, sweep.output_len, math.inf,
                         sweep.seed),
              mixed_trace(1000, sweep)]
    longest = max(len(r.prompt_ids) + r.max_new_tokens for trace in traces for r in trace)
    assert longest <= sweep.max_seq_len
    assert sum(r.kind == "long" for r in traces[2]) == sweep.long_prompts


def test_worker_error_tail_drops_progress_bars():
    from jaxinfer_tools.bench.common import error_tail

    stderr = ("Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]\r"
              "Loading weights: 100%|##########| 272/272 [00:00<00:00, 22271.37it/s]\n"
              "Traceback (most recent call last):\n  ...\nMemoryError: out of memory\n"
              "Converting: 90%|######### | 246/272 [00:01<00:00, 290.69it/s]\n")
    assert error_tail(stderr) == "Traceback (most recent call last):\n  ...\nMemoryError: out of memory"
    assert error_tail(stderr, chars=9) == "of memory"


# --- jaxinfer bench --serve-load: traces, targets, peer skips (no server is started) ---

class _WordTokenizer:
    """A tokenizer whose tokens are 200 whole words (" aaa", " aab", ...): a
    text encodes to one token per word, exactly."""

    def __init__(self):
        letters = "abcdefghij"
        self.words = [" " + letters[i // 100] + letters[i // 10 % 10] + letters[i % 10] + "x"
                      for i in range(200)]
        self.vocab_size = len(self.words)

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [self.words.index(" " + w) for w in text.split()]


def test_serve_load_traces_have_the_sweeps_lengths():
    from jaxinfer_tools.bench.serve_compare import LoadSweep, make_traces

    sweep = LoadSweep(num_requests=12, short_requests=5, long_prompts=3)
    t = make_traces(_WordTokenizer(), sweep)
    assert len(t.rates) == len(sweep.rates)
    assert (len(t.rates[0]), len(t.warmup), len(t.short), len(t.long), len(t.chat)) == (12, 16, 5, 3, 32)
    assert t.long.prompt_tokens == (2048, 2048, 2048)
    assert t.long.output_tokens == (16, 16, 16)
    assert t.short.output_tokens == (8, 8, 8, 8, 8)
    assert all(16 <= n <= 64 for n in t.short.prompt_tokens)
    assert all(32 <= n <= 512 for n in t.rates[0].prompt_tokens)
    assert all(32 <= n <= 256 for n in t.rates[0].output_tokens)
    again = make_traces(_WordTokenizer(), sweep)
    assert again.rates == t.rates and again.rates[0] != t.warmup
    # every rate: the same lengths, outputs and arrivals, prompts of its own
    first = t.rates[0]
    for other in t.rates[1:]:
        assert other.output_tokens == first.output_tokens and other.unit_gaps == first.unit_gaps
        assert [len(p.split()) for p in other.prompts] == [len(p.split()) for p in first.prompts]
        assert not set(other.prompts) & set(first.prompts)
    # the warm-up sends none of the timed prompts (a prefix-cache hit would skew the timed run)
    assert (len(t.warmup_short), len(t.warmup_long), len(t.warmup_chat)) == (16, 2, 32)
    assert t.warmup_long.prompt_tokens == (2048, 2048)
    for timed, warm in [(t.short, t.warmup_short), (t.long, t.warmup_long), (t.chat, t.warmup_chat)]:
        assert not set(timed.prompts) & set(warm.prompts)
    assert t.rates[0].arrivals(2.0)[0] == 0.0


def test_serve_load_request_bodies():
    from jaxinfer_tools.bench.serve_load import chunk_text, request_body

    path, body = request_body("m", "hi", 8, chat=True)
    assert path == "/v1/chat/completions"
    assert body == {"model": "m", "max_tokens": 8, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "hi"}], "min_tokens": 8,
                    "ignore_eos": True}
    path, body = request_body("m", "hi", 4, fixed_length=False)
    assert path == "/v1/completions"
    assert body == {"model": "m", "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt": "hi"}
    assert chunk_text({"text": "a"}) == "a"
    assert chunk_text({"delta": {"content": "b"}}) == "b"
    assert chunk_text({"delta": {"role": "assistant"}}) == ""


def test_serve_load_summaries_count_chunk_gaps_and_tokens():
    from jaxinfer_tools.bench.serve_load import RequestResult, summarize_load
    from jaxinfer_tools.bench.serve_workloads import summarize_long_prompts

    a = RequestResult(ok=True, ttft=0.5, e2e=1.0, output_tokens=17, gaps=[0.1, 0.4],
                      chunk_tokens=[1, 8, 8])
    b = RequestResult(ok=True, ttft=0.2, e2e=0.4, output_tokens=2, gaps=[0.2], chunk_tokens=[1, 1])
    bad = RequestResult(error="HTTP 500")
    s = summarize_load([a, b, bad], 2.0, 1.0, 0.15)
    assert (s["completed"], s["failed"], s["request_throughput"], s["output_tokens_per_s"]) == (2, 1, 1.0, 9.5)
    assert (s["gap_s"]["n"], s["gap_s"]["max"], s["gap_s"]["p50"]) == (3, 0.4, 0.2)
    assert (s["tokens_per_chunk"]["max"], s["tokens_per_chunk"]["n"]) == (8, 5)
    long = summarize_long_prompts([a, b], [RequestResult(ok=True, ttft=3.0), bad], 10.0)
    assert (long["chat_completed"], long["long_completed"], long["long_failed"]) == (2, 1, 1)
    assert long["gap_ratio"] == long["gap_s"]["p99"] / 0.2
    assert long["long_ttft_s"]["p50"] == 3.0


def _run(rate, ttft_p99, gap_p99, tok_s, failed=0):
    return {"rate": rate, "failed": failed, "ttft_s": {"p99": ttft_p99}, "gap_s": {"p99": gap_p99},
            "output_tokens_per_s": tok_s}


def test_serve_targets_from_a_hand_made_summary():
    from jaxinfer_tools.bench.serve_compare import LoadSweep
    from jaxinfer_tools.bench.serve_report import best_rate, serve_targets

    servers = {
        "jaxinfer": {"rates": {"1": _run(1.0, 0.3, 0.05, 100.0), "2": _run(2.0, 0.8, 0.12, 190.0),
                               "4": _run(4.0, 0.9, 0.2, 300.0)},
                     "short": {"request_throughput": 6.0, "failed": 0},
                     "long_prompts": {"gap_ratio": 2.5},
                     "start": {"healthy_s": 4.0}, "start_cold": {"healthy_s": 31.0}},
        "vllm": {"rates": {"1": _run(1.0, 0.5, 0.1, 80.0), "2": _run(2.0, 1.5, 0.1, 150.0)},
                 "short": {"request_throughput": 4.0, "failed": 0}},
        "llamacpp": {"rates": {"1": _run(1.0, 1.2, 0.1, 60.0, failed=0), "2": _run(2.0, 0.5, 0.1, 70.0, 1)}},
    }
    assert best_rate(servers["jaxinfer"], 1.0, 0.15) == 2.0    # 4/s misses the gap
    assert best_rate(servers["llamacpp"], 1.0, 0.15) is None   # 1/s misses TTFT, 2/s failed one
    rows = serve_targets(servers, LoadSweep())
    assert [(r["value"], r["op"], r["goal"], r["result"]) for r in rows] == [
        (2.0, ">=", 1.25, "PASS"),
        (None, ">=", 2.0, "not measured"),                     # llama-server met no rate: never met
        (2.0, ">=", 1.2, "PASS"),
        (1.5, ">=", 1.2, "PASS"),
        (2.5, "<=", 3.0, "PASS"),
        (31.0, "<", 30.0, "FAIL"),
        (4.0, "<", 5.0, "PASS")]
    assert rows[0]["name"] == "best rate (p99 TTFT <= 1 s, p99 gap <= 150 ms): jaxinfer 2/s / vLLM 1/s"
    assert rows[1]["name"] == ("best rate (p99 TTFT <= 1 s, p99 gap <= 150 ms): jaxinfer 2/s / "
                               "llama-server met the SLO at no rate")
    missing = serve_targets({"jaxinfer": servers["jaxinfer"], "vllm": {"status": "skipped: x"}},
                            LoadSweep())
    assert [r["result"] for r in missing[:4]] == ["not measured"] * 4
    assert missing[0]["name"].endswith("jaxinfer 2/s / vLLM -/s")


def test_a_target_no_run_measured_is_not_measured_never_met():
    """Neither side meeting the SLO, or a ratio's figure missing, is "not
    measured" in every bench sweep's targets and tables (`targets.verdict`)."""
    from jaxinfer_tools.bench import report, speculative, structured, targets
    from jaxinfer_tools.bench.serve_compare import LoadSweep
    from jaxinfer_tools.bench.serve_report import serve_targets

    late = {"rates": {"1": _run(1.0, 5.0, 0.1, 60.0)}}                  # ran, met no rate
    rows = serve_targets({"jaxinfer": late, "vllm": late, "llamacpp": late}, LoadSweep())
    assert [r["result"] for r in rows[:2]] == ["not measured", "not measured"]
    assert report.targets_table(rows[1:2])[-1] == (
        "| best rate (p99 TTFT <= 1 s, p99 gap <= 150 ms): jaxinfer -/s / llama-server met the SLO "
        "at no rate | - | >= 2 | not measured |")
    assert [targets.verdict(v, op, 1.0) for v, op in ((None, ">="), (float("nan"), "<"),
                                                       (1.0, ">="), (1.0, ">"), (1.0, "<="))] == [
        "not measured", "not measured", "PASS", "FAIL", "PASS"]
    with pytest.raises(ValueError, match="op must be one of '>=', '>', '<=', '<', got '=='"):
        targets.verdict(1.0, "==", 1.0)
    spec = speculative.spec_targets({"runs": [], "llamacpp": {"tokens_per_s": None}})
    assert [t["result"] for t in spec] == ["not measured"] * 3
    free = [{"batch": 4, "constrained": False, "decode_tokens_per_s": 10.0}]
    struct = structured.structured_targets({"sweep": {"batches": [4]}, "runs": free,
                                            "compile": {}, "peer": {"skipped": "x"}})
    assert [t["result"] for t in struct] == ["not measured"] * 3


def test_saturation_rule():
    from jaxinfer_tools.bench.serve_compare import saturated

    assert saturated({"request_throughput": 1.3, "ttft_s": {"p99": 6.0}}, 2.0, 1.0)
    assert not saturated({"request_throughput": 1.5, "ttft_s": {"p99": 60.0}}, 2.0, 1.0)
    assert not saturated({"request_throughput": 0.5, "ttft_s": {"p99": 4.0}}, 2.0, 1.0)
    assert saturated({"request_throughput": 0.0, "ttft_s": None}, 2.0, 1.0)


def test_missing_peers_are_skipped_with_the_reason(monkeypatch, tmp_path):
    import pathlib

    from jaxinfer_tools.bench import serve_peers
    from jaxinfer_tools.bench.serve_compare import LoadSweep, peer_names, run_servers

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    servers = run_servers(["vllm", "llamacpp"], config="c.yaml", overrides=(), gguf="m.gguf",
                          traces=None, sweep=LoadSweep(), count_tokens=len, logs=tmp_path / "logs",
                          log=lambda m: None, setup=False)
    assert servers == {
        "vllm": {"status": f"skipped: vLLM is not installed ({tmp_path}/peers/vllm-cpu has no "
                           "finished set-up)"},
        "llamacpp": {"status": f"skipped: llama-server is not built ({tmp_path}/peers/llama-server/"
                               "build/bin/llama-server missing)"}}
    monkeypatch.setattr(serve_peers.shutil, "which", lambda name: None)
    with pytest.raises(serve_peers.PeerUnavailable,
                       match="^building llama-server needs cmake and c\\+\\+ on PATH$"):
        serve_peers.llama_server_binary(setup=True)
    assert not pathlib.Path(tmp_path, "peers").exists()
    assert peer_names("all") == ["jaxinfer", "vllm", "llamacpp"]
    assert peer_names("none") == ["jaxinfer"]
    with pytest.raises(ValueError, match="compares with vllm, llamacpp"):
        peer_names("hf")


def test_server_commands(monkeypatch, tmp_path):
    from jaxinfer_tools.bench import serve_peers

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    exe = tmp_path / "peers" / "llama-server" / "build" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    serve_peers._record(exe.parents[2], 1.0, ["cmake -S src -B build " + " ".join(serve_peers.llama_cmake_flags())])
    cmd, env = serve_peers.server_command("llamacpp", 8000, config="c.yaml", overrides=(),
                                          gguf="m.gguf", max_seq_len=2560, max_num_seqs=16, threads=2)
    assert cmd == [str(exe), "-m", "m.gguf", "--alias", "bench-model", "--host", "127.0.0.1",
                   "--port", "8000", "-np", "16", "-c", "40960", "-t", "2", "-tb", "2"]
    assert env == {}
    cmd, env = serve_peers.server_command("jaxinfer", 8001, config="c.yaml", overrides=("decode_chunk=4",),
                                          gguf="m.gguf", max_seq_len=1024, max_num_seqs=8, threads=2)
    assert cmd[-4:] == ["max_num_seqs=8", "decode_chunk=8", "max_seq_len=1024", "decode_chunk=4"]


def test_llama_cpp_flags_follow_the_cpu_and_a_build_for_other_flags_is_not_used(monkeypatch, tmp_path):
    from jaxinfer_tools.bench import serve_peers

    avx2 = serve_peers.llama_cmake_flags({"avx", "avx2", "fma", "f16c", "sse4_2"})
    assert avx2 == ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                    "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                    "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DLLAMA_CURL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release")
    avx512 = serve_peers.llama_cmake_flags({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni"})
    assert "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512_VNNI=ON" in avx512
    assert "-DGGML_AVX512_BF16=OFF" in avx512 and "-DGGML_AVX512_VBMI=OFF" in avx512
    # /proc/cpuinfo's spellings: avx512vbmi (no underscore), avx512_vnni, avx512_bf16
    full = serve_peers.llama_cmake_flags({"avx", "avx2", "fma", "f16c", "avx512f", "avx512vbmi",
                                          "avx512_vnni", "avx512_bf16"})
    assert all(f"-DGGML_{n}=ON" in full for n in ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"))
    # a binary whose recorded build used other flags (the cache shared with another CPU)
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    other = avx512 if serve_peers.llama_cmake_flags() != avx512 else avx2
    exe = tmp_path / "peers" / "llama-server" / "build" / "bin" / "llama-server"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    serve_peers._record(exe.parents[2], 1.0, ["cmake -S src -B build " + " ".join(other)])
    with pytest.raises(serve_peers.PeerUnavailable, match="built for another CPU's flags"):
        serve_peers.llama_server_binary(setup=False)
    serve_peers._record(exe.parents[2], 1.0, ["cmake -S src -B build " + " ".join(serve_peers.llama_cmake_flags())])
    assert serve_peers.llama_server_binary(setup=False) == exe


def test_compilation_cache_dir_from_the_environment(monkeypatch, tmp_path):
    import jax

    from jaxinfer.serving.loading import XLA_CACHE_ENV, enable_compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    monkeypatch.setenv(XLA_CACHE_ENV, str(tmp_path / "xla"))
    try:
        assert enable_compilation_cache() == str(tmp_path / "xla")
        assert (tmp_path / "xla").is_dir()
        assert enable_compilation_cache(str(tmp_path / "given")) == str(tmp_path / "given")
    finally:
        for n, v in before.items():
            jax.config.update(n, v)


def test_serve_load_harness_against_a_fake_server(tmp_path):
    """Every workload, the targets and the report through a stand-in
    server (tests/fake_openai_server.py): nothing is timed or compared."""
    import dataclasses
    import pathlib
    import sys

    from jaxinfer_tools.bench.serve_compare import (LoadSweep, _Runner, free_port, make_traces,
                                                    start_server)
    from jaxinfer_tools.bench.serve_report import format_load, plot_load, serve_targets

    sweep = LoadSweep(rates=(50.0,), num_requests=4, prompt_len=(4, 8), output_len=(2, 4),
                      warmup_requests=2, short_requests=4, short_concurrency=2, short_prompt_len=(2, 4),
                      long_prompt_tokens=16, long_output_tokens=2, long_prompts=2, long_every_s=0.05,
                      long_streams=2, long_chat_tokens=4, max_seq_len=64, start_timeout_s=60.0,
                      request_timeout_s=30.0, run_timeout_s=60.0)
    traces = make_traces(_WordTokenizer(), sweep)
    count = lambda text: len(text.split())  # noqa: E731
    script = pathlib.Path(__file__).parents[1] / "fake_openai_server.py"
    cmd = [sys.executable, str(script), "--port", str(free_port())]
    runner = _Runner("fake", traces, sweep, count, lambda m: None)
    out = start_server("fake", cmd, {}, sweep, count, tmp_path / "fake.log", runner)
    assert out["status"] == "ok"
    assert (out["start"]["ok"], out["start"]["text_tokens"], out["start"]["chunks"]) == (True, 8, 8)
    assert out["start"]["first_request_s"] > out["start"]["healthy_s"] > 0
    assert out["warmup"]["failed"] == 0
    run = out["rates"]["50"]
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["output_tokens"] == sum(traces.rates[0].output_tokens)
    assert run["tokens_per_chunk"]["max"] == 1
    assert (out["short"]["completed"], out["short"]["output_tokens"]) == (4, 4 * sweep.short_tokens)
    long = out["long_prompts"]
    assert (long["long_completed"], long["long_failed"], long["chat_failed"]) == (2, 0, 0)
    assert long["chat_completed"] >= 2 and long["gap_ratio"] >= 1.0
    held = out["after_workloads"]
    assert held["pids"] == 1 and held["maps"] > 0 and held["fds"] >= 3 and held["rss_mib"] > 0
    results = {"servers": {"jaxinfer": out, "vllm": out, "llamacpp": {"status": "skipped: why"}},
               "sweep": dataclasses.asdict(sweep), "targets": serve_targets({"jaxinfer": out, "vllm": out},
                                                                            sweep)}
    assert [r["value"] for r in results["targets"][2:4]] == [1.0, 1.0]
    report = format_load(results)
    assert "| jaxinfer | 50 | " in report and "| llamacpp | skipped: why |" in report
    assert f"| vllm | 1 | {held['maps']} | {held['rss_mib']:.0f} | {held['fds']} | - |" in report
    assert plot_load(results, str(tmp_path / "p.png")) == str(tmp_path / "p.png")


def test_process_footprint_sums_the_process_tree():
    import os
    import subprocess
    import sys
    import time

    from jaxinfer_tools.bench.serve_workloads import process_footprint

    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    alone = process_footprint(os.getpid())
    assert alone["pids"] == 1 and alone["fds"] >= 3 and abs(alone["maps"] - maps) <= 8
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while process_footprint(os.getpid())["pids"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        both = process_footprint(os.getpid())
        assert both["pids"] == 2 and both["maps"] > alone["maps"] and both["rss_mib"] > alone["rss_mib"]
    finally:
        child.kill()
        child.wait()
    assert process_footprint(child.pid) == {}


# --- the serving step driven by the benches (tools.bench.steps) ----------------------------


def test_pack_prompts_fills_each_step_first_come_first_served():
    from jaxinfer_tools.bench.steps import pack_prompts

    assert pack_prompts([300, 300], 512) == [[(0, 0, 300), (1, 0, 212)], [(1, 212, 300)]]
    assert pack_prompts([512], 512) == [[(0, 0, 512)]]
    assert pack_prompts([5, 5, 5], 4) == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 5), (2, 0, 2)],
                                          [(2, 2, 5)]]
    assert pack_prompts([], 4) == []
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        pack_prompts([3], 0)


def test_slot_tables_split_the_pool_in_shuffled_pages():
    from types import SimpleNamespace

    from jaxinfer_tools.bench.steps import slot_tables

    # P = 7 pages over S = 3 slots: 7 // 3 = 2 pages each (page 1 unused), then 7 ("no page")
    tables = slot_tables(SimpleNamespace(max_num_seqs=3, pages_per_seq=4, num_pages=7), seed=0)
    assert tables.dtype == np.int32
    assert tables.tolist() == [[2, 4, 7, 7], [3, 6, 7, 7], [5, 0, 7, 7]]
    # a pool larger than the tables: min(M, P // S) = 3 pages each
    tables = slot_tables(SimpleNamespace(max_num_seqs=2, pages_per_seq=3, num_pages=10), seed=0)
    assert tables.tolist() == [[4, 6, 2], [7, 3, 5]]


@pytest.mark.slow
def test_filled_slots_decode_the_prompts_greedy_continuation():
    """`fill_slots` prefills one prompt and copies its pages into every slot:
    each slot then decodes what the dense phases decode after that prompt."""
    import jax.numpy as jnp

    from jaxinfer.cache.kv import init_cache
    from jaxinfer.engine import phases
    from jaxinfer_tools.bench import steps
    from jaxinfer.weights.prepare import prepare_params
    from tiny import TINY_LLAMA, random_params

    params = prepare_params(random_params(TINY_LLAMA), TINY_LLAMA)
    runner = steps.new_runner(TINY_LLAMA, params, slots=3, max_seq_len=64, pool_tokens=40)
    tables = steps.slot_tables(runner)
    prompt = steps.fill_slots(runner, tables, 20)
    assert len(prompt) == 20 and np.asarray(runner.cache.lengths).tolist() == [20, 20, 20]
    out = runner.fetch(runner.decode([0, 1, 2], tables, 3))
    cache = init_cache(TINY_LLAMA, 1, 64)
    logits, cache = phases.prefill(params, cache, jnp.asarray([prompt]), jnp.array([20]),
                                   config=TINY_LLAMA)
    token, want = jnp.zeros((1,), jnp.int32), []        # the admitted rows' last token is 0
    for _ in range(3):
        logits, cache = phases.decode_step(params, cache, token, config=TINY_LLAMA)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        want.append(int(token[0]))
    assert out.token[:, :3, 0].T.tolist() == [want] * 3
    steps.reset_slots(runner, prompt)
    assert np.asarray(runner.cache.lengths).tolist() == [20, 20, 20]


def test_target_row_judges_each_comparison():
    from jaxinfer_tools.bench.report import target_row, targets_table

    assert target_row("a", 0.5, ">=", 0.5) == {"name": "a", "value": 0.5, "op": ">=", "goal": 0.5,
                                               "result": "PASS"}
    assert target_row("b", 1.25, "<=", 1.1)["result"] == "FAIL"
    assert target_row("c", 0.15, "<=", 0.2)["result"] == "PASS"
    assert target_row("d", None, ">=", 2.0)["result"] == "not measured"
    assert target_row("e", 1.0, "<", 2.0)["result"] == "PASS"
    with pytest.raises(ValueError, match="op must be one of '>=', '>', '<=', '<', got '=<'"):
        target_row("f", 1.0, "=<", 2.0)
    assert targets_table([target_row("b", 1.25, "<=", 1.1), target_row("d", None, ">=", 2.0)]) == [
        "", "| target | measured | goal | result |", "|---|---|---|---|",
        "| b | 1.25 | <= 1.1 | FAIL |", "| d | - | >= 2 | not measured |"]


# --- jaxinfer bench --paged ---------------------------------------------------------------


def _paged_results():
    step = {"batch": 32, "context": 512, "capacity": 1024, "page_size": 16,
            "paged_times_s": [0.2, 0.22], "dense_times_s": [0.16, 0.2], "paged_step_s": 0.21,
            "dense_step_s": 0.18, "paged_over_dense": 0.21 / 0.18, "loadavg": [1.0, 1.0, 1.0]}
    loop = {"batch": 32, "context": 519.5, "steps": 16, "tpot_s": 0.2, "achieved_gflops": 45.0,
            "compute_fraction": 0.45, "memory_fraction": 0.3}
    prefix = {"prefix_len": 1000, "suffix_len": 24, "repeats": 3, "page_size": 16,
              "prefix_caching": True, "miss_ttft_s": 2.0, "hit_ttft_s": 0.25, "hit_over_miss": 0.125,
              "hit_cached_tokens": [992, 992, 992]}
    machine = {"peak_gflops": 100.0, "peak_source": "torch_square_2048", "bandwidth_gbps": 10.0}
    return {"step": step, "loop": loop, "prefix": prefix, "machine": machine}


def test_paged_targets_from_hand_made_figures():
    from jaxinfer_tools.bench import paged

    results = _paged_results()
    got = paged.targets(results)
    assert [(t["name"], t["op"], t["goal"], t["result"]) for t in got] == [
        ("paged decode step / dense, batch 32, context 512", "<=", 1.1, "FAIL"),
        ("decode step at batch 32: fraction of the best-of FLOP/s peak", ">=", 0.5, "FAIL"),
        ("TTFT cached 1,000-token prefix / miss, LLM.generate twice", "<=", 0.2, "PASS")]
    assert [t["value"] for t in got] == [0.21 / 0.18, 0.45, 0.125]
    results["targets"] = got
    report = paged.format_paged(results)
    for line in ("decode step, batch 32, context 512, capacity 1024 (page size 16), median of 2: "
                 "paged (serving step) 210.00 ms, dense (`phases.decode_step`) 180.00 ms (1.17x); "
                 "load [1.0, 1.0, 1.0]",
                 "decode loop, 16 steps per dispatch, batch 32, mean context 519.5: 200.00 ms per "
                 "step, 45.0 GFLOP/s = 45% of the peak 100.0 GFLOP/s (torch_square_2048), 30% of "
                 "10.0 GB/s",
                 "TTFT through `LLM.generate`, 1000-token prefix + 24 tokens, median of 3 (page "
                 "size 16, prefix caching on): miss 2.000 s, hit 0.250 s (0.125); prompt tokens the "
                 "hits served from the cache [992, 992, 992]",
                 "| TTFT cached 1,000-token prefix / miss, LLM.generate twice | 0.125 | <= 0.2 | PASS |"):
        assert line in report.splitlines(), line


@pytest.mark.slow
def test_paged_sweep_takes_the_config_s_page_size():
    import dataclasses

    from jaxinfer.config import GenerationConfig
    from jaxinfer_tools.bench import paged

    cfg = GenerationConfig(model="smollm2-135m-instruct")
    assert paged.for_config(paged.PagedSweep(), cfg).page_size == cfg.page_size == 16
    sweep = paged.for_config(paged.QUICK_PAGED, dataclasses.replace(cfg, page_size=32))
    assert (sweep.page_size, sweep.step_repeats) == (32, paged.QUICK_PAGED.step_repeats)


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_paged_measurements_on_a_tiny_model():
    """The --paged sweep's three measurements end to end on a tiny random
    model (no machine probe): shapes of the figures and the prefix-cache hits."""
    from jaxinfer_tools import roofline
    from jaxinfer.serving.llm import LLM
    from jaxinfer_tools.bench import paged
    from tiny import TINY_LLAMA, random_params

    llm = LLM(TINY_LLAMA, random_params(TINY_LLAMA), max_seq_len=128)
    sweep = paged.PagedSweep(step_batch=2, step_context=20, step_capacity=64, step_repeats=1,
                             decode_chunk=2, loop_repeats=1, prefix_len=40, suffix_len=8,
                             prefix_output=2, prefix_repeats=1)
    quiet = lambda msg: None
    step, slots = paged.step_cost(llm, sweep, quiet)
    assert (step["batch"], step["context"], step["capacity"]) == (2, 20, 64)
    assert len(step["paged_times_s"]) == len(step["dense_times_s"]) == 1
    assert step["paged_over_dense"] == step["paged_step_s"] / step["dense_step_s"]
    loop = paged.loop_cost(llm, sweep, slots, {"peak_gflops": 1.0, "bandwidth_gbps": 1.0}, quiet)
    assert (loop["batch"], loop["steps"], loop["context"]) == (2, 2, 20.5)
    assert loop["flops"] == roofline.decode_cost(TINY_LLAMA, 2, 20.5).flops
    assert loop["compute_fraction"] == loop["flops"] / loop["tpot_s"] / 1e9
    pre = paged.prefix_ttft(llm, sweep, quiet)
    assert pre["hit_cached_tokens"] == [32]     # the 40-token prefix's 2 full pages of 16
    assert pre["hit_over_miss"] == pre["hit_ttft_s"] / pre["miss_ttft_s"] and pre["miss_ttft_s"] > 0


# --- jaxinfer bench --serving and --speculative -------------------------------------------


def test_serving_targets_from_hand_made_runs():
    from jaxinfer_tools.bench.serving import QUICK_SERVING, ServingSweep, serving_targets

    runs = {"continuous_saturation": {"request_throughput": 0.5, "output_tokens_per_s": 60.0},
            "static_saturation": {"request_throughput": 0.2},
            "mixed_chunked_off": {"chat": {"itl_s": {"p50": 0.1, "p99": 0.5}}},
            "mixed_chunked_256": {"chat": {"itl_s": {"p50": 0.1, "p99": 0.25}}}}
    got = serving_targets(runs, ServingSweep())
    assert [(t["name"], t["value"], t["op"], t["goal"], t["result"]) for t in got] == [
        ("continuous / static request throughput at saturation, outputs 16-1,024 tokens", 2.5,
         ">=", 2.0, "PASS"),
        ("continuous / transformers continuous batching, output tokens/s", None, ">=", 2.0,
         "not measured"),
        ("mixed_chunked_off: chat p99 / p50 inter-token latency", 5.0, "<=", 3.0, "FAIL"),
        ("mixed_chunked_256: chat p99 / p50 inter-token latency", 2.5, "<=", 3.0, "PASS"),
        ("mixed_chunked_512: chat p99 / p50 inter-token latency", None, "<=", 3.0, "not measured")]
    assert serving_targets({}, QUICK_SERVING)[0]["name"] == (
        "continuous / static request throughput at saturation, outputs 16-128 tokens")
