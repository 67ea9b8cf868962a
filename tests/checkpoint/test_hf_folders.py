"""Hugging Face checkpoint folders (config.json + safetensors) against
transformers, on tiny random models made at test time (CPU, float32).

Each case builds a model with `transformers` (`AutoConfig.for_model` +
`AutoModelForCausalLM.from_config`, seeded), gives it weights large enough
that logits are far from uniform (initializer_range 0.2; norm weights and
biases randomized too, so a missing Gemma `+1` or bias would show), saves it
with `save_pretrained(safe_serialization=True)` (some cases sharded with a
small `max_shard_size`, one in bfloat16), and compares:

* logits at every position of a 12-token prompt: jaxinfer's parallel prefill
  vs transformers reloading the same folder in float32 (eager attention),
  max |diff| <= 1e-4 (logits are O(1..10); measured <= ~1e-5, see report);
* an 8-token greedy continuation: jaxinfer's cached decode vs transformers
  recomputing the whole sequence per token: identical ids.

Also: config.json parsing (both the transformers >= 5 `rope_parameters`
spelling and the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`
/ `sliding_window_pattern` keys), errors for missing / misshapen / unused
tensors and unsupported models, and the Gemma `(1 + w)` norm with w = 0.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint.convert import CheckpointError
from jaxinfer.checkpoint.safetensors import config_from_hf, load_hf_folder, weight_map
from jaxinfer.config import FULL_ATTENTION as FULL
from jaxinfer.config import SLIDING_ATTENTION as SLIDE
from jaxinfer.nn import rms_norm
from jaxinfer.serving.llm import LLM
from hf_cases import (assert_cached_greedy_matches_hf, assert_logits_match_hf,
                      hf_greedy_recompute, prompt_ids)
from tiny import tiny_llama_folder
from jaxinfer.sampling import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0)

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=64,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)

# name -> (model_type, config overrides, save options)
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False), {}),
    "llama3_rope_tied_sharded": ("llama", dict(
        tie_word_embeddings=True, rope_theta=10_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        dict(max_shard_size="40KB")),
    "mistral_window4_bf16": ("mistral", dict(sliding_window=4), dict(dtype=torch.bfloat16)),
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=True, use_sliding_window=False), {}),
    "qwen2_mixed_window4": ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1), {}),
    # transformers' Gemma 3 ignores attn_logit_softcapping (and so does jaxinfer)
    "gemma3_window4_softcap_sharded": ("gemma3_text", dict(
        num_hidden_layers=3, sliding_window=4, sliding_window_pattern=3,
        query_pre_attn_scalar=24, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0),
        dict(max_shard_size="60KB")),
    "gemma2_softcap": ("gemma2", dict(
        num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=16,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0), {}),
}
# Run only with the slow tests (each case costs ~5 s of compilation on 2 CPU cores).
SLOW_CASES = ("qwen2_mixed_window4", "gemma2_softcap")


def _randomize_norms_and_biases(model, gemma: bool) -> None:
    """Norm weights: 1 + N(0, 0.3) as multipliers (Gemma stores w = multiplier - 1);
    biases N(0, 0.2). HF initializes norms to identity and biases to 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.3 + (0.0 if gemma else 1.0))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape) * 0.2)


def make_hf_folder(folder: pathlib.Path, model_type: str, overrides: dict, save: dict,
                   seed: int = 0) -> pathlib.Path:
    """A random tiny `model_type` checkpoint saved with save_pretrained."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **{**_SMALL, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model, model_type.startswith("gemma"))
    save = dict(save)
    dtype = save.pop("dtype", None)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True, **save)
    return folder


def hf_reference(folder: pathlib.Path):
    """The folder loaded back by transformers, float32, eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name
    for name in sorted(CASES)])
def case(request, tmp_path_factory):
    model_type, overrides, save = CASES[request.param]
    folder = make_hf_folder(tmp_path_factory.mktemp(request.param), model_type, overrides, save)
    config, params = load_hf_folder(folder)
    return request.param, folder, config, params, hf_reference(folder)


def test_logits_match_hf_all_positions(case):
    name, _, config, params, model = case
    assert_logits_match_hf(name, config, params, model, prompt_ids(config.vocab_size), ATOL)


def test_greedy_cached_decode_matches_hf(case):
    """Prefill + decode_step through the KV cache (ring buffers on sliding layers:
    12 + 8 positions cross a window of 4 several times) vs HF recomputing."""
    name, _, config, params, model = case
    assert_cached_greedy_matches_hf(name, config, params, model, NEW_TOKENS)


