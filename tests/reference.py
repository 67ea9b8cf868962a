"""A slow, obvious reference forward pass in plain numpy (float64).

No cache, no jit, no shared code with jaxinfer.nn: every position of the
whole sequence is recomputed with a full causal (optionally banded) mask.
Never change this file to agree with the fast path.
"""

import math

import numpy as np


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    # x: [T, heads, H]; pairs are (i, i + H/2) ("rotate half").
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    ang = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x):
    return x / (1 + np.exp(-x))


def forward(params, tokens, config):
    """Logits [T, V] float64 for one unpadded sequence `tokens` [T]."""
    p = {k: np.asarray(v, np.float64) for k, v in params["layers"].items()}
    eps = config.rms_norm_eps
    x = np.asarray(params["embed_tokens"], np.float64)[np.asarray(tokens)]
    if config.scale_embeddings:
        x = x * np.float64(np.float32(math.sqrt(config.hidden_size)))
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    types = config.layer_types or ("full_attention",) * config.num_layers
    group = config.num_heads // config.num_kv_heads
    scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
    for i in range(config.num_layers):
        sliding = types[i] == "sliding_attention"
        theta = (config.rope_local_theta or config.rope_theta) if sliding else config.rope_theta
        h = _rms_norm(x, p["input_layernorm"][i], eps)
        q = np.einsum("td,dnh->tnh", h, p["q_proj"][i])
        k = np.einsum("td,dkh->tkh", h, p["k_proj"][i])
        v = np.einsum("td,dkh->tkh", h, p["v_proj"][i])
        if config.attention_bias:
            q, k, v = q + p["q_bias"][i], k + p["k_bias"][i], v + p["v_bias"][i]
        if config.qk_norm:
            q = _rms_norm(q, p["q_norm"][i], eps)
            k = _rms_norm(k, p["k_norm"][i], eps)
        q, k = _rope(q, pos, theta) * scale, _rope(k, pos, theta)
        out = np.zeros_like(q)
        for n in range(config.num_heads):
            s = q[:, n, :] @ k[:, n // group, :].T  # [T, T]
            if config.attn_logit_softcapping:
                c = config.attn_logit_softcapping
                s = c * np.tanh(s / c)
            qi, ki = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
            visible = ki <= qi
            if sliding:
                visible &= (qi - ki) < config.sliding_window
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            w /= w.sum(axis=-1, keepdims=True)
            out[:, n, :] = w @ v[:, n // group, :]
        a = np.einsum("tnh,nhd->td", out, p["o_proj"][i])
        if config.sandwich_norm:
            x = x + _rms_norm(a, p["post_attention_layernorm"][i], eps)
            h = _rms_norm(x, p["pre_feedforward_layernorm"][i], eps)
        else:
            x = x + a
            h = _rms_norm(x, p["post_attention_layernorm"][i], eps)
        g = h @ p["gate_proj"][i]
        act = _silu(g) if config.hidden_act == "silu" else _gelu_tanh(g)
        m = (act * (h @ p["up_proj"][i])) @ p["down_proj"][i]
        if config.sandwich_norm:
            m = _rms_norm(m, p["post_feedforward_layernorm"][i], eps)
        x = x + m
    x = _rms_norm(x, np.asarray(params["norm"], np.float64), eps)
    head = params.get("lm_head")
    w = np.asarray(head, np.float64) if head is not None else np.asarray(params["embed_tokens"], np.float64).T
    logits = x @ w
    if config.final_logit_softcapping:
        c = config.final_logit_softcapping
        logits = c * np.tanh(logits / c)
    return logits
