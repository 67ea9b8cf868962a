"""A two-layer toy Llama trained in seconds, for watching prefill and decode.

    jaxinfer train-toy --config configs/toy-two-layer.yaml [--out DIR]

The model is the classic walkthrough transformer: 2 layers, hidden size 4,
one attention head of size 4, a character-level vocabulary over `CORPUS`
(each line ends with the end-of-text token). It is trained with optax AdamW
on next-token cross-entropy computed by the engine itself
(`engine.prefill(..., all_logits=True)` on a fresh cache is a pure,
differentiable function of the params), so the numbers `jaxinfer trace`
prints later come from the same code that trained it.

Training stops after `steps` AdamW steps; the result must make greedy
generation from "你好" continue with "世界" (`TARGET_PROMPT`,
`TARGET_CONTINUATION`), else training reports failure. Same config and seed
give bitwise-identical params on the same platform and JAX version (the
initialisation is numpy's PCG64; training is one compiled step, checked on CPU).

The result is saved as a Hugging Face Llama folder, readable by the normal
loader (`jaxinfer.serving.llm.LLM.load(folder)`) and by transformers:

    config.json          model_type "llama", HF field names
    model.safetensors    HF tensor names and layouts (`nn.Linear.weight` is [out, in])
    tokenizer.json       `tokenizers` WordLevel model, one token per character
    tokenizer_config.json
    toy_training.json    corpus, seed, steps, loss, the target check

Toy config YAML: keys are exactly the fields of `ToyConfig` (unknown keys are
an error); `kind: toy` marks the file as a toy config. A relative `model:`
folder lives under the jaxinfer cache dir ($JAXINFER_CACHE_DIR, else
$XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer); `--out` overrides it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, ModelConfig, SamplingParams, init_cache
from jaxinfer.testing import (cache_dir, check_keys, load_model, phases as engine, prepare_params,
                              read_yaml_mapping)

EOS = "<|endoftext|>"
UNK = "<unk>"
SPECIAL_TOKENS = (EOS, UNK)          # ids 0 and 1
CORPUS = ("你好世界", "世界很大", "我爱世界", "大家好", "再见")
TARGET_PROMPT = "你好"
TARGET_CONTINUATION = "世界"
TRAINING_FILE = "toy_training.json"


# --- config -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """The toy YAML (`configs/toy-two-layer.yaml`). Every key is a field here.

    Attributes:
      kind: must be "toy"; tells `jaxinfer trace` this is not a GenerationConfig.
      model: output folder. Relative paths are under the jaxinfer cache dir
        (see `model_dir`); absolute and `~` paths are used as given.
      num_layers, hidden_size, num_heads, num_kv_heads, head_dim,
      intermediate_size, rope_theta, rms_norm_eps, max_position_embeddings:
        the architecture (ModelConfig meaning; the vocabulary comes from CORPUS).
      steps: AdamW steps (full-batch, one batch = the whole corpus).
      learning_rate: AdamW peak learning rate (cosine decay to 10% over `steps`).
      weight_decay: AdamW decoupled weight decay.
      seed: PRNG seed of the parameter initialisation.
    """

    kind: str = "toy"
    model: str = "toy-two-layer"
    num_layers: int = 2
    hidden_size: int = 4
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 4
    intermediate_size: int = 16
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32
    steps: int = 300
    learning_rate: float = 0.03
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.kind != "toy":
            raise ValueError(f"a toy config needs kind: toy, got {self.kind!r}")
        if self.steps < 1 or self.learning_rate <= 0:
            raise ValueError(f"steps must be >= 1 and learning_rate > 0, got {self.steps}, "
                             f"{self.learning_rate}")

    @classmethod
    def from_dict(cls, values: dict) -> "ToyConfig":
        """Build from a mapping. Raises ValueError naming unknown keys."""
        check_keys(values, [f.name for f in dataclasses.fields(cls)], "toy config")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ToyConfig":
        """Read a toy YAML file. Raises FileNotFoundError / ValueError."""
        return cls.from_dict(read_yaml_mapping(path))

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The engine's ModelConfig for this toy (Llama, untied LM head)."""
        return ModelConfig(
            arch="llama", vocab_size=vocab_size, num_layers=self.num_layers,
            hidden_size=self.hidden_size, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, rope_theta=float(self.rope_theta),
            rms_norm_eps=float(self.rms_norm_eps),
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False)