@pytest.mark.slow
def test_llm_generate_matches_hf(case):
    """The whole host path (`LLM.generate`: start + chunked on-device decode with
    sampling at temperature 0); slow only for its two extra compilations."""
    name, _, config, params, model = case
    ids = prompt_ids(config.vocab_size, seed=2)
    llm = LLM(config, params, None, max_seq_len=32, decode_chunk=NEW_TOKENS)
    [ours] = llm.generate([ids], GREEDY, max_new_tokens=NEW_TOKENS)
    assert ours.token_ids == hf_greedy_recompute(model, ids, NEW_TOKENS), name
    assert ours.finish_reason == "length"


def test_config_fields_match_hf_config(case):
    name, _, config, params, model = case
    hf = model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.head_dim, hf.intermediate_size, hf.vocab_size)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in params) == (not hf.tie_word_embeddings)
    rope = hf.rope_parameters
    if name.startswith("gemma3"):
        assert config.rope_theta == rope[FULL]["rope_theta"]
        assert config.rope_local_theta == rope[SLIDE]["rope_theta"]
    else:
        assert config.rope_theta == rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        assert dict(config.rope_scaling or {"rope_type": "default"}) == scaling
    hf_types = getattr(hf, "layer_types", None)
    if name.startswith("mistral"):
        hf_types = [SLIDE] * hf.num_hidden_layers          # MistralConfig has no layer_types
    if hf_types and SLIDE in hf_types:
        assert list(config.attention_types) == list(hf_types)
        assert config.sliding_window == hf.sliding_window
    else:
        assert config.layer_types is None or SLIDE not in config.layer_types
    if name.startswith("gemma"):
        assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
        # transformers' Gemma 3 never applies attn_logit_softcapping; Gemma 2 does
        attn_cap = hf.attn_logit_softcapping if name.startswith("gemma2") else None
        assert config.attn_logit_softcapping == attn_cap
        assert config.final_logit_softcapping == hf.final_logit_softcapping


def test_sharded_cases_really_are_sharded(case):
    name, folder, *_ = case
    sharded = (folder / "model.safetensors.index.json").is_file()
    assert sharded == ("sharded" in name)
    if sharded:
        assert len(set(weight_map(folder).values())) >= 3


# ---------------------------------------------------------------------------
# config.json parsing

