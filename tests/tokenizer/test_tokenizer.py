"""Tests for jaxinfer.tokenizer.tokenizer: ids vs Hugging Face, chat templates, BOS, EOS,
the converted-tokenizer cache, and exact streaming detokenization.

Fast tests use tiny tokenizers trained here (a byte-level BPE, a
Llama-2-style SentencePiece BPE with byte fallback and a Strip decoder) and a
tiny GGUF written with the `gguf` package. Tests marked `slow` use the real
SmolLM2-135M-Instruct and Gemma-3-270m GGUFs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import random
import time

import numpy as np
import pytest

from jaxinfer.tokenizer.gguf import read_gguf_tokenizer_scalars
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    HAVE_HYPOTHESIS = True
except ImportError:  # hypothesis is optional: the seeded-random tests cover the same ground
    HAVE_HYPOTHESIS = False

FFFD = "\ufffd"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\n\nline five\n",
    "\n",
    "tabs\tand\r\nCRLF",
    "你好，世界",
    "😀👍🏽",
    "Mixed: English, 中文 (Chinese), emoji 🎉🇫🇷, accents: café naïve Ωμέγα, math ∑x²",
    "code: def f(x):\n    return x ** 2  # comment",
    "numbers 1234567890 3.14159 -42",
    "",
]

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Hello again!",
    "你好，世界！ 中文文本 你好 世界",
    "emoji 😀 👍🏽 🎉 and accents café naïve",
    "  spaces\n\nnewlines\tTabs and code: def f(x): return x",
] * 10


# ----- helpers ------------------------------------------------------------

def random_chunks(rng: random.Random, n: int) -> list[int]:
    """Chunk sizes summing to n: mostly 1-3, sometimes 0 (empty push) or large."""
    sizes, total = [], 0
    while total < n:
        size = rng.choice([0, 1, 1, 1, 2, 3, 5, rng.randint(1, max(1, n))])
        size = min(size, n - total)
        sizes.append(size)
        total += size
    return sizes


def stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool = True) -> list[str]:
    """Push ids in chunks of `sizes`; return the pieces (flush last).

    Checks liveness on the way: whenever the decode of the ids so far is final
    (its last kept token is not a byte-fallback token and it does not end in
    U+FFFD), everything of it has been emitted.
    """
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, pos = [], 0
    for size in sizes:
        pieces.append(detok.push(ids[pos:pos + size]))
        pos += size
        kept = [i for i in ids[:pos] if not (skip and i in tok.special_token_ids)]
        so_far = tok.decode(ids[:pos], skip_special_tokens=skip)
        if kept and kept[-1] not in tok._byte_ids and not so_far.endswith(FFFD):
            assert "".join(pieces) == so_far
    pieces.append(detok.flush())
    return pieces


def check_stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool = True) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    pieces = stream(tok, ids, sizes, skip)
    assert "".join(pieces) == full
    pos = 0
    for piece in pieces:           # a U+FFFD only where the full decode has one
        for k, ch in enumerate(piece):
            if ch == FFFD:
                assert full[pos + k] == FFFD
        pos += len(piece)


def random_ids(rng: random.Random, tok: Tokenizer, n: int, text_ids: list[int]) -> list[int]:
    """Random ids mixing the whole vocab, byte-fallback tokens, specials and text tokens."""
    pools = [list(range(tok.vocab_size)), sorted(tok._byte_ids), sorted(tok.special_token_ids),
             text_ids]
    pools = [p for p in pools if p]
    return [rng.choice(rng.choice(pools)) for _ in range(n)]


# ----- tiny tokenizers built here -----------------------------------------

def _merges(model_json) -> list[tuple[str, str]]:
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model_json["merges"]]


@functools.lru_cache(maxsize=None)
def bytelevel_hf():
    """GPT-2-style byte-level BPE (like SmolLM2), as a transformers tokenizer."""
    from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>")


@functools.lru_cache(maxsize=None)
def sentencepiece_hf():
    """Llama-2-style BPE: "▁" spaces, byte fallback, decoder ends with Strip(" ", 1, 0), adds BOS."""
    from tokenizers import (AddedToken, Tokenizer as RustTokenizer, decoders, models, normalizers,
                            processors, trainers)
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = RustTokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = norm
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=40, show_progress=False)
    base.train_from_iterator(CORPUS, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=_merges(model), unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<end_of_turn>")])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def tiny_tokenizers() -> dict[str, Tokenizer]:
    return {"bytelevel": Tokenizer(bytelevel_hf()[1], source="bytelevel"),
            "sentencepiece": Tokenizer(sentencepiece_hf()[1], source="sentencepiece")}


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_STYLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                        "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
NO_BOS_TEMPLATE = GEMMA_STYLE_TEMPLATE.replace("{{ bos_token }}", "")
DOUBLE_BOS_TEMPLATE = "{{ bos_token }}" + GEMMA_STYLE_TEMPLATE

MESSAGES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "你好 😀"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": " leading space and\nnewline"}],
]


def write_tiny_gguf(path: pathlib.Path, *, eot_token_id: int | None = None) -> None:
    """A one-tensor llama GGUF whose tokenizer is the tiny byte-level BPE above."""
    import gguf

    rust, _ = bytelevel_hf()
    model = json.loads(rust.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for token, i in model["vocab"].items():
        tokens[i] = token
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in _merges(model)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)                          # <|endoftext|>
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----- fast tests: tiny tokenizers ----------------------------------------

@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_tiny_encode_decode_match_hf(kind):
    tok = tiny_tokenizers()[kind]
    hf = tok.hf_tokenizer
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(200):
        ids = random_ids(rng, tok, rng.randint(0, 30), tok.encode(TEXTS[10]))
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip,
                                                      clean_up_tokenization_spaces=False)


def test_tiny_properties():
    bl, sp = tiny_tokenizers()["bytelevel"], tiny_tokenizers()["sentencepiece"]
    assert not bl.add_bos and bl._byte_ids == frozenset()
    assert sp.add_bos and sp.bos_token_id == sp.encode("x")[0]
    assert sp.encode("x").count(sp.bos_token_id) == 1
    assert len(sp._byte_ids) == 256
    assert sp.eos_token_ids == {sp.hf_tokenizer.convert_tokens_to_ids("</s>")}
    # SentencePiece-style decoders strip the first space of a whole decode ...
    assert sp.decode(sp.encode("Hello")) == "Hello"
    # ... and a mid-sequence space must survive streaming (checked in the stream tests).
    assert sp.decode(sp.encode("a b")) == "a b"


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
@pytest.mark.parametrize("skip", [True, False])
def test_tiny_stream_texts(kind, skip):
    tok = tiny_tokenizers()[kind]
    rng = random.Random(1)
    for text in TEXTS + ["".join(TEXTS)]:
        ids = tok.encode(text)
        check_stream(tok, ids, [1] * len(ids), skip)       # one token at a time
        check_stream(tok, ids, [len(ids)], skip)            # all at once
        for _ in range(20):
            check_stream(tok, ids, random_chunks(rng, len(ids)), skip)


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
@pytest.mark.parametrize("skip", [True, False])
def test_tiny_stream_random_ids(kind, skip):
    tok = tiny_tokenizers()[kind]
    rng = random.Random(2)
    text_ids = tok.encode(TEXTS[10], add_special_tokens=False)
    for _ in range(300):
        ids = random_ids(rng, tok, rng.randint(0, 40), text_ids)
        check_stream(tok, ids, random_chunks(rng, len(ids)), skip)


def test_stream_holds_back_partial_characters():
    sp = tiny_tokenizers()["sentencepiece"]
    byte = {b: sp.hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    a = sp.encode("a", add_special_tokens=False)
    emoji = [byte[b] for b in "😀".encode()]                # F0 9F 98 80
    detok = IncrementalDetokenizer(sp)
    assert detok.push(a) == "a"
    assert [detok.push([i]) for i in emoji] == ["", "", "", ""]   # a byte run may still grow
    assert detok.push(a) == "😀 a"                            # "▁a" mid-sequence keeps its space
    assert detok.flush() == ""
    # An incomplete run stays U+FFFD (one per byte, as ByteFallback decodes it) and comes out at flush.
    detok = IncrementalDetokenizer(sp)
    assert detok.push(a + emoji[:2]) == "a"
    assert detok.flush() == FFFD * 2 == sp.decode(a + emoji[:2])[1:]
    # Byte-level BPE: a character split over tokens is held until complete.
    bl = tiny_tokenizers()["bytelevel"]
    ids = bl.encode("😀👍🏽")
    detok = IncrementalDetokenizer(bl)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert all(FFFD not in p for p in pieces) and "".join(pieces) == "😀👍🏽"


def test_stream_keeps_space_after_skipped_special():
    sp = tiny_tokenizers()["sentencepiece"]
    eot = sp.hf_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    ids = sp.encode("Hi") + [eot] + sp.encode("there", add_special_tokens=False)   # "▁there"
    full = sp.decode(ids)
    assert full == "Hi there"
    detok = IncrementalDetokenizer(sp)
    assert "".join([detok.push([i]) for i in ids] + [detok.flush()]) == full


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_stream_decodes_bounded_windows(kind):
    tok = tiny_tokenizers()[kind]
    ids = tok.encode("".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(tok)
    windows = []
    real_decode = detok._decode
    detok._decode = lambda part: windows.append(len(part)) or real_decode(part)
    text = "".join([detok.push([i]) for i in ids] + [detok.flush()])
    assert text == tok.decode(ids)
    assert len(ids) > 1000
    assert max(windows) <= 32                       # two groups (a byte run like "😀👍🏽" is one), not everything
    assert sum(windows) <= 8 * len(ids)             # linear, not quadratic


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
def test_stream_full_decode_fallback_is_exact(kind):
    tok = tiny_tokenizers()[kind]
    rng = random.Random(6)
    text_ids = tok.encode(TEXTS[10], add_special_tokens=False)
    for _ in range(100):
        ids = random_ids(rng, tok, rng.randint(0, 30), text_ids)
        detok = IncrementalDetokenizer(tok)
        detok._full_mode = True                     # the path taken for decoders the window method does not model
        pieces, pos = [], 0
        for size in random_chunks(rng, len(ids)):
            pieces.append(detok.push(ids[pos:pos + size]))
            pos += size
        assert "".join(pieces) + detok.flush() == tok.decode(ids)


if HAVE_HYPOTHESIS:
    _text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(["bytelevel", "sentencepiece"]), text=_text,
           sizes=st.lists(st.integers(0, 6), max_size=60), skip=st.booleans())
    def test_hypothesis_stream_text(kind, text, sizes, skip):
        tok = tiny_tokenizers()[kind]
        ids = tok.encode(text)
        sizes = sizes + [len(ids)]                           # the rest in one push
        check_stream(tok, ids, sizes, skip)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(["bytelevel", "sentencepiece"]), data=st.data(),
           sizes=st.lists(st.integers(0, 6), max_size=60), skip=st.booleans())
    def test_hypothesis_stream_random_ids(kind, data, sizes, skip):
        tok = tiny_tokenizers()[kind]
        byte_ids = sorted(tok._byte_ids) or [0]
        special = sorted(tok.special_token_ids)
        one_id = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(byte_ids),
                           st.sampled_from(special))
        ids = data.draw(st.lists(one_id, max_size=40))
        check_stream(tok, ids, sizes + [len(ids)], skip)


def test_input_validation():
    tok = tiny_tokenizers()["bytelevel"]
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(TypeError):
        tok.encode(None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([0, tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode([[1, 2]])
    with pytest.raises(TypeError):
        tok.decode([1.5])
    assert tok.decode([]) == ""
    assert tok.decode(np.array(tok.encode("Hello"), np.int32)) == "Hello"
    detok = IncrementalDetokenizer(tok)
    with pytest.raises(ValueError):
        detok.push([tok.vocab_size + 5])
    assert detok.push(np.int64(tok.encode("H")[0])) == "H"      # a bare id is accepted
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push([1])
    assert detok.flush() == ""


def test_chat_single_bos_with_explicit_templates():
    sp = tiny_tokenizers()["sentencepiece"]
    bos = sp.bos_token_id
    msgs = MESSAGES[0]
    for template in (GEMMA_STYLE_TEMPLATE, NO_BOS_TEMPLATE, DOUBLE_BOS_TEMPLATE):
        ids = sp.apply_chat_template(msgs, chat_template=template)
        assert ids[0] == bos and ids.count(bos) == 1
        assert ids[1:] == sp.encode(sp.render_chat(msgs, chat_template=template).replace("<s>", ""),
                                    add_special_tokens=False)
    assert not sp.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        sp.apply_chat_template(msgs)
    with pytest.raises(ValueError):
        sp.apply_chat_template([], chat_template=GEMMA_STYLE_TEMPLATE)


def test_hf_folder(tmp_path):
    _, hf = bytelevel_hf()
    hf.chat_template = CHAT_TEMPLATE
    try:
        hf.save_pretrained(tmp_path)
    finally:
        hf.chat_template = None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    for tok in (Tokenizer.from_pretrained(tmp_path), Tokenizer.from_source(tmp_path)):
        assert tok.has_chat_template
        im_end = tok.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tok.eos_token_ids == {0, 2, im_end}
        for msgs in MESSAGES:
            ids = tok.apply_chat_template(msgs)
            assert ids == hf.apply_chat_template(msgs, chat_template=CHAT_TEMPLATE, tokenize=True,
                                                 return_dict=False, add_generation_prompt=True)
            header = tok.encode("<|im_start|>assistant\n")
            assert ids[-len(header):] == header
        for text in TEXTS:
            assert tok.encode(text) == hf.encode(text)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_gguf_scalars_and_cache(tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    im_end = bytelevel_hf()[0].token_to_id("<|im_end|>")
    write_tiny_gguf(gguf_path, eot_token_id=im_end)
    scalars = read_gguf_tokenizer_scalars(gguf_path)
    assert scalars["tokenizer.ggml.model"] == "gpt2"
    assert scalars["tokenizer.ggml.eos_token_id"] == 0
    assert scalars["tokenizer.ggml.eot_token_id"] == im_end
    assert scalars["tokenizer.ggml.add_bos_token"] is False
    assert scalars["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert "tokenizer.ggml.tokens" not in scalars              # arrays are skipped

    from jaxinfer.tokenizer import gguf as gguf_tokenizer

    cache = tmp_path / "cache"
    conversions, loads = [], []
    real_convert, real_load = gguf_tokenizer.convert_gguf_tokenizer, AutoTokenizer.from_pretrained
    monkeypatch.setattr(gguf_tokenizer, "convert_gguf_tokenizer",
                        lambda p, r: conversions.append(p.name) or real_convert(p, r))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: loads.append(k.get("gguf_file")) or real_load(*a, **k))
    cold = Tokenizer.from_gguf(gguf_path, cache_dir=cache)
    warm = Tokenizer.from_gguf(gguf_path, cache_dir=cache)
    assert conversions == ["tiny.gguf"]                        # converted once, then loaded from the
    assert loads == []                                         # cache folder by its own class
    slots = list((cache / "tokenizers").iterdir())
    assert len(slots) == 1 and (slots[0] / "jaxinfer_tokenizer.json").is_file()
    fresh = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert warm._hf is None                                    # no transformers tokenizer built ...
    assert warm.special_tokens == cold.special_tokens == fresh.special_tokens_map
    assert warm.chat_template == cold.chat_template == CHAT_TEMPLATE
    assert warm.backend.to_str() == fresh.backend_tokenizer.to_str()
    assert_same_hf_tokenizer(cold.hf_tokenizer, fresh)
    assert type(warm.hf_tokenizer) is type(fresh)
    for tok in (cold, warm):
        assert tok.eos_token_ids == {0, im_end}                # GGUF eos + eot (+ template's <|im_end|>)
        assert tok.has_chat_template and not tok.add_bos
        for text in TEXTS:
            assert tok.encode(text) == fresh.encode(text)
        for msgs in MESSAGES:
            assert tok.apply_chat_template(msgs) == fresh.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    # A changed file (new mtime) gets a new cache slot.
    st_ = gguf_path.stat()
    os.utime(gguf_path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    Tokenizer.from_gguf(gguf_path, cache_dir=cache)
    assert len(list((cache / "tokenizers").iterdir())) == 2
    # from_source: a file, or a folder holding exactly one .gguf.
    assert Tokenizer.from_source(gguf_path, cache_dir=cache).encode("Hi") == fresh.encode("Hi")
    assert Tokenizer.from_source(tmp_path, cache_dir=cache).encode("Hi") == fresh.encode("Hi")
    # A damaged cache entry is replaced, with a warning.
    from jaxinfer.tokenizer.cache import slot as cache_slot
    slot = cache_slot(gguf_path.resolve(), cache)
    assert (slot / "jaxinfer_tokenizer.json").is_file()
    (slot / "tokenizer.json").write_text("{broken")
    with caplog.at_level(logging.WARNING, "jaxinfer.tokenizer.tokenizer"):
        assert Tokenizer.from_gguf(gguf_path, cache_dir=cache).encode("Hi") == fresh.encode("Hi")
    [record] = caplog.records
    assert record.getMessage().startswith(f"jaxinfer tokenizer cache: ignoring unreadable {slot}: ")
    assert record.getMessage().endswith("; converting again")
    assert Tokenizer.from_gguf(gguf_path, cache_dir=cache).encode("Hi") == fresh.encode("Hi")
    # cache=False converts again and writes nothing.
    Tokenizer.from_gguf(gguf_path, cache=False, cache_dir=tmp_path / "unused")
    assert not (tmp_path / "unused").exists()


def test_cached_gguf_tokenizer_loads_without_transformers(tmp_path):
    """A cached load reads tokenizer.json with `tokenizers` and renders with jinja2:
    a fresh interpreter encodes and renders a chat prompt without importing transformers."""
    import subprocess
    import sys

    gguf_path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(gguf_path)
    cold = Tokenizer.from_gguf(gguf_path, cache_dir=cache)
    code = ("import json, sys\n"
            "from jaxinfer.tokenizer import Tokenizer\n"
            "tok = Tokenizer.from_gguf(sys.argv[1], cache_dir=sys.argv[2])\n"
            "print(json.dumps([tok.encode(sys.argv[3]), tok.apply_chat_template(json.loads(sys.argv[4])),"
            " sorted(tok.eos_token_ids), 'transformers' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(cache), TEXTS[10],
                          json.dumps(MESSAGES[2])], check=True, capture_output=True, text=True)
    ids, chat_ids, eos, imported = json.loads(out.stdout)
    assert ids == cold.encode(TEXTS[10]) and chat_ids == cold.apply_chat_template(MESSAGES[2])
    assert eos == sorted(cold.eos_token_ids)
    assert imported is False


def test_cache_dir_env(monkeypatch, tmp_path):
    from jaxinfer.tokenizer.cache import cache_root

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "a"))
    assert cache_root(None) == tmp_path / "a"
    monkeypatch.delenv("JAXINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root(None) == tmp_path / "x" / "jaxinfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(None) == pathlib.Path.home() / ".cache" / "jaxinfer"
    assert cache_root(tmp_path / "b") == tmp_path / "b"


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_source(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_source(tmp_path)                         # empty folder
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just some bytes here")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_tokenizer_scalars(bad)
    with pytest.raises(ValueError):
        Tokenizer.from_gguf(bad, cache=False)


def test_gguf_tokenizer_metadata(tmp_path):
    """The values the conversion reads come from gguf.GGUFReader as Python values."""
    from jaxinfer.checkpoint.gguf import open_reader
    from jaxinfer.tokenizer.gguf import eos_token_ids, tokenizer_metadata, tokenizer_scalars

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, eot_token_id=5)
    reader = open_reader(path)
    meta = tokenizer_metadata(reader)
    model = json.loads(bytelevel_hf()[0].to_str())["model"]
    assert meta["tokenizer.ggml.tokens"] == sorted(model["vocab"], key=model["vocab"].get)
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in _merges(model)]
    assert meta["general.architecture"] == "llama" and "llama.block_count" not in meta
    scalars = tokenizer_scalars(reader)
    assert scalars["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.token_type" not in scalars
    assert eos_token_ids(reader) == [0, 5]                      # eos, then eot
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match="is not a GGUF file"):
        open_reader(truncated)


def assert_same_hf_tokenizer(ours, hf) -> None:
    """`ours` is the tokenizer `hf` (a fresh AutoTokenizer from the GGUF) is: same class,
    same Rust tokenizer, same special tokens, flags, chat template and init kwargs."""
    assert type(ours) is type(hf)
    assert ours.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.added_tokens_decoder == hf.added_tokens_decoder
    assert ours.chat_template == hf.chat_template
    assert ours.init_kwargs == hf.init_kwargs
    for attr in ("add_bos_token", "add_eos_token", "padding_side", "model_max_length"):
        assert getattr(ours, attr) == getattr(hf, attr), attr


# Builds a GGUF tokenizer in a fresh interpreter where `import torch` fails (as when torch
# is not installed: transformers' availability check sees it missing too), then prints
# what the parent compares with a fresh HF AutoTokenizer (which needs torch).
TORCH_BLOCKED = r"""
import hashlib, json, sys
sys.modules["torch"] = None
from jaxinfer.tokenizer.tokenizer import Tokenizer
tok = Tokenizer.from_gguf(sys.argv[1], cache=False)
texts = json.load(sys.stdin)
hf = tok.hf_tokenizer
print(json.dumps({
    "ids": [tok.encode(t) for t in texts],
    "class": type(hf).__name__,
    "backend_sha256": hashlib.sha256(hf.backend_tokenizer.to_str().encode()).hexdigest(),
    "torch_modules": sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "torch" and v),
}))
"""


def build_without_torch(path: pathlib.Path, texts: list[str]) -> dict:
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", TORCH_BLOCKED, str(path)], input=json.dumps(texts),
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_torch_free_build(path: pathlib.Path, hf=None) -> None:
    """Our tokenizer for `path` built without torch equals `hf`, a fresh AutoTokenizer
    from the same GGUF (made here when not given)."""
    import hashlib

    pytest.importorskip("torch")                              # the HF reference path needs torch
    from transformers import AutoTokenizer

    texts = TEXTS + ["".join(TEXTS), "<|im_start|>user\nhi<|im_end|>", "<bos><end_of_turn>x"]
    got = build_without_torch(path, texts)
    if hf is None:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert got["torch_modules"] == []
    assert got["class"] == type(hf).__name__
    assert got["backend_sha256"] == hashlib.sha256(hf.backend_tokenizer.to_str().encode()).hexdigest()
    assert got["ids"] == [hf.encode(t) for t in texts]


def test_gguf_tokenizer_without_torch(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    check_torch_free_build(path)


# ----- slow tests: the real GGUF tokenizers ---------------------------------

MODELS = {
    "smollm2": ("smollm2-135m-instruct", "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": ("gemma3-270m", "/tmp/models/gemma-3-270m-q4_k_m.gguf"),
}
TIMINGS: dict[str, dict[str, float]] = {}


def model_path(key: str) -> pathlib.Path:
    name, fallback = MODELS[key]
    try:
        from jaxinfer.checkpoint.sources import resolve_model
        path = pathlib.Path(resolve_model(name))
        if path.is_file():
            return path
    except Exception:
        pass
    if pathlib.Path(fallback).is_file():
        return pathlib.Path(fallback)
    pytest.skip(f"{key} GGUF not available (resolve_model({name!r}) failed and no {fallback})")


@pytest.fixture(scope="session")
def real(tmp_path_factory):
    """Per model: (fresh HF tokenizer, our tokenizer converted cold, ours loaded from cache)."""
    from transformers import AutoTokenizer

    cache = tmp_path_factory.mktemp("tokenizer-cache")
    loaded = {}

    def get(key):
        if key not in loaded:
            path = model_path(key)
            t0 = time.perf_counter()
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            t1 = time.perf_counter()
            cold = Tokenizer.from_gguf(path, cache_dir=cache)
            t2 = time.perf_counter()
            warm = Tokenizer.from_gguf(path, cache_dir=cache)
            t3 = time.perf_counter()
            TIMINGS[key] = {"hf_fresh_s": t1 - t0, "cold_s": t2 - t1, "cached_s": t3 - t2}
            print(f"\n{key} tokenizer load times: {TIMINGS[key]}")
            loaded[key] = (hf, cold, warm)
        return loaded[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_real_ids_match_hf(real, key):
    hf, cold, warm = real(key)
    for text in TEXTS + ["".join(TEXTS), "<|im_start|>user\nhi<|im_end|>", "<bos><end_of_turn>x"]:
        for special in (True, False):
            want = hf.encode(text, add_special_tokens=special)
            assert cold.encode(text, special) == want, text
            assert warm.encode(text, special) == want, text


@pytest.mark.slow
def test_real_smollm2_known_ids(real):
    _, tok, _ = real("smollm2")
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("你好，世界") == [18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230]
    assert tok.encode("😀👍🏽") == [10813, 242, 218, 10813, 235, 231, 10813, 233, 138]
    assert tok.encode("  leading") == [216, 2899]


@pytest.mark.slow
def test_real_gemma3_known_ids(real):
    _, tok, _ = real("gemma3")
    assert tok.encode("Hello world") == [2, 9259, 1902]
    assert tok.encode("你好，世界") == [2, 144626, 236900, 12811]
    assert tok.encode("😀👍🏽") == [2, 242398, 240493, 242713]
    # Gemma's decoder has no Strip: a leading space survives decoding.
    assert tok.decode(tok.encode(" Hello", add_special_tokens=False)) == " Hello"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_real_properties(real, key):
    hf, cold, warm = real(key)
    path = model_path(key)
    scalars = read_gguf_tokenizer_scalars(path)
    expected = {
        # SmolLM2's GGUF: bos id 1 is <|im_start|> (not used: add_bos_token false), eos id 2 is
        # <|im_end|>, pad is <|im_end|> too; <|endoftext|> (id 0) is the unknown token, not an EOS.
        "smollm2": dict(vocab_size=49152, bos=1, add_bos=False, eos={2}, pad=2, template=True),
        "gemma3": dict(vocab_size=262144, bos=2, add_bos=True, eos={1}, pad=0, template=False),
    }[key]
    assert_same_hf_tokenizer(cold.hf_tokenizer, hf)
    assert type(warm.hf_tokenizer) is type(hf)
    assert warm.hf_tokenizer.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    for tok in (cold, warm):
        assert tok.vocab_size == len(hf) == expected["vocab_size"]
        assert tok.bos_token_id == expected["bos"] == scalars["tokenizer.ggml.bos_token_id"]
        assert tok.add_bos == expected["add_bos"] == scalars["tokenizer.ggml.add_bos_token"]
        assert tok.eos_token_ids == expected["eos"]
        assert scalars["tokenizer.ggml.eos_token_id"] in tok.eos_token_ids
        assert hf.eos_token_id in tok.eos_token_ids
        assert tok.pad_token_id == expected["pad"]
        assert tok.has_chat_template == expected["template"]
    if key == "smollm2":
        assert hf.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        assert hf.eos_token == "<|im_end|>" and hf.unk_token == "<|endoftext|>"
    else:
        assert hf.convert_ids_to_tokens([0, 1, 2, 106]) == ["<pad>", "<eos>", "<bos>", "<end_of_turn>"]


@pytest.mark.slow
def test_real_smollm2_chat_matches_hf(real):
    hf, cold, warm = real("smollm2")
    header = cold.encode("<|im_start|>assistant\n")
    for msgs in MESSAGES:
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        for tok in (cold, warm):
            ids = tok.apply_chat_template(msgs)
            assert ids == want
            assert ids[-len(header):] == header == [1, 520, 9531, 198]
            assert ids.count(2) == len(msgs) + (msgs[0]["role"] != "system")   # one <|im_end|> per turn
    text = cold.render_chat(MESSAGES[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_real_gemma3_chat(real):
    hf, cold, warm = real("gemma3")
    with pytest.raises(ValueError, match="no chat template"):
        cold.apply_chat_template(MESSAGES[0])
    for tok in (cold, warm):
        for template in (GEMMA_STYLE_TEMPLATE, NO_BOS_TEMPLATE, DOUBLE_BOS_TEMPLATE):
            for msgs in MESSAGES:
                ids = tok.apply_chat_template(msgs, chat_template=template)
                assert ids[0] == 2 and ids.count(2) == 1
                assert ids[-3:] == [105, 4368, 107]             # <start_of_turn>model\n
        want = hf.apply_chat_template(MESSAGES[1], chat_template=GEMMA_STYLE_TEMPLATE,
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.apply_chat_template(MESSAGES[1], chat_template=GEMMA_STYLE_TEMPLATE) == want


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_real_decode_matches_hf(real, key):
    hf, tok, _ = real(key)
    rng = random.Random(3)
    text_ids = tok.encode(TEXTS[10], add_special_tokens=False)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for _ in range(300):
        ids = random_ids(rng, tok, rng.randint(0, 30), text_ids)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip,
                                                      clean_up_tokenization_spaces=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_real_stream(real, key):
    _, tok, _ = real(key)
    rng = random.Random(4)
    for text in TEXTS + ["".join(TEXTS)]:
        ids = tok.encode(text)
        check_stream(tok, ids, [1] * len(ids))
        for _ in range(10):
            check_stream(tok, ids, random_chunks(rng, len(ids)), skip=rng.random() < 0.5)
    text_ids = tok.encode(TEXTS[10], add_special_tokens=False)
    for _ in range(300):
        ids = random_ids(rng, tok, rng.randint(0, 40), text_ids)
        check_stream(tok, ids, random_chunks(rng, len(ids)), skip=rng.random() < 0.5)


@pytest.mark.slow
def test_real_gemma3_byte_fallback_stream(real):
    _, tok, _ = real("gemma3")
    byte = {b: tok.hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    assert len(tok._byte_ids) == 256 and set(byte.values()) == tok._byte_ids
    hi = tok.encode(" hi", add_special_tokens=False)
    emoji = [byte[b] for b in "🦜".encode()]
    cases = [
        hi + emoji + hi,                      # a character spelled with <0xF0><0x9F>...
        emoji[:3] + hi,                       # truncated run then text: 3 x U+FFFD
        hi + [byte[0xF0]],                    # ends inside a character
        [byte[0x80]] + hi + emoji + [byte[0x80]] + hi,   # an invalid run poisons the whole run
    ]
    for ids in cases:
        for sizes in ([1] * len(ids), [len(ids)], [2] * len(ids)):
            check_stream(tok, ids, sizes)
    assert tok.decode(hi + emoji + hi) == " hi🦜 hi"
    assert tok.decode(emoji[:3] + hi) == FFFD * 3 + " hi"
    rng = random.Random(5)
    for _ in range(300):
        pool = sorted(tok._byte_ids) + hi + [2, 106]
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        check_stream(tok, ids, random_chunks(rng, len(ids)), skip=rng.random() < 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_real_tokenizer_without_torch(real, key):
    """The real GGUF tokenizers, built with `import torch` failing, equal HF's (built with torch)."""
    check_torch_free_build(model_path(key), hf=real(key)[0])
