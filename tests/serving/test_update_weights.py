"""Live weights, pausing and sleeping (#54 items 1, 2; `LLM.update_weights`,
`pause` / `resume`, `sleep` / `wake_up`), on the tiny Llama (float32 and
q4 weights) and the brought NNX model of examples/byo_model.py: an update
serves exactly what a fresh LLM of the new params serves and compiles
nothing; a mismatch is refused naming the leaf, the old weights serving
on; requests in flight finish or end with "abort"; waking serves the same
tokens as before sleeping."""

from __future__ import annotations

import dataclasses
import gc
import pathlib
import threading
import time
import tracemalloc

import jax
import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.serving import update_parts
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import import_python_file
from jaxinfer.serving.request import Request
from jaxinfer.serving.thread import EngineError, EngineThread
from jaxinfer.weights import quant
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.weights.quant import with_activations
from tiny import TINY_LLAMA, random_params

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
NEW = 6
SETTINGS = dict(max_seq_len=128, max_num_seqs=2, prefill_chunk_size=8)
LONG = 110          # tokens of a request a pause ("abort") must catch running
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "byo_model.py"


def _tokens(llm, prompts=PROMPTS):
    return [c.token_ids for c in llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)]


def _perturbed(params, seed=1, scale=0.5):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda w: np.asarray(w) + scale * rng.standard_normal(np.shape(w)).astype(
        np.asarray(w).dtype), params)


@pytest.fixture(scope="module")
def raw():
    return random_params(TINY_LLAMA, seed=2)


@pytest.fixture(scope="module")
def llm(raw):
    llm = LLM(TINY_LLAMA, raw, **SETTINGS)
    _tokens(llm)            # compiled
    return llm


def test_same_params_serve_the_same_tokens_and_compile_nothing(llm, raw):
    before = _tokens(llm)
    compiles = llm.programs.num_compiles
    llm.update_weights(raw)
    assert _tokens(llm) == before
    assert llm.programs.num_compiles == compiles


def test_perturbed_params_serve_what_a_fresh_llm_serves(llm, raw):
    new = _perturbed(raw)
    compiles = llm.programs.num_compiles
    try:
        llm.update_weights(new)
        assert llm.programs.num_compiles == compiles
        got = _tokens(llm)
        assert got == _tokens(LLM(TINY_LLAMA, new, **SETTINGS))
        assert got != _tokens(LLM(TINY_LLAMA, raw, **SETTINGS))
    finally:
        llm.update_weights(raw)


def _hf_tensors(params, config):
    """The Hugging Face-named tensors (nn.Linear [out, in]) of `random_params`."""
    d = config.hidden_size
    out = {"model.embed_tokens.weight": params["embed_tokens"], "model.norm.weight": params["norm"]}
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
             "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
             "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
             "input_layernorm": "input_layernorm",
             "post_attention_layernorm": "post_attention_layernorm"}
    for key, name in names.items():
        for i, w in enumerate(params["layers"][key]):
            if key in ("q_proj", "k_proj", "v_proj"):
                w = w.reshape(d, -1).T
            elif key == "o_proj":
                w = w.reshape(-1, d).T
            elif key != name:          # gate, up, down: [in, out] -> [out, in]
                w = w.T
            out[f"model.layers.{i}.{name}.weight"] = np.ascontiguousarray(w)
    return out


def test_hugging_face_named_tensors_and_jax_arrays_are_taken(llm, raw):
    new = _perturbed(raw, seed=3)
    want = _tokens(LLM(TINY_LLAMA, new, **SETTINGS))
    try:
        llm.update_weights(_hf_tensors(new, TINY_LLAMA))
        assert _tokens(llm) == want
        llm.update_weights(raw)
        as_jax = jax.tree.map(jax.numpy.asarray, new)
        llm.update_weights(as_jax)
        assert _tokens(llm) == want
        as_jax["norm"].delete()                  # what was given is not kept (e.g. donated later)
        assert _tokens(llm) == want
    finally:
        llm.update_weights(raw)


def _edit(params, path, value):
    out = dict(params, layers=dict(params["layers"]))
    where = out["layers"] if path in out["layers"] else out
    if value is None:
        del where[path]
    else:
        where[path] = value
    return out


