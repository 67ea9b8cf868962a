"""The model-family registry (`jaxinfer.models`) and the families' layout
fixes as hooks (`Family.gguf_row_order`, `Family.fix_hf_tensor`), by hand."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models import gemma3, llama
from jaxinfer.serving.llm import LLM


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(models, "_FAMILIES", dict(models._FAMILIES))
    return models


def _family(name, **kw):
    return models.Family(name=name, embed=llama.embed, layer=llama.layer, unembed=llama.unembed, **kw)


def test_builtin_families_and_lookups():
    assert [f.name for f in models.families()][:3] == ["llama", "gemma3", "qwen3"]
    assert models.family("llama") is llama.FAMILY
    assert models.family_for_hf("mistral") is llama.FAMILY
    assert models.family_for_hf("gemma2") is gemma3.FAMILY
    assert models.family_for_hf("gpt2") is None
    assert models.hf_architecture_type("Qwen3ForCausalLM") == "qwen3"
    assert models.hf_architecture_type("GPT2LMHeadModel") is None
    assert models.family_for_gguf("gemma3") is gemma3.FAMILY
    assert models.family_for_gguf("phi3") is None
    assert models.gguf_architectures()[:3] == ("llama", "gemma3", "qwen3")


def test_unknown_arch_fails_at_the_registry_naming_the_families():
    with pytest.raises(ValueError) as e:
        models.family("phi3")
    assert str(e.value).startswith("unknown model architecture 'phi3'; registered families: "
                                   "llama, gemma3, qwen3")


def test_model_config_accepts_any_arch_and_llm_refuses_an_unregistered_one():
    config = ModelConfig(arch="phi3", vocab_size=8, num_layers=1, hidden_size=4, num_heads=1,
                         num_kv_heads=1, head_dim=4, intermediate_size=8)
    with pytest.raises(ValueError, match="^unknown model architecture 'phi3'"):
        LLM(config, {}, max_seq_len=16)           # before any params are touched
    with pytest.raises(ValueError, match="arch must be a non-empty string"):
        config.replace(arch="")


def test_register(registry):
    mine = _family("mine", hf_model_types=("mine_hf",), hf_architectures={"MineLM": "mine_hf"},
                   gguf_architectures=("mine",))
    assert registry.register(mine) is mine
    assert registry.register(mine) is mine                    # the same object again: nothing
    assert registry.family("mine") is mine and registry.family_for_hf("mine_hf") is mine
    assert registry.hf_architecture_type("MineLM") == "mine_hf"
    assert registry.family_for_gguf("mine") is mine
    with pytest.raises(ValueError) as e:
        registry.register(_family("mine"))
    assert str(e.value) == ("a model family named 'mine' is already registered; pass "
                            "replace=True to replace it")
    other = _family("mine")
    assert registry.register(other, replace=True) is other and registry.family("mine") is other
    with pytest.raises(ValueError) as e:
        registry.register(_family("copy", hf_model_types=("qwen2",)))
    assert str(e.value) == ("family 'copy': Hugging Face model type 'qwen2' is already read by "
                            "family 'llama'")
    with pytest.raises(ValueError) as e:
        registry.register(_family("copy", gguf_architectures=("gemma3",)))
    assert str(e.value) == "family 'copy': GGUF architecture 'gemma3' is already read by family 'gemma3'"
    with pytest.raises(TypeError, match="register takes a jaxinfer.models.Family, got module"):
        registry.register(llama)


def test_family_checks_itself():
    with pytest.raises(ValueError, match="hf_architectures map to model types \\['x'\\]"):
        _family("f", hf_architectures={"XForCausalLM": "x"})
    with pytest.raises(TypeError, match="family 'f': prepare must be callable"):
        _family("f", prepare=None)
    with pytest.raises(models.CheckpointError, match="this model family reads no GGUF metadata"):
        _family("f").config_from_gguf({}, "f", None)


def test_a_family_adds_an_activation_with_one_entry(monkeypatch):
    """A Llama-like family with another MLP activation (ReLU squared here)
    adds one `ACTIVATIONS` entry from its own module: configs accept the
    name, and `gated_mlp` applies it. Unknown names are refused, naming the
    known ones."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.config import ACTIVATIONS
    from jaxinfer.models.blocks import gated_mlp

    shape = dict(arch="llama", vocab_size=8, num_layers=1, hidden_size=4, num_heads=1,
                 num_kv_heads=1, head_dim=4, intermediate_size=8)
    with pytest.raises(ValueError, match=r"^unsupported hidden_act 'relu2'; one of \['gelu_pytorch_tanh', "
                                         r"'silu'\]"):
        ModelConfig(hidden_act="relu2", **shape)
    monkeypatch.setitem(ACTIVATIONS, "relu2", lambda g: jnp.square(jax.nn.relu(g)))
    assert ModelConfig(hidden_act="relu2", **shape).hidden_act == "relu2"
    rng = np.random.default_rng(0)
    x, gate_up, down = (rng.standard_normal(s).astype(np.float32) for s in ((1, 3, 4), (4, 16), (8, 4)))
    g, u = x @ gate_up[:, :8], x @ gate_up[:, 8:]
    want = (np.maximum(g, 0) ** 2 * u) @ down
    got = gated_mlp(jnp.asarray(x), jnp.asarray(gate_up), jnp.asarray(down), "relu2")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Layout fixes through the family hooks


def test_llama_gguf_row_order_is_unpermute_qk_per_head_count():
    c = ModelConfig(arch="llama", vocab_size=8, num_layers=1, hidden_size=8, num_heads=2,
                    num_kv_heads=1, head_dim=4, intermediate_size=8)
    # one kv head of H=4: GGUF rows [a0, b0, a1, b1] -> HF [a0, a1, b0, b1]
    assert llama.gguf_row_order("model.layers.0.self_attn.k_proj.weight", 4, c).tolist() == [0, 2, 1, 3]
    # two query heads: each head's rows regrouped on its own
    assert llama.gguf_row_order("model.layers.0.self_attn.q_proj.bias", 8, c).tolist() == \
        [0, 2, 1, 3, 4, 6, 5, 7]
    assert llama.gguf_row_order("model.layers.0.self_attn.v_proj.weight", 4, c) is None
    w = np.arange(8.0).reshape(8, 1)
    perm = llama.gguf_row_order("model.layers.0.self_attn.q_proj.weight", 8, c)
    np.testing.assert_array_equal(w[perm], llama.unpermute_qk(w, 2))
    assert models.family("gemma3").gguf_row_order("model.layers.0.self_attn.q_proj.weight", 8, c) is None


def test_gemma_fix_hf_tensor_adds_one_to_norms_in_float32():
    c = None                                             # the fix reads only the name
    w = np.array([-0.5, 0.0, 2.0], ml_dtypes.bfloat16)
    for name in ("model.norm.weight", "model.layers.3.self_attn.k_norm.weight",
                 "model.layers.0.pre_feedforward_layernorm.weight"):
        fixed = gemma3.fix_hf_tensor(name, w, c)
        assert fixed.dtype == np.float32
        np.testing.assert_array_equal(fixed, [0.5, 1.0, 3.0])
    proj = np.ones((2, 2), ml_dtypes.bfloat16)
    assert gemma3.fix_hf_tensor("model.layers.0.self_attn.q_proj.weight", proj, c) is proj
    assert llama.FAMILY.fix_hf_tensor("model.norm.weight", w, c) is w
