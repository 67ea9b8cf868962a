"""The two-layer toy model and `jaxinfer trace` (CPU, seconds).

Training runs the engine's own prefill under jax.grad; the trace's numbers
are checked against independent engine calls made here.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.engine import phases as engine
from jaxinfer.cache.kv import init_cache
from jaxinfer.weights.prepare import prepare_params
from jaxinfer_tools import toy
from jaxinfer_tools.trace import run as trace

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOY_YAML = ROOT / "configs" / "toy-two-layer.yaml"
GEN_YAML = ROOT / "configs" / "smollm2-135m-instruct.yaml"


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and
            all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                for x, y in zip(la, lb)))


@pytest.fixture(scope="module")
def trained(toy_trained):          # conftest: trained once per session
    return toy_trained


@pytest.fixture(scope="module")
def folder(toy_folder):
    return toy_folder


@pytest.fixture(scope="module")
def yaml_for_folder(folder, tmp_path_factory):
    """The shipped toy YAML with `model:` pointing at the test's folder."""
    text = TOY_YAML.read_text(encoding="utf-8").replace(
        "model: toy-two-layer", f"model: {folder}")
    path = tmp_path_factory.mktemp("cfg") / "toy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loaded(folder):
    return toy.load_folder(folder)


@pytest.fixture(scope="module")
def traced(loaded):
    config, params, tok = loaded
    return trace.run_trace(config, params, tok.encode("你好"), steps=2,
                           stop_ids=tuple(tok.eos_token_ids))


# --- config ------------------------------------------------------------------------------


def test_toy_yaml_is_the_walkthrough_model(toy_config):
    c = toy_config.model_config(len(toy.build_vocab()))
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 1, 1, 4)
    assert toy.EOS in toy.build_vocab() and "你好世界" in toy.CORPUS


def test_toy_yaml_unknown_key_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TOY_YAML.read_text(encoding="utf-8") + "hidden_sise: 8\n", encoding="utf-8")
    with pytest.raises(ValueError, match="hidden_sise"):
        toy.ToyConfig.load(bad)
    with pytest.raises(ValueError, match="hidden_sise"):
        trace.load_trace_config(bad)


def test_trace_detects_the_kind_of_config(tmp_path):
    assert trace.load_trace_config(TOY_YAML)[0] == "toy"
    kind, cfg = trace.load_trace_config(GEN_YAML)
    assert kind == "generation" and cfg.model == "smollm2-135m-instruct"
    odd = tmp_path / "odd.yaml"
    odd.write_text("kind: llama\n")
    with pytest.raises(ValueError, match="unknown kind"):
        trace.load_trace_config(odd)


def test_relative_model_folder_is_under_the_cache_dir(toy_config, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    assert toy.model_dir(toy_config) == tmp_path / "toy-two-layer"
    assert toy.model_dir(toy_config, "out/x") == pathlib.Path("out/x")


# --- training and the saved folder -----------------------------------------------------------


def test_training_is_deterministic_and_reaches_the_target(toy_config, trained):
    again = toy.train(toy_config)
    assert _leaves_equal(trained.params, again.params)
    assert trained.losses == again.losses
    assert trained.continuation == "世界" and trained.reached_target
    assert trained.losses[-1] < 0.05 < trained.losses[0]


def test_saved_folder_reloads_bit_identically(trained, folder, loaded):
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     toy.TRAINING_FILE]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2
    assert cfg["hidden_size"] == 4 and cfg["num_attention_heads"] == 1 and cfg["eos_token_id"] == 0
    config, params, tok = loaded                          # the normal loader
    assert config == trained.config and _leaves_equal(params, trained.params)
    assert tok.encode("你好") == [2, 3] and tok.eos_token_ids == frozenset({0})
    assert tok.decode([2, 3, 4, 5, 0]) == "你好世界"


def test_hf_tensor_layout_round_trips(trained):
    from jaxinfer.checkpoint.convert import params_from_hf_tensors

    tensors = toy.params_to_hf_tensors(trained.params, trained.config)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4, 4)      # [out, in]
    assert tensors["model.layers.0.mlp.gate_proj.weight"].shape == (16, 4)
    assert tensors["lm_head.weight"].shape == (trained.config.vocab_size, 4)
    back = params_from_hf_tensors(tensors.__getitem__, tensors.keys(), trained.config)
    assert _leaves_equal(back, trained.params)