def model_dir(toy: ToyConfig, out: Optional[str | os.PathLike] = None) -> pathlib.Path:
    """Where the toy model lives: `out` if given (relative to cwd), else
    `toy.model`, relative paths under the jaxinfer cache dir."""
    if out is not None:
        return pathlib.Path(out).expanduser()
    path = pathlib.Path(toy.model).expanduser()
    if path.is_absolute():
        return path

    return cache_dir() / path


# --- vocabulary and data ---------------------------------------------------------------------


def build_vocab(corpus: Sequence[str] = CORPUS) -> dict[str, int]:
    """Special tokens first (EOS = 0, UNK = 1), then characters in order of appearance."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for line in corpus:
        for ch in line:
            vocab.setdefault(ch, len(vocab))
    return vocab


def build_tokenizer(vocab: dict[str, int]):
    """A `tokenizers.Tokenizer`: every character is one WordLevel token
    (unknown characters -> UNK), decoding concatenates tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def corpus_batch(vocab: dict[str, int], corpus: Sequence[str] = CORPUS):
    """Right-padded training batch: every line followed by EOS.

    Returns:
      tokens int32 [B, T], lengths int32 [B], targets int32 [B, T] (the next
      token; 0 where there is none) and weights float32 [B, T] (1 where
      position t predicts a real next token, else 0).
    """
    rows = [[vocab[ch] for ch in line] + [vocab[EOS]] for line in corpus]
    b, t = len(rows), max(map(len, rows))
    tokens = np.zeros((b, t), np.int32)
    targets = np.zeros((b, t), np.int32)
    weights = np.zeros((b, t), np.float32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
        targets[i, :len(row) - 1] = row[1:]
        weights[i, :len(row) - 1] = 1.0
    lengths = np.array([len(r) for r in rows], np.int32)
    return tokens, lengths, targets, weights


# --- params and training -----------------------------------------------------------------------


def init_params(config: ModelConfig, seed: int) -> dict:
    """Random params in the engine layout (see `checkpoint.convert`), float32.

    Drawn on the host with numpy's PCG64 (`np.random.default_rng(seed)`), in a
    fixed order: embeddings ~ N(0, 1); LM head and projections ~ N(0, 1/fan_in);
    RMSNorm scales = 1.
    """
    L, D, N, K, H, F, V = (config.num_layers, config.hidden_size, config.num_heads,
                           config.num_kv_heads, config.head_dim, config.intermediate_size,
                           config.vocab_size)
    shapes = {"q_proj": ((L, D, N, H), D), "k_proj": ((L, D, K, H), D),
              "v_proj": ((L, D, K, H), D), "o_proj": ((L, N, H, D), N * H),
              "gate_proj": ((L, D, F), D), "up_proj": ((L, D, F), D), "down_proj": ((L, F, D), F)}
    rng = np.random.default_rng(seed)
    normal = lambda shape, fan_in: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    params = {"embed_tokens": normal((V, D), 1), "lm_head": normal((D, V), D),
              "norm": np.ones((D,), np.float32),
              "layers": {name: normal(shape, fan_in) for name, (shape, fan_in) in shapes.items()}}
    params["layers"]["input_layernorm"] = np.ones((L, D), np.float32)
    params["layers"]["post_attention_layernorm"] = np.ones((L, D), np.float32)
    return jax.tree_util.tree_map(jnp.asarray, params)


def corpus_loss(params: dict, tokens: jax.Array, lengths: jax.Array, targets: jax.Array,
                weights: jax.Array, config: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) of the engine's own prefill
    logits over the real positions of every line."""
    cache = init_cache(config, tokens.shape[0], tokens.shape[1])
    prepared = prepare_params(params, config, pack=False)   # jnp ops: differentiable
    logits, _ = engine.prefill(prepared, cache, tokens, lengths, config=config, all_logits=True)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.sum(weights)


@functools.lru_cache(maxsize=8)
def _train_program(config: ModelConfig, steps: int, learning_rate: float, weight_decay: float):
    """(jitted optimizer init, jitted step): one AdamW step on the full batch."""
    import optax

    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=0.1)
    optimizer = optax.adamw(schedule, weight_decay=weight_decay)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(corpus_loss)(params, *batch, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(optimizer.init), step


@dataclasses.dataclass
class TrainResult:
    """Trained toy: engine config, params (jax arrays), vocabulary, per-step losses
    (nats/token), seconds spent, and the greedy continuation of TARGET_PROMPT."""

    config: ModelConfig
    params: dict
    vocab: dict[str, int]
    losses: list[float]
    seconds: float
    continuation: str = ""

    @property
    def reached_target(self) -> bool:
        return self.continuation == TARGET_CONTINUATION


def train(toy: ToyConfig, log: Optional[Callable[[str], None]] = None) -> TrainResult:
    """Train the toy model with AdamW on CORPUS; deterministic for a given config.

    Returns a TrainResult whose `continuation` is the greedy text after
    TARGET_PROMPT (up to EOS, at most 4 tokens).
    """
    t0 = time.perf_counter()
    vocab = build_vocab()
    config = toy.model_config(len(vocab))
    batch = tuple(jnp.asarray(a) for a in corpus_batch(vocab))
    opt_init, step = _train_program(config, toy.steps, float(toy.learning_rate),
                                     float(toy.weight_decay))
    params = init_params(config, toy.seed)
    opt_state = opt_init(params)
    losses = []
    for i in range(toy.steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
        if log and (i == 0 or (i + 1) % 100 == 0 or i + 1 == toy.steps):
            log(f"  step {i + 1:4d}/{toy.steps}  loss {float(loss):.4f} nats/token")
    losses = [float(x) for x in jax.device_get(losses)]
    result = TrainResult(config, params, vocab, losses, time.perf_counter() - t0)
    ids = [vocab.get(ch, vocab[UNK]) for ch in TARGET_PROMPT]
    out = greedy_continuation(config, params, ids, max_new_tokens=4, stop_ids=(vocab[EOS],))
    inverse = {i: tok for tok, i in vocab.items()}
    result.continuation = "".join(inverse[i] for i in out if i != vocab[EOS])
    return result


def greedy_continuation(config: ModelConfig, params: dict, ids: Sequence[int],
                        max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy ids after prompt `ids` (`LLM.generate`), ending with (and
    including) the first stop id, at most max_new_tokens."""

    llm = LLM(config, params, max_seq_len=min(config.max_position_embeddings,
                                              max(len(ids) + max_new_tokens, 2)),
              stop_token_ids=stop_ids)
    [out] = llm.generate([list(ids)], SamplingParams(temperature=0.0), max_new_tokens=max_new_tokens)
    return out.token_ids


# --- Hugging Face folder -------------------------------------------------------------------------


def params_to_hf_tensors(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """Engine params -> HF Llama tensors (names and [out, in] layouts), the
    inverse of `checkpoint.convert.params_from_hf_tensors`."""
    D, N, K, H = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    layouts = {
        "input_layernorm": ("input_layernorm.weight", lambda w: w),
        "post_attention_layernorm": ("post_attention_layernorm.weight", lambda w: w),
        "q_proj": ("self_attn.q_proj.weight", lambda w: w.reshape(D, N * H).T),
        "k_proj": ("self_attn.k_proj.weight", lambda w: w.reshape(D, K * H).T),
        "v_proj": ("self_attn.v_proj.weight", lambda w: w.reshape(D, K * H).T),
        "o_proj": ("self_attn.o_proj.weight", lambda w: w.reshape(N * H, D).T),
        "gate_proj": ("mlp.gate_proj.weight", lambda w: w.T),
        "up_proj": ("mlp.up_proj.weight", lambda w: w.T),
        "down_proj": ("mlp.down_proj.weight", lambda w: w.T),
    }
    out = {"model.embed_tokens.weight": p["embed_tokens"], "model.norm.weight": p["norm"]}
    if "lm_head" in p:
        out["lm_head.weight"] = p["lm_head"].T
    for key, (suffix, to_hf) in layouts.items():
        for i in range(config.num_layers):
            out[f"model.layers.{i}.{suffix}"] = to_hf(p["layers"][key][i])
    return {name: np.ascontiguousarray(w) for name, w in out.items()}


def hf_config(config: ModelConfig, eos_token_id: int) -> dict:
    """config.json contents for a Llama model (transformers `LlamaConfig` field names)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": None,
        "eos_token_id": eos_token_id, "pad_token_id": None, "torch_dtype": "float32",
    }


def save_hf_folder(folder: str | os.PathLike, result: TrainResult, toy: ToyConfig) -> pathlib.Path:
    """Write the trained toy as an HF Llama folder (module docstring), atomically:
    files go to a temporary sibling folder that is then renamed over `folder`."""
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        eos_id = result.vocab[EOS]
        (tmp / "config.json").write_text(json.dumps(hf_config(result.config, eos_id), indent=2))
        save_file(params_to_hf_tensors(result.params, result.config),
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(result.vocab),
                                         eos_token=EOS, unk_token=UNK)
        hf_tok.save_pretrained(str(tmp))
        info = {"toy_config": dataclasses.asdict(toy), "corpus": list(CORPUS),
                "final_loss": result.losses[-1], "train_seconds": round(result.seconds, 3),
                "target": {"prompt": TARGET_PROMPT, "expected": TARGET_CONTINUATION,
                           "greedy": result.continuation}}
        (tmp / TRAINING_FILE).write_text(json.dumps(info, ensure_ascii=False, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_folder(folder: str | os.PathLike, dtype=jnp.float32):
    """(config, params in the checkpoint layout, Tokenizer) of an HF folder,
    through the normal loader (`jaxinfer.serving.loading.load_model`)."""

    return load_model(str(folder), dtype=dtype)


def is_model_folder(folder: pathlib.Path) -> bool:
    """Whether `folder` holds a saved model (config, weights and tokenizer)."""
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors",
                                                "tokenizer.json"))


def train_and_save(toy: ToyConfig, folder: pathlib.Path,
                   log: Callable[[str], None] = print) -> TrainResult:
    """Train, check the target continuation, and save. Raises RuntimeError
    (nothing saved) when greedy generation from TARGET_PROMPT misses the target."""
    log(f"training toy model: {toy.num_layers} layers, hidden {toy.hidden_size}, "
        f"{toy.num_heads} head(s), AdamW {toy.steps} steps, lr {toy.learning_rate}, "
        f"seed {toy.seed}")
    result = train(toy, log=log)
    log(f"trained in {result.seconds:.1f} s; greedy {TARGET_PROMPT!r} -> "
        f"{result.continuation!r} (target {TARGET_CONTINUATION!r})")
    if not result.reached_target:
        raise RuntimeError(f"training did not reach the target: {TARGET_PROMPT!r} -> "
                           f"{result.continuation!r}; try more steps or another seed")
    save_hf_folder(folder, result, toy)
    log(f"saved Hugging Face Llama folder {folder}")
    return result


def ensure_model(toy: ToyConfig, out=None, log: Callable[[str], None] = print) -> pathlib.Path:
    """The toy model folder, trained and saved first if it does not exist yet."""
    folder = model_dir(toy, out)
    if not is_model_folder(folder):
        log(f"toy model folder {folder} does not exist yet: training it first (seconds)")
        train_and_save(toy, folder, log)
    return folder


# --- CLI --------------------------------------------------------------------------------------


def add_train_toy_parser(subparsers) -> None:
    """Register `jaxinfer train-toy` on an argparse subparsers object."""
    p = subparsers.add_parser("train-toy", help="train the two-layer toy model (seconds, CPU)")
    p.add_argument("--config", default="configs/toy-two-layer.yaml", help="toy YAML config")
    p.add_argument("--out", help="output folder (default: the config's model folder)")
    p.set_defaults(func=cmd_train_toy)


def cmd_train_toy(args) -> int:
    """Train and save; exit code 0, or 1 when the target continuation is missed."""
    toy = ToyConfig.load(args.config)
    try:
        train_and_save(toy, model_dir(toy, args.out))
    except RuntimeError as e:
        print(f"jaxinfer train-toy: {e}", file=sys.stderr)
        return 1
    return 0
