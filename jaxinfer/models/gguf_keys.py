"""GGUF metadata keys and tensor names that llama.cpp architectures share
(spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): the
`{arch}.*` shape keys and the decoder's `blk.{i}.*` tensor names. Each
family's `config_from_gguf` and `gguf_names` build on these.

`fields` below is `gguf.GGUFReader.fields`: key -> a field whose
`.contents()` is the value.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from jaxinfer.models.base import CheckpointError

# GGUF name -> HF name for the tensors every llama.cpp decoder names alike.
# Families add the rest: llama.cpp's `ffn_norm` is always the norm in front
# of the MLP, which HF Llama calls post_attention_layernorm and HF Gemma 3
# pre_feedforward_layernorm (Gemma's post_attention_layernorm is the norm on
# the attention output, GGUF `post_attention_norm`).
DECODER_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def get(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value of `key`, or `default` when the file omits it."""
    field = fields.get(key)
    return default if field is None else field.contents()


def require(fields: Mapping[str, Any], key: str) -> Any:
    """The value of `key`. Raises CheckpointError when the file omits it."""
    if key not in fields:
        raise CheckpointError(f"GGUF metadata is missing {key!r}")
    return fields[key].contents()


def scalar_heads(value: Any, key: str) -> int:
    """Head counts may be per-layer arrays in GGUF; one value is needed.
    Raises CheckpointError for per-layer counts that differ."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"per-layer {key} {sorted(set(value))} is not supported")
        value = value[0]
    return int(value)


def vocab_size(fields, arch: str, tensor_shapes: Optional[Mapping[str, tuple]]) -> int:
    """`{arch}.vocab_size`, else the embedding's rows, else the token list's length."""
    if f"{arch}.vocab_size" in fields:
        return int(get(fields, f"{arch}.vocab_size"))
    if tensor_shapes and "token_embd.weight" in tensor_shapes:
        return int(tensor_shapes["token_embd.weight"][0])   # numpy order [V, D]
    if "tokenizer.ggml.tokens" in fields:
        return len(fields["tokenizer.ggml.tokens"].data)
    raise CheckpointError("GGUF metadata gives no vocab size and no token list")


def check_rope_scaling(fields, arch: str, tensor_shapes) -> None:
    """Refuse RoPE variants a ModelConfig cannot express (wrong logits otherwise)."""
    kind = get(fields, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported")
    if tensor_shapes and "rope_freqs.weight" in tensor_shapes:
        raise CheckpointError(
            "tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors) is not supported")


def common_fields(fields, arch: str, tensor_shapes) -> dict:
    """ModelConfig fields every llama.cpp architecture writes the same way;
    a tied LM head and q/k/v biases are read off the tensor names (none
    given: tied, no biases).

    Raises:
      CheckpointError: a required key is missing.
    """
    hidden = int(require(fields, f"{arch}.embedding_length"))
    heads = scalar_heads(require(fields, f"{arch}.attention.head_count"), "head_count")
    kv_heads = scalar_heads(get(fields, f"{arch}.attention.head_count_kv", heads), "head_count_kv")
    head_dim = get(fields, f"{arch}.attention.key_length") or get(
        fields, f"{arch}.rope.dimension_count") or hidden // heads
    names = tensor_shapes or {}
    return dict(
        vocab_size=vocab_size(fields, arch, tensor_shapes),
        num_layers=int(require(fields, f"{arch}.block_count")),
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
        intermediate_size=int(require(fields, f"{arch}.feed_forward_length")),
        rope_theta=float(get(fields, f"{arch}.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(require(fields, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get(fields, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )
