"""`jaxinfer eval`'s pieces on hand-made inputs and a tiny random model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer_tools import roofline as metrics
from jaxinfer.weights.prepare import prepare_params
from jaxinfer_tools.eval import accuracy
from jaxinfer_tools.eval.run import TEXT, format_report
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params


def test_text_chunks_with_and_without_bos():
    ids = list(range(10, 21))  # 11 tokens
    plain = accuracy.text_chunks(ids, 4, None)
    assert [c.tolist() for c in plain] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20]]
    with_bos = accuracy.text_chunks([1] + ids, 4, 1)  # the text's own BOS is not repeated
    assert [c.tolist() for c in with_bos] == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18],
                                              [1, 19, 20]]
    assert [c.tolist() for c in accuracy.text_chunks(ids[:5], 4, None)] == [[10, 11, 12, 13]]  # [14]: nothing to score
    with pytest.raises(ValueError, match="chunk must be >= 2 tokens, got 1"):
        accuracy.text_chunks(ids, 1, None)


def test_matching_prefix_counts_tokens_before_the_first_difference():
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    other = np.array([[1, 2, 3, 4], [1, 9, 3, 4], [0, 2, 3, 4]])
    np.testing.assert_array_equal(accuracy.matching_prefix(ref, other), [4, 1, 0])


def test_text_prompts_are_even_windows():
    ids = list(range(100))
    p = accuracy.text_prompts(ids, 3, 10, None)
    assert p.tolist() == [list(range(0, 10)), list(range(45, 55)), list(range(90, 100))]
    q = accuracy.text_prompts([7] + ids, 2, 10, 7)
    assert q[:, 0].tolist() == [7, 7] and q[1, 1:].tolist() == list(range(91, 100))
    with pytest.raises(ValueError, match="the text has 5 tokens, fewer than one prompt of 10"):
        accuracy.text_prompts(ids[:5], 2, 10, None)


def test_the_shipped_text_is_long_enough():
    words = TEXT.read_text().split()
    assert words[:5] == ["Chapter", "1", "It", "is", "a"] and len(words) > 1500


def test_score_of_identical_models_is_zero_kl():
    logp = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(0).standard_normal((5, 7))), -1)
    tokens = jnp.array([0, 3, 1, 6, 2, 5])
    nll_ref, nll, kl = accuracy.score(logp, logp, tokens)
    np.testing.assert_array_equal(np.asarray(nll_ref), np.asarray(nll))
    np.testing.assert_allclose(np.asarray(nll), -np.asarray(logp)[np.arange(5), [3, 1, 6, 2, 5]])
    assert np.all(np.abs(np.asarray(kl)) < 1e-6)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GEMMA3], ids=["llama", "gemma3"])
def test_teacher_forced_decode_equals_prefill(config):
    """The KV-cache path of the perplexity (one decode step per token) gives
    the prefill's distributions: the cached attention is the same function."""
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=2)), config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, 12), jnp.int32)
    full = accuracy.prefill_logprobs(params, tokens, config=config)
    stepped = accuracy.decode_logprobs(params, tokens, config=config)
    assert full.shape == stepped.shape == (11, config.vocab_size)
    np.testing.assert_allclose(np.asarray(stepped), np.asarray(full), atol=1e-4, rtol=0)


def test_greedy_agreement_of_a_model_with_itself_is_complete():
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config)), config)
    prompts = np.random.default_rng(3).integers(0, config.vocab_size, (4, 6)).astype(np.int32)
    out = accuracy.greedy_agreement(config, params, {"same": (params, "float32")}, prompts, 8)
    assert out["same"]["per_prompt"] == [8, 8, 8, 8] and out["same"]["all_match"] == 4


def test_format_report_lists_every_variant():
    result = {"model": "m", "text": "t", "text_tokens": 100, "chunks": 1, "chunk": 512,
              "prompts": 2, "prompt_len": 4, "new_tokens": 8, "timestamp": "now", "seconds": 1.0,
              "loadavg_end": [0.5], "llamacpp": {"skipped": "not installed"},
              "perplexity": {"reference": {"ppl": 10.0, "tokens": 99},
                             "q4": {"ppl": 10.1, "ppl_rel_change": 0.01, "kl_mean": 1e-3,
                                    "kl_max": 0.2, "tokens": 99}},
              "greedy": {"q4": {"mean": 6.5, "min": 5, "all_match": 1, "prompts": 2}}}
    report = format_report(result)
    assert "| q4 | 10.1000 | +1.00% | 1.00e-03 | 2.00e-01 | 6.5 / 5 | 1 / 2 |" in report
    assert "llama.cpp perplexity: skipped (not installed)" in report


def test_decode_step_bytes_by_hand():
    """TINY_LLAMA (L=3, D=32, K=2, H=8): weights 3 layers x (7,680 matmul +
    64 norm floats) + 32 final-norm floats = 23,264 floats; K/V of one
    position of one layer 2*K*H*4 = 128 bytes; a step at context 3 reads
    B*L*3 entries and writes B*L: B=2 -> 3,072 bytes of K/V, + B*D*4 = 256
    of embedding rows; int8 K/V: (1 + 4/H) / 4 of float32's."""
    from jaxinfer_tools.eval import speed

    params = random_params(TINY_LLAMA, seed=0)
    weights = metrics.stored_weight_bytes(params)
    assert weights == 23_264 * 4
    assert speed.decode_step_bytes(TINY_LLAMA, params, 2, 3) == weights + 256 + 3072
    assert speed.decode_step_bytes(TINY_LLAMA, params, 2, 3, 1 + 4 / 8) == weights + 256 + 1152
    assert speed.decode_step_bytes(TINY_LLAMA, params, 1, 3) == weights + 128 + 1536