def test_llm_load_generates_the_target(folder):
    from jaxinfer.serving.llm import LLM
    from jaxinfer.sampling import SamplingParams

    llm = LLM.load(str(folder), max_seq_len=16)
    [c] = llm.generate(["你好"], SamplingParams(temperature=0.0), max_new_tokens=4)
    assert c.text == "世界" and c.finish_reason == "stop"


def test_transformers_reads_the_folder_with_the_same_logits(folder, loaded):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder))
    ids = [[2, 3, 4, 5]]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    config, params, _ = loaded
    params = prepare_params(params, config, pack=False)
    logits, _ = engine.prefill(params, init_cache(config, 1, 4), jnp.asarray(ids, jnp.int32),
                               jnp.array([4], jnp.int32), config=config, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)


# --- the trace's numbers --------------------------------------------------------------------


def _layer0_scores(params, config, ids):
    """Layer 0's [t, t] scores and causal softmax weights for `ids`, in plain
    float64 numpy from the loaded params (independent of jaxinfer's code):
    RMSNorm, q/k projections, rotate-half RoPE, q scaled by H ** -0.5."""
    x = np.asarray(params["embed_tokens"], np.float64)[ids]
    lay = {k: np.asarray(v[0], np.float64) for k, v in params["layers"].items()}
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * lay["input_layernorm"]
    q, k = np.einsum("td,dnh->tnh", h, lay["q_proj"])[:, 0], np.einsum("td,dkh->tkh", h, lay["k_proj"])[:, 0]
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-np.arange(half) * 2.0 / config.head_dim)
    ang = np.arange(len(ids))[:, None] * freqs[None]
    rot = lambda a: np.concatenate([a[:, :half] * np.cos(ang) - a[:, half:] * np.sin(ang),
                                    a[:, half:] * np.cos(ang) + a[:, :half] * np.sin(ang)], -1)
    scores = rot(q) @ rot(k).T * config.head_dim ** -0.5
    masked = np.where(np.tril(np.ones_like(scores, bool)), scores, -np.inf)
    weights = np.exp(masked - masked.max(-1, keepdims=True))
    return scores, weights / weights.sum(-1, keepdims=True)