@pytest.mark.parametrize("path, value, message", [
    ("q_proj", lambda w: w[:, :, :2], r"params\['layers'\]\['q_proj'\] has shape \(3, 32, 2, 8\), "
                                      r"expected \(3, 32, 4, 8\)"),
    ("norm", lambda w: w.astype(np.int32), r"params\['norm'\] has dtype int32"),
    ("down_proj", None, r"params\['layers'\]\['down_proj'\] is missing"),
    ("lm_head", lambda w: np.zeros((32, 97), np.float32),
     r"params\['lm_head'\] is not a param of this model"),
])
def test_a_mismatch_is_refused_naming_the_leaf_and_the_old_weights_serve_on(llm, raw, path, value,
                                                                             message):
    before = _tokens(llm)
    ref = raw["layers"].get(path, raw.get(path, None))
    bad = _edit(_perturbed(raw), path, None if value is None else value(ref))
    with pytest.raises(ValueError, match=message):
        llm.update_weights(bad)
    assert not llm.is_paused
    assert _tokens(llm) == before


def test_a_mismatched_hugging_face_tensor_is_refused_by_name(llm, raw):
    tensors = _hf_tensors(raw, TINY_LLAMA)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:5]
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \(5, 32\)"):
        llm.update_weights(tensors)
    tensors = _hf_tensors(raw, TINY_LLAMA)
    tensors["model.layers.7.mlp.up_proj.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="'model.layers.7.mlp.up_proj.weight' is not a tensor"):
        llm.update_weights(tensors)


@pytest.mark.parametrize("weights", ["q4", "int8"])
def test_quantized_weights_are_quantized_again_as_loading_does(raw, weights):
    q4 = LLM(TINY_LLAMA, prepare_params(raw, TINY_LLAMA, weights=weights), **SETTINGS)
    assert q4.weights_format == weights
    before = _tokens(q4)
    compiles = q4.programs.num_compiles
    q4.update_weights(raw)
    assert _tokens(q4) == before
    new = _perturbed(raw)
    q4.update_weights(new)
    assert q4.programs.num_compiles == compiles
    fresh = LLM(TINY_LLAMA, prepare_params(new, TINY_LLAMA, weights=weights), **SETTINGS)
    assert _tokens(q4) == _tokens(fresh)


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("weights", ["float32", "q4"])
def test_an_update_holds_about_one_layer_extra(raw, weights, monkeypatch):
    """Device bytes alive while each part's new arrays are made (the raw
    copy it was made from still alive), above those before the update: at
    most one layer's plus 1 KiB: for float32 the prepared layer or the float
    layer it was made from, for q4 the prepared (quantized) layer, the
    float layer being quantized a few columns at a time on the host; a
    whole-tree preparation holds about two copies of the model. The LM head
    and the q4 layer weights are made 48 columns at a time here (chunks
    that straddle q/k/v and gate/up, the head's last of one column): the
    params equal `prepare_params`' bit for bit."""
    monkeypatch.setattr(update_parts, "HEAD_COLUMNS", 48)
    monkeypatch.setattr(update_parts, "QUANTIZE_BYTES", 1)
    on_device = jax.tree.map(jax.numpy.asarray, raw)      # every serving leaf a device array
    llm = LLM(TINY_LLAMA, prepare_params(on_device, TINY_LLAMA, weights=weights), **SETTINGS)
    del on_device
    new = _perturbed(raw)
    gc.collect()
    base, peaks = _live_bytes(), []

    def spy(params, activations):         # called on each part (or the whole tree) once made
        peaks.append(_live_bytes() - base)
        return with_activations(params, activations)
    monkeypatch.setattr(quant, "with_activations", spy)
    llm.update_weights(new)
    layer = sum(x.nbytes for x in jax.tree.leaves(llm.params["layers"][0]))
    raw_layer = sum(w[0].nbytes for w in raw["layers"].values())
    bound = layer if weights == "q4" else max(layer, raw_layer)
    assert len(peaks) > TINY_LLAMA.num_layers                 # part by part
    assert max(peaks) <= bound + 1024, (peaks, layer, raw_layer)
    assert _live_bytes() == base                              # the old weights are gone
    want = prepare_params(new, TINY_LLAMA, weights=weights)
    assert jax.tree.structure(llm.params) == jax.tree.structure(
        with_activations(want, llm.activations))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(llm.params),
                                                    jax.tree.leaves(want)))


# SmolLM2's K (hidden 256 here, intermediate 1536: a down_proj chunk is one panel of 1536
# rows): a q4 layer of 880 KiB, so the swap's own host allocations are measured against it.
WIDE_LLAMA = dataclasses.replace(TINY_LLAMA, num_layers=2, hidden_size=256, head_dim=64,
                                 intermediate_size=1536)