def test_bench_roofline_counts_the_weights_as_stored():
    """`jaxinfer bench` (tools.bench.sweep.Cells) counts bfloat16 weights
    under float32 activations at their stored bytes, as the speed table does."""
    from jaxinfer_tools.bench.sweep import Cells
    from jaxinfer_tools.eval import speed

    raw = random_params(TINY_LLAMA, seed=0)
    f32 = Cells(TINY_LLAMA, prepare_params(raw, TINY_LLAMA), max_seq_len=32)
    bf16 = Cells(TINY_LLAMA, prepare_params(raw, TINY_LLAMA, weights="bfloat16"), max_seq_len=32)
    assert f32.dtype_bytes == bf16.dtype_bytes == 4     # float32 activations and KV cache in both
    for cells in (f32, bf16):
        cost = cells.cost(metrics.decode_cost(TINY_LLAMA, 2, 3, 4))
        assert cost.bytes == speed.decode_step_bytes(TINY_LLAMA, cells.params, 2, 3)
    assert metrics.stored_weight_bytes(bf16.params) < 0.6 * metrics.stored_weight_bytes(f32.params)


def test_speed_rows_run_the_serving_step():
    """The speed table's cells run the serving step on a tiny model (so a
    changed runner signature breaks this test, not the benchmark), with the
    int8 KV pool (its scales are copied into every slot too)."""
    from jaxinfer_tools.eval import speed

    config = TINY_LLAMA
    params = prepare_params(random_params(config, seed=0), config)
    [row] = speed.speed_rows(config, {"float32+kv8": params}, [2], 8, bandwidth_bps=1e9,
                             prompt_len=8, steps=4, chunk=2)
    assert row["config"] == "float32+kv8" and row["weight_bytes"] == metrics.stored_weight_bytes(params)
    [d] = row["decode"]
    assert d["batch"] == 2 and d["tpot_s"] > 0 and d["tokens_per_s"] == 2 / d["tpot_s"]
    assert d["context"] == 8 + 2 + (2 * 2 - 1) / 2          # after the warm-up loop, mean of 4 steps
    assert d["bytes_per_step"] == speed.decode_step_bytes(config, params, 2, d["context"], 1.5)
    assert d["memory_roofline_fraction"] == d["bytes_per_step"] / 1e9 / d["tpot_s"]
    assert row["prefill"]["prompt_len"] == 8 and row["prefill"]["ttft_s"] > 0


def test_llamacpp_worker_failures_say_why():
    """A worker killed by SIGILL (a llama-cpp-python built for another CPU)
    names the signal and the fix; other failures keep stderr's tail."""
    import signal
    from jaxinfer_tools.eval import speed

    assert speed._worker_result(0, 'log\n{"tpot_s": 0.5}\n', "") == {"tpot_s": 0.5}
    assert speed._worker_result(-int(signal.SIGILL), "", "") == {"skipped": (
        "the llama.cpp worker was killed by SIGILL (llama-cpp-python was built for instructions "
        "this CPU does not run; rebuild it with the flags in benchmarks/README.md)")}
    assert speed._worker_result(-int(signal.SIGKILL), "", "") == {
        "skipped": "the llama.cpp worker was killed by SIGKILL"}
    assert speed._worker_result(1, "", "Traceback\nValueError: bad gguf\n") == {
        "skipped": "Traceback\nValueError: bad gguf"}
    assert speed._worker_result(3, "", "") == {
        "skipped": "the llama.cpp worker exited 3 with no output"}


def test_speed_table_lists_both_llamacpp_peers_and_says_why_one_is_missing(tmp_path, monkeypatch):
    """`--llamacpp` rows: one per measured peer, with its TPOT and tokens/s;
    a peer that was not measured is a line saying why. llama-server is never
    built by the speed tool: not built means skipped."""
    from jaxinfer_tools.eval import speed

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    peer = speed.llama_server_speed("model.gguf", 100)
    assert peer == {"skipped": f"llama-server is not built ({tmp_path}/peers/llama-server/build/bin/"
                               f"llama-server missing)"}
    row = {"config": "q4", "weight_bytes": 96.6e6,
           "decode": [{"batch": 1, "tpot_s": 0.0062, "tokens_per_s": 161.3, "bytes_per_step": 104.7e6,
                       "memory_roofline_fraction": 0.47}]}
    table = speed.format_rows([row], {
        "llama-cpp-python": {"tpot_s": 0.0085, "tokens_per_s": 117.6, "prefill_ttft_s": 1.611},
        "llama-server": {"tpot_s": 0.0084, "tokens_per_s": 119.0}})
    assert table.splitlines()[2:] == [
        "| q4 | 96.6 | 1 | 6.20 | 161.3 | 104.7 | 47% |  |",
        "| llama-cpp-python (same file) | - | 1 | 8.50 | 117.6 | - | - | 1611 |",
        "| llama-server (same file) | - | 1 | 8.40 | 119.0 | - | - |  |"]
    assert speed.format_rows([row], {"llama-server": peer}).splitlines()[-1] == (
        f"llama-server: skipped ({peer['skipped']})")
