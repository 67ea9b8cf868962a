"""Tiny random models for engine tests (no checkpoint needed), and a tiny
Hugging Face checkpoint folder for loader tests."""

import json
import pathlib

import numpy as np

from jaxinfer.config import ModelConfig

TINY_LLAMA = ModelConfig(
    arch="llama", vocab_size=97, num_layers=3, hidden_size=32, num_heads=4,
    num_kv_heads=2, head_dim=8, intermediate_size=48, rope_theta=10_000.0,
    rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=True)

TINY_GEMMA3 = ModelConfig(
    arch="gemma3", vocab_size=101, num_layers=4, hidden_size=32, num_heads=4,
    num_kv_heads=1, head_dim=16, intermediate_size=64, rope_theta=1_000_000.0,
    rope_local_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
    tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", sliding_window=4,
    layer_types=("sliding_attention", "full_attention") * 2, query_pre_attn_scalar=16,
    qk_norm=True, sandwich_norm=True, scale_embeddings=True)


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> dict:
    """float32 numpy params in the engine's layout with random values."""
    rng = np.random.default_rng(seed)
    c = config
    L, D, N, K, H, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                           c.head_dim, c.intermediate_size, c.vocab_size)
    shapes = {
        "q_proj": (L, D, N, H), "k_proj": (L, D, K, H), "v_proj": (L, D, K, H),
        "o_proj": (L, N, H, D), "gate_proj": (L, D, F), "up_proj": (L, D, F),
        "down_proj": (L, F, D),
    }
    layers = {k: rng.normal(0, scale, s).astype(np.float32) for k, s in shapes.items()}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if c.sandwich_norm:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for name in norms:
        layers[name] = (1 + rng.normal(0, 0.1, (L, D))).astype(np.float32)
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            layers[name] = (1 + rng.normal(0, 0.1, (L, H))).astype(np.float32)
    if c.attention_bias:
        for name, heads in (("q_bias", N), ("k_bias", K), ("v_bias", K)):
            layers[name] = rng.normal(0, scale, (L, heads, H)).astype(np.float32)
    params = {"embed_tokens": rng.normal(0, 1.0, (V, D)).astype(np.float32),
              "norm": (1 + rng.normal(0, 0.1, (D,))).astype(np.float32), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = rng.normal(0, scale, (D, V)).astype(np.float32)
    return params


def tiny_llama_folder(folder: pathlib.Path, tensors_edit=None, tied: bool = True) -> pathlib.Path:
    """A two-layer Llama HF folder (config.json + model.safetensors), float32
    random weights: V=16, D=8, N=2, K=1, H=4, F=12; an lm_head when untied.
    `tensors_edit(tensors)` may change the name -> array dict before saving."""
    from safetensors.numpy import save_file

    cfg = dict(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=12,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               tie_word_embeddings=tied)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,)}
    if not tied:
        shapes["lm_head.weight"] = (16, 8)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (8,), p + "post_attention_layernorm.weight": (8,),
                       p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
                       p + "self_attn.v_proj.weight": (4, 8), p + "self_attn.o_proj.weight": (8, 8),
                       p + "mlp.gate_proj.weight": (12, 8), p + "mlp.up_proj.weight": (12, 8),
                       p + "mlp.down_proj.weight": (8, 12)})
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if tensors_edit:
        tensors_edit(tensors)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
