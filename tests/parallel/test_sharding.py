"""Tensor parallelism (`jaxinfer.parallel.sharding`): the sharding plan, the per-shard
layout of the fused projections, and tp = 1, 2, 3 against the single-device
run on forced CPU devices (in subprocesses: `multidevice.run_case`).

Tolerances: all-position prefill logits within 1e-5 * max(1, max|logit|)
of the single-device run on XLA's own kernels, i.e. float32 rounding: only
the summation order of the row-parallel products differs (the all-reduce
adds per-shard partial sums). The tiny random models' logits reach 26, so
an absolute 1e-5 would be a few ULPs; measured: up to 4.8e-5 at max|logit| 26
(TINY_LLAMA, tp = 2), 1.4e-5 at 6.7. Greedy and seeded sampled tokens identical. Real models
(slow): logits within the HF tolerances of test_hf_smollm2 / test_gemma3,
tokens identical to the single-device run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.parallel import sharding
from jaxinfer.config import ModelConfig
from jaxinfer.models.blocks import gated_mlp, project_qkv
from jaxinfer.weights.prepare import prepare_params
from multidevice import run_case
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

SMOLLM2_135M = ModelConfig(arch="llama", vocab_size=49152, num_layers=30, hidden_size=576,
                           num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
GEMMA3_270M_SHAPE = ModelConfig(arch="gemma3", vocab_size=262144, num_layers=18, hidden_size=640,
                                num_heads=4, num_kv_heads=1, head_dim=256, intermediate_size=2048)


# --- the plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("config,tp,heads,repeat,mlp,vocab", [
    (SMOLLM2_135M, 2, False, 1, True, True),      # N = 9: attention replicated, MLP split
    (SMOLLM2_135M, 3, True, 1, True, True),       # one KV head per shard
    (SMOLLM2_135M, 4, False, 1, True, True),      # K = 3 and tp = 4: neither divides the other
    (GEMMA3_270M_SHAPE, 2, True, 2, True, True),  # the one KV head stored twice
    (GEMMA3_270M_SHAPE, 4, True, 4, True, True),
    (GEMMA3_270M_SHAPE, 3, False, 1, False, False),
    (TINY_LLAMA, 2, True, 1, True, False),        # V = 97 is prime
])
def test_plan(config, tp, heads, repeat, mlp, vocab):
    plan = sharding.plan_sharding(config, tp)
    assert (plan.split_heads, plan.kv_repeat, plan.split_mlp, plan.split_vocab) == (heads, repeat, mlp, vocab)
    assert plan.model_config(config).num_kv_heads == config.num_kv_heads * repeat


def test_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp and dp must be >= 1"):
        sharding.plan_sharding(TINY_LLAMA, 0)
    with pytest.raises(ValueError, match="needs 8 devices"):
        sharding.make_mesh(4, 2, devices=jax.devices()[:1])


# --- the per-shard layout ---------------------------------------------------------------------


def _labelled_qkv(n, k, h=1):
    """A [1, (N + 2K) * H] row whose entries name their column: q heads
    100 + i, k heads 200 + i, v heads 300 + i (H = 1)."""
    cols = [100 + i for i in range(n)] + [200 + i for i in range(k)] + [300 + i for i in range(k)]
    return np.array([cols], np.float32)


def test_per_shard_qkv_by_hand():
    config = TINY_LLAMA.replace(num_heads=4, num_kv_heads=2, head_dim=1)
    got = sharding.per_shard_qkv(_labelled_qkv(4, 2), config, tp=2)
    np.testing.assert_array_equal(got[0], [[100, 101, 200, 300], [102, 103, 201, 301]])


def test_per_shard_qkv_repeats_a_single_kv_head():
    config = TINY_LLAMA.replace(num_heads=4, num_kv_heads=1, head_dim=1)
    got = sharding.per_shard_qkv(_labelled_qkv(4, 1), config, tp=2, kv_repeat=2)
    np.testing.assert_array_equal(got[0], [[100, 101, 200, 300], [102, 103, 200, 300]])


def test_per_shard_gate_up_by_hand():
    w = np.array([[10, 11, 12, 13, 20, 21, 22, 23]], np.float32)   # gate 1x, up 2x
    np.testing.assert_array_equal(sharding.per_shard_gate_up(w, 2)[0],
                                  [[10, 11, 20, 21], [12, 13, 22, 23]])


@pytest.mark.parametrize("config,tp", [(TINY_LLAMA, 2), (TINY_GEMMA3, 2),
                                       (TINY_LLAMA.replace(attention_bias=True), 2)])
def test_per_shard_layout_computes_the_same_projections(config, tp):
    """project_qkv / gated_mlp on the [D, tp, ...] layout (one device) give
    the default layout's q, k, v and MLP output (k and v repeated when K < tp)."""
    raw = random_params(config, seed=5)
    if config.attention_bias:
        rng = np.random.default_rng(1)
        for name, heads in (("q_bias", config.num_heads), ("k_bias", config.num_kv_heads),
                            ("v_bias", config.num_kv_heads)):
            raw["layers"][name] = rng.normal(0, 0.3, (config.num_layers, heads, config.head_dim)).astype(np.float32)
    plan = sharding.plan_sharding(config, tp)
    p = prepare_params(raw, config, pack=False)["layers"][0]
    shard = dict(p, qkv_proj=sharding.per_shard_qkv(np.asarray(p["qkv_proj"]), config, tp, plan.kv_repeat),
                 gate_up_proj=sharding.per_shard_gate_up(np.asarray(p["gate_up_proj"]), tp))
    if config.attention_bias:
        shard["qkv_bias"] = sharding.per_shard_qkv(np.asarray(p["qkv_bias"]), config, tp, plan.kv_repeat)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, config.hidden_size)), jnp.float32)
    rope = (jnp.ones((2, 3, config.head_dim)), jnp.zeros((2, 3, config.head_dim)))
    q, k, v = project_qkv(p, x, rope, config)
    q2, k2, v2 = project_qkv(shard, x, rope, plan.model_config(config))
    np.testing.assert_allclose(q2, q, atol=1e-5)
    np.testing.assert_allclose(k2, jnp.repeat(k, plan.kv_repeat, axis=2), atol=1e-5)
    np.testing.assert_allclose(v2, jnp.repeat(v, plan.kv_repeat, axis=2), atol=1e-5)
    act = config.hidden_act
    np.testing.assert_allclose(gated_mlp(x, shard["gate_up_proj"], p["down_proj"], act),
                               gated_mlp(x, p["gate_up_proj"], p["down_proj"], act), atol=1e-5)