def test_a_q4_update_holds_at_most_one_q4_layer_on_the_host_too():
    """The q4 swap's host bytes (numpy arrays and Python objects, as
    tracemalloc counts them: the float columns quantized, the checks before
    the swap, the buffers the new parts are made in where they come from
    the C heap) at their peak above those before the update, plus the live
    device bytes above the start when each part is made: at most one
    prepared q4 layer plus 32 KiB (Python objects the update makes and
    keeps: the new params' array and dict objects, 60-90 KiB measured of
    which the peak sees part). Measured after a first update (caches
    warm, the serving params made by the swap): 0.7 layers; 1.1 before the
    parts were made in memory maps of their own, quantized with one float
    temporary, and `quantized_shape` quantized a whole panel per check."""
    llm = LLM(WIDE_LLAMA, prepare_params(random_params(WIDE_LLAMA, seed=2), WIDE_LLAMA,
                                         weights="q4"), **SETTINGS)
    layer = sum(x.nbytes for x in jax.tree.leaves(llm.params["layers"][0]))
    new = random_params(WIDE_LLAMA, seed=3)
    tracemalloc.start()
    try:
        llm.update_weights(random_params(WIDE_LLAMA, seed=4))
        gc.collect()
        host, device, peaks = tracemalloc.get_traced_memory()[0], _live_bytes(), [0]

        def spy(params, activations):
            peaks.append(_live_bytes() - device)
            return with_activations(params, activations)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(quant, "with_activations", spy)
            tracemalloc.reset_peak()
            llm.update_weights(new)
            host_peak = tracemalloc.get_traced_memory()[1] - host
    finally:
        tracemalloc.stop()
    assert host_peak + max(peaks) <= layer + 32 * 1024, (host_peak, peaks, layer)
    want = prepare_params(new, WIDE_LLAMA, weights="q4")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(llm.params),
                                                    jax.tree.leaves(want)))


def test_a_brought_nnx_model_takes_its_own_params():
    byo = import_python_file(EXAMPLE)
    config, params, tok = byo.build()
    llm = LLM(config, params, tok, **SETTINGS)
    before = _tokens(llm)
    compiles = llm.programs.num_compiles
    llm.update_weights(params)
    assert _tokens(llm) == before
    new = byo.build(seed=1)[1]
    llm.update_weights(new)
    assert llm.programs.num_compiles == compiles
    assert _tokens(llm) == _tokens(LLM(config, new, tok, **SETTINGS))
    bad = jax.tree.map(lambda w: w, new)
    bad["blocks"][1]["wq"]["kernel"] = bad["blocks"][1]["wq"]["kernel"][:, :8]
    with pytest.raises(ValueError, match=r"\[1\]\['wq'\]\['kernel'\] has shape \(64, 8\)"):
        llm.update_weights(bad)


def _engine(llm):
    engine = EngineThread(llm.scheduler(2, decode_chunk=1))
    return engine.start()


def _requests(n=2, max_new_tokens=30):
    return [Request(tuple(p), SamplingParams(), max_new_tokens, ignore_eos=True)
            for p in PROMPTS[:n]]


def _finish(handle):
    events = list(handle)
    return sum((e.token_ids for e in events), []), events[-1].finish_reason


def test_pause_wait_and_abort_with_requests_in_flight(llm):
    engine = _engine(llm)
    try:
        handles = [engine.submit(r) for r in _requests()]
        while engine.steps < 3:
            time.sleep(0.01)
        llm.pause("wait")                   # both finish, all 30 tokens
        assert [_finish(h)[1] for h in handles] == ["length", "length"]
        held = engine.submit(_requests(1, 4)[0])    # waits for resume
        time.sleep(0.2)
        assert not held.finished and engine.scheduler.num_waiting == 0
        llm.resume()
        assert _finish(held)[1] == "length"

        steps = engine.steps
        handles = [engine.submit(r) for r in _requests(max_new_tokens=LONG)]
        while engine.steps < steps + 3:
            time.sleep(0.01)
        llm.pause("abort")
        results = [_finish(h) for h in handles]
        assert [r[1] for r in results] == ["abort", "abort"]
        assert all(len(r[0]) < LONG for r in results)
        llm.resume()
        assert _finish(engine.submit(_requests(1, 3)[0]))[1] == "length"
    finally:
        engine.stop()


