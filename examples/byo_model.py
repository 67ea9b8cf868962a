"""Bring your own model: a Flax NNX decoder, registered as a jaxinfer model
family at run time, served by jaxinfer's engine (KV cache, batching,
sampling, the OpenAI server) without touching jaxinfer.

The model is ordinary NNX research code with its own parameter names
(tok_embed, blocks[i].wq ... mlp_out, final_norm, lm_head): 2 pre-norm
layers of grouped-query attention with RoPE and a GELU MLP, a
character-level vocabulary. Its own `__call__` is the plain forward (full
causal attention, no cache). To run it in jaxinfer it provides the family
protocol (`jaxinfer.models.base.Family`):

* `prepare`: its params (the pure dict of `nnx.state`) -> the engine's
  layout, a dict whose "layers" entry holds one pytree per layer; its own
  preparation, not the Llama fusions of `weights.prepare.prepare_params`;
* `embed` / `layer` / `unembed`: the NNX submodules rebuilt from those
  params (`nnx.merge`), `layer` calling the block with the engine's
  `attend` (which owns the KV cache) instead of its plain attention.

    python examples/byo_model.py                    # LLM.generate, greedy
    jaxinfer serve model=python:examples/byo_model.py:build max_num_seqs=4 warmup=false --served-model-name byo
    # then: POST http://127.0.0.1:8000/v1/completions {"model": "byo", "prompt": "Hello", "max_tokens": 8}
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.nn import apply_rope, rope_cos_sin, rope_inv_freq

ARCH = "byo-nnx-decoder"
SPECIALS = ("<eos>", "<unk>")
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + tuple(string.printable[:95]))}
CONFIG = ModelConfig(arch=ARCH, vocab_size=len(VOCAB), num_layers=2, hidden_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=10_000.0,
                     rms_norm_eps=1e-6, max_position_embeddings=2048,
                     hidden_act="gelu_pytorch_tanh")


# --- the research model: plain Flax NNX -------------------------------------------------------


class DecoderBlock(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); x [B, T, D]."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.attn_norm = nnx.RMSNorm(d, epsilon=c.rms_norm_eps, rngs=rngs)
        self.wq = nnx.Linear(d, n * h, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(d, k * h, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(d, k * h, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(n * h, d, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, epsilon=c.rms_norm_eps, rngs=rngs)
        self.mlp_in = nnx.Linear(d, c.intermediate_size, rngs=rngs)
        self.mlp_out = nnx.Linear(c.intermediate_size, d, rngs=rngs)

    def __call__(self, x, kv, rope, attend, c: ModelConfig):
        """`attend(q, k, v, kv) -> (out [B, T, N, H], kv)`: the engine's (with
        the KV cache) or `causal_attention` (none). Returns (x, kv)."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).reshape(b, t, c.num_heads, c.head_dim), *rope)
        k = apply_rope(self.wk(h).reshape(b, t, c.num_kv_heads, c.head_dim), *rope)
        v = self.wv(h).reshape(b, t, c.num_kv_heads, c.head_dim)
        out, kv = attend(q * c.query_scale, k, v, kv)
        x = x + self.wo(out.reshape(b, t, -1))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x)))), kv