# --- tp = 1, 2, 3 against one device (subprocesses with forced CPU devices) --------------------------


@pytest.fixture(scope="module", params=["llama", "gemma3", "smollm2_heads"])
def equivalence(request):
    return request.param, run_case(4, "tp_cases", "equivalence", model=request.param, tps=[1, 2, 3])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_logits_match_one_device(equivalence, tp):
    """All-position prefill logits, and the log-probs LLM.generate reports
    for the greedy tokens (the serving step's), within 1e-5 * max(1,
    max|logit|) (module docstring)."""
    model, result = equivalence
    r = result[str(tp)]
    bound = 1e-5 * max(1.0, result["max_abs_logit"])
    assert r["max_logit_diff"] <= bound, (model, r["plan"], r["max_logit_diff"], result["max_abs_logit"])
    assert r["max_logprob_diff"] <= bound, (model, r["plan"], r["max_logprob_diff"])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_tokens_match_one_device(equivalence, tp):
    model, result = equivalence
    r = result[str(tp)]
    assert r["greedy"] == result["reference"]["greedy"], (model, r["plan"])
    assert r["seeded"] == result["reference"]["seeded"], (model, r["plan"])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_only_the_collectives_the_math_needs(equivalence, tp):
    """Every compiled serving step (the prompts) and decode loop (the
    decoding rows) holds exactly: one all-reduce per split row-parallel
    product per layer, plus the vocabulary's all-reduce (embedding) and
    all-gather (logits) when it is split."""
    model, result = equivalence
    r = result[str(tp)]
    programs = r["collectives"]
    assert len(programs["step"]) >= 1 and len(programs["decode_loop"]) >= 1, programs
    assert all(c == r["expected_collectives"] for found in programs.values() for c in found), (
        model, r["plan"], programs)


@pytest.mark.slow
def test_xla_attention_and_no_kernels_on_a_multi_device_mesh(equivalence):
    """A multi-device LLM runs the XLA attention backend and no C++ kernel
    in its steps; one device keeps the backend `choose_backend` picks."""
    model, result = equivalence
    assert result["1"]["backend"] == ("cpu_kernels" if result["1"]["kernels_enabled"] else "xla")
    for tp in ("2", "3"):
        assert result[tp]["backend"] == "xla" and result[tp]["kernel_in_step"] is False


@pytest.mark.slow
def test_paged_state_is_sharded_by_kv_heads(equivalence):
    """An int8 paged cache's pools, scales included, split by KV heads (axis
    1) where attention is split, replicated otherwise; lengths and the row
    state replicated (dp = 1)."""
    model, result = equivalence
    replicated = lambda spec: all(a is None for a in spec)      # [] on one device
    for tp in ("1", "2", "3"):
        r, specs = result[tp], result[tp]["state_specs"]
        pools = [specs[k] for k in ("keys", "values", "key_scale", "value_scale")]
        if r["split_heads"] and tp != "1":
            assert pools == [[None, "tp", None, None]] * 2 + [[None, "tp", None]] * 2, (model, tp, specs)
        else:
            assert all(replicated(p) for p in pools), (model, tp, specs)
        assert replicated(specs["lengths"]) and all("tp" not in x for x in specs["rows"]), (model, tp, specs)