def test_old_style_gemma3_config():
    """gemma-3-270m's config.json as written by transformers 4.5x."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
           "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None,
           "sliding_window": 512, "_sliding_window_pattern": 6, "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "use_bidirectional_attention": False}
    c = config_from_hf(cfg)
    assert c.arch == "gemma3" and c.tie_word_embeddings
    assert (c.rope_theta, c.rope_local_theta, c.sliding_window) == (1e6, 1e4, 512)
    assert c.full_layers == (5, 11, 17) and len(c.sliding_layers) == 15
    assert c.qk_norm and c.sandwich_norm and c.scale_embeddings
    assert c.query_scale == 256 ** -0.5
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    # transformers reads the same dict the same way
    hf = transformers.AutoConfig.for_model(**cfg)
    assert list(c.layer_types) == list(hf.layer_types)


def test_old_style_llama3_rope_scaling_and_new_style_agree():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=10, max_position_embeddings=131072)
    old = config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = config_from_hf({**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new
    assert old.rope_theta == 500000.0
    assert old.rope_scaling == tuple(sorted(scaling.items()))
    assert old.head_dim == 16 and old.num_kv_heads == 4 and not old.tie_word_embeddings
    # "type" (pre-4.45 spelling) works too; "default" means none
    legacy = {**scaling, "type": "llama3"}
    del legacy["rope_type"]
    assert config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": legacy}) == old
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
    assert plain.rope_scaling is None and plain.rope_theta == 1.0


def test_mistral_and_qwen2_window_rules():
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                vocab_size=10, max_position_embeddings=1024)
    m = config_from_hf({**base, "model_type": "mistral", "sliding_window": 256})
    assert m.layer_types == (SLIDE,) * 3 and m.sliding_window == 256
    for window in (None, 1024, 4096):      # unset, or never reached: full attention
        m = config_from_hf({**base, "model_type": "mistral", "sliding_window": window})
        assert m.sliding_layers == () and m.sliding_window is None
    q = config_from_hf({**base, "model_type": "qwen2", "sliding_window": 256,
                        "use_sliding_window": False})
    assert q.sliding_layers == () and q.attention_bias
    q = config_from_hf({**base, "model_type": "qwen2", "sliding_window": 256,
                        "use_sliding_window": True, "max_window_layers": 2})
    assert q.attention_types == (FULL, FULL, SLIDE)


def test_model_type_from_architectures():
    cfg = dict(architectures=["MistralForCausalLM"], hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, vocab_size=10)
    assert config_from_hf(cfg).arch == "llama"


@pytest.mark.parametrize("cfg,match", [
    ({"model_type": "gpt2"}, "'gpt2'.*supported model types: llama, mistral, qwen2"),
    ({"model_type": "gemma3", "text_config": {}, "vision_config": {}}, "language_model"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}, "multimodal"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"model_type": "llama", "attention_bias": True}, "o_proj"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "gemma3_text", "sliding_window": 4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "'linear'"),
    ({"model_type": "llama", "num_key_value_heads": 3}, "multiple of num_key_value_heads|num_kv_heads"),
    ({"model_type": "llama", "hidden_size": None}, "'hidden_size'"),
])
def test_unsupported_configs_raise(cfg, match):
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=10)
    with pytest.raises(CheckpointError, match=match):
        config_from_hf({**base, **cfg})


# ---------------------------------------------------------------------------
# Broken checkpoints (written with safetensors.numpy: no torch needed)

def test_tiny_handmade_folder_loads(tmp_path):
    config, params = load_hf_folder(tiny_llama_folder(tmp_path / "ok"))
    assert config.head_dim == 4 and config.num_kv_heads == 1 and "lm_head" not in params
    assert params["layers"]["q_proj"].shape == (2, 8, 2, 4)


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = tiny_llama_folder(tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_hf_folder(folder)


def test_wrong_shape_is_named(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    folder = tiny_llama_folder(tmp_path / "s", lambda t: t.update({name: np.zeros((8, 8), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(8, 8\).*\(4, 8\)"):
        load_hf_folder(folder)


def test_unused_tensor_is_refused(tmp_path):
    name = "model.layers.0.self_attn.o_proj.bias"
    folder = tiny_llama_folder(tmp_path / "u", lambda t: t.update({name: np.zeros(8, np.float32)}))
    with pytest.raises(CheckpointError, match=name):
        load_hf_folder(folder)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    folder = tiny_llama_folder(tmp_path / "r", lambda t: t.update({name: np.ones(2, np.float32)}))
    load_hf_folder(folder)


def test_sharded_real_case_missing_tensor_and_shard(tmp_path):
    """A real transformers-sharded folder: drop one tensor from its shard, then a whole shard."""
    from safetensors.numpy import load_file, save_file

    folder = make_hf_folder(tmp_path / "g", "gemma3_text", dict(num_hidden_layers=2, sliding_window=4),
                            dict(max_shard_size="60KB"))
    files = weight_map(folder)
    name = "model.layers.1.self_attn.k_norm.weight"
    shard = files[name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name):
        load_hf_folder(folder)
    other = sorted(set(files.values()) - {shard})[0]
    other.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{other.name}'"):
        load_hf_folder(folder)


def test_folder_without_safetensors(tmp_path):
    tiny_llama_folder(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_folder(tmp_path)


# ---------------------------------------------------------------------------
# Gemma (1 + w) norms

def test_gemma_zero_norm_weight_is_identity_scale(tmp_path):
    """HF Gemma RMSNorm with w = 0 computes normalize(x) * (1 + 0) = normalize(x),
    not zeros: the load path adds 1, and rms_norm then returns x / rms(x)."""
    from safetensors.numpy import save_file

    D, H, F, V = 2, 2, 4, 8
    cfg = dict(model_type="gemma3_text", vocab_size=V, hidden_size=D, intermediate_size=F,
               num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=H,
               sliding_window=4, layer_types=[FULL])
    tensors = {"model.embed_tokens.weight": np.ones((V, D), np.float32),
               "model.norm.weight": np.zeros(D, np.float32)}
    p = "model.layers.0."
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        tensors[f"{p}{norm}.weight"] = np.zeros(D, np.float32)
    for norm in ("q_norm", "k_norm"):
        tensors[f"{p}self_attn.{norm}.weight"] = np.zeros(H, np.float32)
    for proj, shape in (("q_proj", (H, D)), ("k_proj", (H, D)), ("v_proj", (H, D)), ("o_proj", (D, H))):
        tensors[f"{p}self_attn.{proj}.weight"] = np.ones(shape, np.float32)
    for proj, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
        tensors[f"{p}mlp.{proj}.weight"] = np.ones(shape, np.float32)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"))

    config, params = load_hf_folder(tmp_path)
    np.testing.assert_array_equal(params["norm"], [1.0, 1.0])
    for key in ("input_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm"):
        np.testing.assert_array_equal(params["layers"][key], [[1.0, 1.0]])
    x = jnp.array([[3.0, 4.0]])                      # rms = sqrt(12.5) = 3.5355...
    y = rms_norm(x, params["norm"], config.rms_norm_eps)
    np.testing.assert_allclose(y, [[0.8485281, 1.1313709]], rtol=1e-6)
    # the same numbers HF's Gemma3RMSNorm gives for w = 0
    norm = transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(2, eps=config.rms_norm_eps)
    with torch.no_grad():
        np.testing.assert_allclose(norm(torch.tensor([[3.0, 4.0]])).numpy(), y, rtol=1e-6)