class TinyDecoder(nnx.Module):
    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.tok_embed = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens, c: ModelConfig):
        """The plain forward: tokens int32 [B, T] -> logits float32 [B, T, V]
        at every position (causal attention over the whole sequence, no cache)."""
        positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        rope = rope_cos_sin(positions, rope_inv_freq(c, c.rope_theta))
        x = self.tok_embed(tokens)
        for block in self.blocks:
            x, _ = block(x, None, rope, causal_attention, c)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def causal_attention(q, k, v, kv):
    """Softmax attention of q [B, T, N, H] over k, v [B, T, K, H], query t
    seeing keys 0..t; query head n reads kv head n // (N / K). kv passes through."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k)
    t = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores, axis=-1), v), kv


# --- the family: the same modules, run by jaxinfer's engine -----------------------------------


@functools.lru_cache(maxsize=None)
def _graphdefs(c: ModelConfig) -> dict:
    """The static structure of each part, for `nnx.merge` (no arrays made)."""
    model = nnx.eval_shape(lambda: TinyDecoder(c, nnx.Rngs(0)))
    parts = {name: nnx.graphdef(getattr(model, name))
             for name in ("tok_embed", "final_norm", "lm_head")}
    return {**parts, "block": nnx.graphdef(model.blocks[0])}


def _part(c: ModelConfig, name: str, params: dict):
    return nnx.merge(_graphdefs(c)[name], nnx.State(params))


def prepare(params: dict, config: ModelConfig, pack=None, weights: str = "float32") -> dict:
    """`nnx.state` as a pure dict -> the engine's layout: blocks {i: ...}
    become the tuple "layers"; prepared params come back unchanged."""
    if weights != "float32":
        raise ValueError(f"the {ARCH} family keeps float weights; weights={weights!r} is not supported")
    if isinstance(params.get("layers"), tuple):
        return params
    out = {name: params[name] for name in ("tok_embed", "final_norm", "lm_head")}
    out["layers"] = tuple(params["blocks"][i] for i in sorted(params["blocks"]))
    return out


def embed(params, tokens, config):
    return _part(config, "tok_embed", params["tok_embed"])(tokens)


def layer(p, x, kv, rope, attend, config):
    return _part(config, "block", p)(x, kv, rope, attend, config)


def unembed(params, h, config):
    h = _part(config, "final_norm", params["final_norm"])(h)
    return _part(config, "lm_head", params["lm_head"])(h).astype(jnp.float32)


FAMILY = models.register(models.Family(name=ARCH, embed=embed, layer=layer, unembed=unembed,
                                       prepare=prepare))


# --- what `jaxinfer serve model=python:examples/byo_model.py:build` calls ---------------------


def tokenizer():
    """A character-level `jaxinfer` Tokenizer over VOCAB (EOS "<eos>")."""
    from tokenizers import Regex, Tokenizer as RustTokenizer, decoders, models as tok_models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxinfer.tokenizer.tokenizer import Tokenizer

    tok = RustTokenizer(tok_models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    return Tokenizer(hf, source=ARCH)


def build(seed: int = 0):
    """(ModelConfig, params, Tokenizer): a randomly initialized TinyDecoder's
    params as NNX's pure dict (load trained weights here instead)."""
    model = TinyDecoder(CONFIG, nnx.Rngs(seed))
    return CONFIG, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokenizer()


def model_from_params(params: dict, config: ModelConfig = CONFIG) -> TinyDecoder:
    """The TinyDecoder holding `build`'s params (for its plain forward)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TinyDecoder(config, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnames="config")
def plain_logits(params: dict, tokens, config: ModelConfig = CONFIG):
    """The plain forward of `build`'s params: logits float32 [B, T, V]."""
    return model_from_params(params, config)(tokens, config)


def greedy_recompute(params: dict, ids, steps: int, config: ModelConfig = CONFIG) -> list[int]:
    """Greedy continuation by the plain forward over the whole sequence per
    token, no cache (padded to one length, len(ids) + steps, so it compiles
    once: with causal attention, later tokens do not change earlier logits)."""
    seq = list(ids)
    tokens = np.zeros((1, len(ids) + steps), np.int32)
    for _ in range(steps):
        tokens[0, :len(seq)] = seq
        seq.append(int(np.argmax(plain_logits(params, tokens, config)[0, len(seq) - 1])))
    return seq[len(ids):]


if __name__ == "__main__":
    from jaxinfer.sampling import SamplingParams
    from jaxinfer.serving.llm import LLM

    config, params, tok = build()
    llm = LLM(config, params, tok, max_seq_len=128, max_num_seqs=4)
    [c] = llm.generate(["Hello, world"], SamplingParams(temperature=0.0), max_new_tokens=16,
                       ignore_eos=True)
    print(repr(c.text), c.token_ids)
    plain = greedy_recompute(params, c.prompt_token_ids, len(c.token_ids))
    print("same tokens as the plain forward:", plain == c.token_ids)