@pytest.mark.slow
def test_plans_cover_heads_repeat_and_replication(equivalence):
    model, result = equivalence
    expected = {"llama": {"2": (True, 1, False), "3": (False, 1, False)},
                "gemma3": {"2": (True, 2, False), "3": (False, 1, False)},
                "smollm2_heads": {"2": (False, 1, True), "3": (True, 1, True)}}[model]
    for tp, (heads, repeat, vocab) in expected.items():
        r = result[tp]
        assert (r["split_heads"], r["kv_repeat"], r["split_vocab"]) == (heads, repeat, vocab), r["plan"]


@pytest.mark.slow
def test_dp_replicas_match_one_device():
    result = run_case(4, "tp_cases", "equivalence", model="gemma3", tps=[2], dp=2)
    r = result["2"]
    assert r["max_logit_diff"] <= 1e-5 * max(1.0, result["max_abs_logit"])
    assert r["greedy"] == result["reference"]["greedy"] and r["seeded"] == result["reference"]["seeded"]
    assert r["state_specs"]["rows"] == ["['dp', None]", "['dp']"]       # 4 slots over dp = 2


# --- real models (slow) ---------------------------------------------------------------------------


# The same settings on the mesh (tp_cases.real_model) and on one device; a decode
# step of Gemma 3 on the mesh took about a second with the fast-compile flags
# (XLA's own kernels: the C++ ones do not partition), so 8 new tokens.
REAL_LLM_KWARGS = dict(max_seq_len=1024, decode_chunk=8)
REAL_NEW_TOKENS = 8


def _real(name, tp, hf_gguf, real_model_path, tmp_path, jaxinfer_xla_flags, atol, rtol, texts):
    """The tp run in a subprocess first, then HF, then our single-device
    run, one model in this process at a time. The tp run compiles as
    `jaxinfer` does (`jaxinfer_xla_flags`, tests/conftest.py): its run time,
    not its compiles, is most of it (on the mesh every phase runs XLA's own
    kernels; Gemma 3's took about 70 s with the test run's fast-compile flags
    and 53 s with these, on 2 Zen 4 cores)."""
    from jaxinfer.serving.llm import LLM
    from jaxinfer.serving.loading import load_tokenizer
    from tp_cases import real_model_tokens

    torch = pytest.importorskip("torch")
    path = real_model_path(name)
    tok = load_tokenizer(path)
    prompts = [tok.encode_prompt(t, False) for t in texts]
    out = tmp_path / "logits.npz"
    result = run_case(tp, "tp_cases", "real_model", timeout_s=1800, name=str(path), tp=tp,
                      prompts=prompts, new_tokens=REAL_NEW_TOKENS, out_path=str(out),
                      llm_kwargs=REAL_LLM_KWARGS, xla_flags=jaxinfer_xla_flags)
    model, _ = hf_gguf.get(path)
    logits = np.load(out)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1].numpy()
        ours = logits[str(i)]
        diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
        print(f"\n{name} tp={tp} prompt {i} ({len(ids)} tokens): last-position max |logit diff| vs HF "
              f"{diff:.2e}, max |logit| {scale:.1f}")
        assert diff <= atol + rtol * scale
    del model
    hf_gguf.clear()
    llm = LLM.load(str(path), progress=False, **REAL_LLM_KWARGS)
    one_device = real_model_tokens(llm, prompts, REAL_NEW_TOKENS)
    assert result["greedy"] == one_device["greedy"]
    assert result["seeded"] == one_device["seeded"]
    return result


@pytest.mark.slow
def test_smollm2_tp3_matches_hf(hf_gguf, real_model_path, tmp_path, jaxinfer_xla_flags):
    result = _real("smollm2-135m-instruct", 3, hf_gguf, real_model_path, tmp_path, jaxinfer_xla_flags,
                   2e-3, 0, ["The three primary colors are", "What is the capital of France? " * 6])
    assert "attention split" in result["plan"]


@pytest.mark.slow
def test_gemma3_tp2_matches_hf(hf_gguf, real_model_path, tmp_path, jaxinfer_xla_flags):
    from gemma3_cases import LONG, LOGIT_ATOL, LOGIT_RTOL

    result = _real("gemma3-270m", 2, hf_gguf, real_model_path, tmp_path, jaxinfer_xla_flags,
                   LOGIT_ATOL, LOGIT_RTOL, ["The capital of France is", LONG])
    assert "each KV head x2" in result["plan"]