def test_trace_prefill_numbers_are_the_models(loaded, traced):
    config, params, _ = loaded
    scores, weights = _layer0_scores(params, config, [2, 3])
    prefill = traced.phases[0]
    assert prefill.name == "prefill" and prefill.token_ids == [2, 3]
    lt = prefill.layers[0]
    np.testing.assert_allclose(lt.scores[0], scores, atol=1e-5, rtol=0)    # [2, 2]
    np.testing.assert_allclose(lt.weights[0], weights, atol=1e-6, rtol=0)
    for lt in prefill.layers:
        np.testing.assert_array_equal(lt.mask, [[True, False], [True, True]])
        assert lt.weights[0, 0, 1] == 0.0 and lt.weights[0, 0, 0] == 1.0
    ref = reference.forward(params, [2, 3], config)[-1]                  # float64, no cache
    np.testing.assert_allclose(prefill.logits, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(prefill.logits, prefill.engine_logits, atol=1e-4, rtol=0)


def test_decode_rows_equal_the_last_row_of_a_full_recompute(loaded, traced):
    config, params, _ = loaded
    assert traced.generated == [4, 5, 0] and traced.stopped        # 世, 界, <|endoftext|>
    for phase in traced.phases[1:]:
        seq = traced.prompt_ids + [p.token_ids[0] for p in traced.phases[1:phase.index + 1]]
        t = len(seq)
        full = trace.run_trace(config, params, seq, steps=0).phases[0]   # fresh cache, [t, t]
        scores, weights = _layer0_scores(params, config, seq)
        np.testing.assert_allclose(phase.layers[0].scores[0, 0], scores[-1], atol=1e-5, rtol=0)
        np.testing.assert_allclose(phase.layers[0].weights[0, 0], weights[-1], atol=1e-6, rtol=0)
        for lt, ft in zip(phase.layers, full.layers):
            assert lt.scores.shape == (1, 1, t) and list(lt.key_pos) == list(range(t))
            np.testing.assert_allclose(lt.scores[0, 0], ft.scores[0, -1], atol=1e-6, rtol=0)
            np.testing.assert_allclose(lt.weights[0, 0], ft.weights[0, -1], atol=1e-6, rtol=0)
        ref = reference.forward(params, seq, config)[-1]
        np.testing.assert_allclose(phase.logits, ref, atol=1e-4, rtol=0)
    assert traced.ok


def test_chunked_prefill_rows_equal_the_whole_prefill(loaded, traced):
    """你好 prefilled as two chunks of one token: a [1, 1] then a [1, 2] score
    row (the second against the cached key of the first), equal to the rows
    of the [2, 2] prefill; then the same decode."""
    config, params, tok = loaded
    chunked = trace.run_trace(config, params, tok.encode("你好"), steps=2,
                              stop_ids=tuple(tok.eos_token_ids), prefill_chunk=1)
    first, second = chunked.phases[:2]
    assert [first.name, second.name] == ["prefill chunk 1", "prefill chunk 2"]
    whole = traced.phases[0]
    for a, b, w in zip(first.layers, second.layers, whole.layers):
        assert a.scores.shape == (1, 1, 1) and b.scores.shape == (1, 1, 2)
        assert list(b.key_pos) == [0, 1] and b.mask.tolist() == [[True, True]]
        np.testing.assert_allclose(a.scores[0, 0], w.scores[0, 0, :1], atol=1e-6, rtol=0)
        np.testing.assert_allclose(b.scores[0, 0], w.scores[0, 1], atol=1e-6, rtol=0)
        np.testing.assert_allclose(b.weights[0, 0], w.weights[0, 1], atol=1e-6, rtol=0)
    assert first.chosen is None and second.chosen == whole.chosen == 4
    assert chunked.generated == traced.generated and chunked.ok


def test_masked_weights_are_exactly_zero(traced):
    for phase in traced.phases:
        for lt in phase.layers:
            assert lt.masked_weight_max == 0.0
            assert np.all(lt.weights[:, ~lt.mask] == 0.0)


def test_each_layer_cache_holds_exactly_the_positions_written(traced):
    written = {}                                                   # layer -> [K per position]
    for phase in traced.phases:
        for lt in phase.layers:
            written.setdefault(lt.layer, []).extend(lt.k)
            length = phase.length_after
            assert length == len(written[lt.layer]) == phase.positions[-1] + 1
            # the engine's K (its own attention upstream) vs the traced K (the tracer's)
            np.testing.assert_allclose(lt.cache_k[:length], np.stack(written[lt.layer]), atol=1e-6,
                                       rtol=0)
            assert not lt.cache_k[length:].any() and not lt.cache_v[length:].any()
            assert list(lt.cache_pos[:length]) == list(range(length))
            assert lt.changed_slots == tuple(phase.positions)


def test_verification_step_block_acceptance_and_rollback(loaded, traced):
    """你好, then 世 with the drafts 界 大 verified in one call: a [3, 5] score
    block whose mask is causal inside the block, 界 accepted (the target's
    argmax after 世), 大 rejected (<|endoftext|> comes instead), cache.lengths
    5 -> rolled back to 4; the rows equal the whole prefill's; the tokens equal
    plain greedy decoding."""
    config, params, tok = loaded
    spec = trace.run_trace(config, params, tok.encode("你好"), steps=2,
                           stop_ids=tuple(tok.eos_token_ids), drafts=tok.encode("界大"))
    verify = spec.phases[1]
    assert verify.name == "verification step 1" and verify.positions == [2, 3, 4]
    assert verify.token_ids == [4, 5, tok.encode("大")[0]]
    v = verify.verify
    assert (v.accepted, v.emitted, v.length_written, v.length_kept) == (1, [5, 0], 5, 4)
    for lt in verify.layers:
        assert lt.scores.shape == (1, 3, 5) and list(lt.key_pos) == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(lt.mask, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
        np.testing.assert_allclose(lt.weights[0], lt.recompute.weights[0, 2:], atol=1e-6, rtol=0)
    assert int(np.asarray(spec.phases[1].length_after)) == 4
    assert spec.generated == traced.generated and spec.stopped and spec.ok


# --- CLI ------------------------------------------------------------------------------------------


def test_trace_cli_prints_the_walkthrough(yaml_for_folder, traced, capsys):
    rc = trace.trace_main(str(yaml_for_folder), prompt="你好", steps=2)
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert "=== PREFILL: 2 tokens in parallel at positions 0, 1 (engine.prefill) ===" in lines
    assert "  scores = q.k [2, 2], causal (k<pos>: 0 '你', 1 '好')" in lines
    assert "    q0            0     -inf" in lines                      # the mask added
    assert "    q0       1.0000   0.0000" in lines                      # first row of the weights
    assert "  -> greedy next token: '世' (id 4)" in lines
    assert "=== DECODE step 1: feed '世' (id 4) at position 2 (engine.decode_step) ===" in lines
    assert "  weights = softmax(scores + mask) [1, 3]" in lines
    row = traced.phases[1].layers[0].weights[0, 0]
    assert "    q2    " + "".join(f"{w:9.4f}" for w in row) in lines   # the decode row's values
    assert "  -> greedy next token: '界' (id 5)" in lines
    assert any(line.startswith("  [OK] row of the scores == the same rows of a full [3, 3] recompute")
               for line in lines)
    assert any(line.startswith("  [OK] traced logits == engine.decode_step logits") for line in lines)
    assert "  layer 1 cache after the write (cache.layers[1], positions 0..2 of 4 slots):" in lines
    assert "    slot(s) 3: empty (all zeros)" in lines
    assert "continuation: '世界', then '<|endoftext|>' (stop)   (generated ids [4, 5, 0])" in lines
    assert lines[-1].startswith("all ") and lines[-1].endswith(" checks passed")
    assert "FAIL" not in out


def test_trace_trains_a_missing_model_first(tmp_path, capsys):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(TOY_YAML.read_text(encoding="utf-8").replace(
        "model: toy-two-layer", f"model: {tmp_path / 'fresh'}"), encoding="utf-8")
    assert trace.trace_main(str(cfg), prompt="你好", steps=2) == 0
    out = capsys.readouterr().out
    assert "does not exist yet: training it first" in out
    assert "greedy '你好' -> '世界'" in out and toy.is_model_folder(tmp_path / "fresh")
    assert "continuation: '世界'" in out


def test_cli_parsers_register_both_subcommands(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="jaxinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    toy.add_train_toy_parser(sub)
    trace.add_trace_parser(sub)
    args = parser.parse_args(["train-toy", "--config", str(TOY_YAML), "--out", str(tmp_path / "m")])
    assert args.func(args) == 0 and toy.is_model_folder(tmp_path / "m")
    args = parser.parse_args(["trace", "--config", str(TOY_YAML), "--model", str(tmp_path / "m"),
                              "--prompt", "我爱", "--steps", "2", "--brief"])
    assert args.detail is False and args.func(args) == 0
    out = capsys.readouterr().out
    assert "continuation: '世界', then '<|endoftext|>'" in out and "layer  1 full:" in out


def test_plot_writes_heatmaps_and_cache_diagram(traced, loaded, tmp_path):
    _, _, tok = loaded
    paths = trace.plot_trace(traced, tmp_path, lambda i: tok.decode([i], skip_special_tokens=False))
    assert [p.name for p in paths] == ["attention_prefill.png", "attention_decode_1.png",
                                       "attention_decode_2.png", "cache.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@pytest.mark.slow
def test_trace_real_model_brief(capsys):
    from jaxinfer.checkpoint.sources import cached_path

    if not cached_path("smollm2-135m-instruct").exists():
        pytest.skip("SmolLM2 GGUF not in the jaxinfer cache")
    rc = trace.trace_main(str(GEN_YAML), prompt="The capital of France is", steps=2)
    out = capsys.readouterr().out
    assert rc == 0 and "' Paris'" in out and "layer 29 full:" in out