def test_pause_abort_ends_an_offline_generate(llm):
    out = {}
    thread = threading.Thread(target=lambda: out.update(c=llm.generate(
        PROMPTS, max_new_tokens=LONG, ignore_eos=True)))
    thread.start()
    while llm.controls._active == 0 and thread.is_alive():
        time.sleep(0.001)
    llm.pause("abort")
    thread.join()
    llm.resume()
    assert {c.finish_reason for c in out["c"]} == {"abort"}
    assert _tokens(llm)                                   # serving again


def test_update_while_requests_run_lets_them_finish_then_serves_the_new_weights(llm, raw):
    new = _perturbed(raw, seed=5)
    want = _tokens(LLM(TINY_LLAMA, new, **SETTINGS))
    engine = _engine(llm)
    try:
        handles = [engine.submit(r) for r in _requests()]
        while engine.steps < 2:
            time.sleep(0.01)
        llm.update_weights(new)            # pauses (wait), swaps, resumes
        assert [_finish(h)[1] for h in handles] == ["length", "length"]
        assert not llm.is_paused
        got = [_finish(engine.submit(r))[0] for r in _requests(max_new_tokens=NEW)]
        assert got == want
    finally:
        engine.stop()
        llm.update_weights(raw)


def test_sleep_and_wake_up_serve_the_same_tokens_without_compiling(llm, raw):
    before = _tokens(llm)
    engine = _engine(llm)
    try:
        assert [_finish(engine.submit(r))[0] for r in _requests(max_new_tokens=NEW)] == before
        compiles = llm.programs.num_compiles        # the engine's programs are compiled now
        runner = engine.scheduler.runner
        pool = jax.tree.leaves(runner.cache)
        llm.sleep(1)
        assert llm.is_sleeping and all(x.is_deleted() for x in pool)
        with pytest.raises(RuntimeError, match=r"asleep .*wake_up\(\)"):
            llm.generate(PROMPTS, max_new_tokens=2)
        with pytest.raises(EngineError, match="asleep"):
            engine.submit(_requests(1)[0])
        llm.wake_up()
        assert not llm.is_sleeping and not llm.is_paused
        assert _tokens(llm) == before
        assert [_finish(engine.submit(r))[0] for r in _requests(max_new_tokens=NEW)] == before

        # level 2 drops the weights: update_weights brings them back, asleep or awake
        llm.sleep(2)
        assert llm.params is None and runner.params is None
        llm.update_weights(raw)
        llm.wake_up()
        assert _tokens(llm) == before
        llm.sleep(2)
        llm.wake_up()
        with pytest.raises(RuntimeError, match=r"no weights .*update_weights"):
            llm.generate(PROMPTS, max_new_tokens=2)
        llm.update_weights(raw)
        assert _tokens(llm) == before
        assert llm.programs.num_compiles == compiles
    finally:
        engine.stop()
        if llm.params is None:
            llm.update_weights(raw)
        llm.wake_up()


def test_the_prefix_cache_is_invalidated_by_an_update(llm, raw):
    prompt = [list(range(1, 40))]
    _tokens(llm, prompt)
    pool = llm._scheduler.kv_pages
    assert pool.num_cached > 0
    llm.update_weights(raw)
    assert pool.num_cached == 0
    hit = pool.hit_tokens
    _tokens(llm, prompt)
    assert pool.hit_tokens == hit              # nothing served from before the update
    assert llm.reset_prefix_cache() > 0


def test_a_tensor_parallel_llm_keeps_its_shardings():
    from multidevice import run_case
    r = run_case(2, "update_cases", "tensor_parallel", timeout_s=300, tp=2)
    assert r["split_heads"]
    assert r["got"] == r["fresh"] and r["got"] != r["before"]
    assert r["compiles"] == 0 and r["same_shardings"]


def test_a_stream_its_reader_holds_does_not_hold_a_pause_up(llm, raw):
    def stream():       # what `LLM.stream` iterates (the tiny model has no tokenizer: no text)
        return llm._run(llm.requests([PROMPTS[0]], max_new_tokens=LONG, ignore_eos=True),
                        stream=True)

    events = stream()
    next(events)                         # suspended at its first event, its request in flight
    llm.update_weights(raw)              # pauses ("wait") without waiting for the reader
    assert list(events)[-1][1].finish_reason == "length"      # read on: it finishes
    events = stream()
    next(events)
    llm.pause("abort")
    llm.resume()
    assert list(events)[-1][1].finish_reason == "abort"       # read again: it was aborted
    events = stream()
    next(events)
    llm.sleep(1)                         # its pages are freed: read after waking, it aborts
    llm.wake_up()
    assert list(events)[-1][1].finish_reason == "abort"
    assert _tokens(llm)
