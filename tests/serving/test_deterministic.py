"""The deterministic mode (`LLM(deterministic=True)`): a request's tokens and
log-probs are bitwise equal (`np.array_equal` on float32) whatever the
batch, its slot and neighbours, the prefill chunk size, a prefix-cache hit
on or off a page boundary, greedy n-gram speculation, or a preemption, on
tiny Llama and tiny Gemma 3 (prompts longer than its 4-token window), with
float32 and bfloat16 weights, on the AVX-512 and the AVX2 kernels."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.nn import ordered_sum, rms_norm
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.deterministic import xla_flag_problems
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.speculative import SpecConfig
from jaxinfer.weights.prepare import prepare_params
from serving_runs import ids, one_by_one, run
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
GREEDY = SamplingParams()
NEW = 20


# The weights of each (arch, weights) pair, prepared once per module. The
# `model` fixture's tests run tiny Llama in float32 and tiny Gemma 3 in
# bfloat16, as two of the neighbour test's three cases do, and `_llm`'s
# defaults are that test's: the same programs, compiled once (through the test
# run's compilation cache) for both tests.
MODEL_WEIGHTS = {"llama": "float32", "gemma3": "bfloat16"}


def _model(arch, weights):
    config = {"llama": TINY_LLAMA, "gemma3": TINY_GEMMA3}[arch]
    raw = jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=3))
    return config, prepare_params(raw, config, weights=weights)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return _model(request.param, MODEL_WEIGHTS[request.param])


def _llm(model, **kwargs):
    """129 slots: a lone row and up to 128 neighbours."""
    kwargs = {"max_seq_len": 128, "page_size": 16, "max_num_seqs": 129,
              "max_num_batched_tokens": 256, "deterministic": True, **kwargs}
    return LLM(*model, **kwargs)


def _request(prompt, sampling=SAMPLED):
    return Request(tuple(prompt), sampling, max_new_tokens=NEW, ignore_eos=True, logprobs=0)


def _neighbours(n, vocab, seed):
    rng = np.random.default_rng(seed)
    return [_request(ids(int(rng.integers(3, 60)), vocab, seed * 100 + i),
                     GREEDY if i % 3 == 0 else SamplingParams(temperature=1.1, seed=i))
            for i in range(n)]


def _serve(llm, requests, arrive=None, ends_only=False, **kwargs):
    """(tokens, log-probs) of the first request, served among the others
    (`run` answers in the order the requests were added). ends_only: the
    scheduler steps in the smallest and the largest token bucket only, as a
    server does between its warm-up and its background compiles
    (`WarmUp.warmup(background=True)` without `compile_behind`): two step
    programs (2 tokens of 2 rows, 256 tokens of 129 rows) instead of up to
    eight, each compiled once for the LLM (its `ProgramCache`)."""
    arrive = arrive or [0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: (arrive[i], i))
    scheduler = llm.scheduler(**kwargs)
    if ends_only:
        scheduler.runner.warmup((0,), background=True)     # logprobs=0: num_logprobs 0
        assert scheduler.runner.warm.ready_buckets == [2, 256]
    tokens, logprobs = run(scheduler, requests, arrive)[order.index(0)]
    assert len(tokens) == NEW
    return tokens, logprobs


def _assert_bitwise(got, want, case):
    assert got[0] == want[0], case
    assert np.array_equal(got[1], want[1]), (case, np.max(np.abs(got[1] - want[1])))


def test_ordered_sum_is_row_invariant_and_a_sum():
    x = np.random.default_rng(0).standard_normal((130, 577)).astype(np.float32)
    whole = np.asarray(jax.jit(ordered_sum)(jnp.asarray(x)))
    for rows in (1, 2, 7, 64, 129):
        assert np.array_equal(np.asarray(jax.jit(ordered_sum)(jnp.asarray(x[:rows]))), whole[:rows])
    np.testing.assert_allclose(whole, x.astype(np.float64).sum(-1), rtol=0, atol=1e-4)
    s = jnp.linspace(0.5, 1.5, 577)
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), s, 1e-6, ordered=True),
                               rms_norm(jnp.asarray(x), s, 1e-6), rtol=2e-6, atol=0)


def _with_neighbours(llm, n, ends_only=False):
    """The target among n neighbours arriving over 5 steps (it arrives at
    step n % 4, so its slot varies), prompts prefilled whole: steps up to
    256 tokens wide."""
    v = llm.config.vocab_size
    arrive = [n % 4] + [i % 5 for i in range(n)]
    return _serve(llm, [_target(v)] + _neighbours(n, v, n), arrive, ends_only,
                  prefill_chunk_size=None)


def _target(vocab):
    return _request(ids(45, vocab, 1))


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
@pytest.mark.parametrize("arch,weights", [("llama", "float32"), ("llama", "bfloat16"),
                                          ("gemma3", "bfloat16")])
def test_a_lone_row_is_bitwise_the_same_among_1_to_128_neighbours(arch, weights):
    """Served alone, the target decodes as the step's one live row (the
    matmuls compute only live rows); among n neighbours
    its rows share register blocks with others, at every place in them, and
    its seeded draws share the sampler's arrays. bfloat16 weights
    (`weights: bfloat16`) once failed here from 1 neighbour on: their
    kernel summed a lone row in two interleaved halves.

    Two step programs (`_serve`'s ends_only; compiling each took 11-17 s on
    a 2-core Zen 3 with XLA's default flags, most of this test's time with
    all eight): the target prefills in the 256-token step and decodes alone
    in the 2-token step, next to 1 neighbour in the 2-token step, and among
    3 to 129 live rows of the 256-token step (the matmuls compute the live
    rows only, so the row blocks still change with n). The other token
    buckets' programs are held to the same bits by the chunking test below
    (tiny Llama float32 and tiny Gemma 3 bfloat16)."""
    llm = _llm(_model(arch, weights))
    alone = _serve(llm, [_target(llm.config.vocab_size)], ends_only=True)
    for n in (1, 2, 7, 64, 128):
        _assert_bitwise(_with_neighbours(llm, n, ends_only=True), alone,
                        f"{arch}, {weights} weights, {n} neighbours")


@pytest.mark.slow
@pytest.mark.default_xla_flags(skip_allowed=True)   # bitwise; skips off x86-64
def test_the_avx2_build_keeps_the_bits_among_neighbours(avx2_kernel_env):
    """The test above on the AVX2 kernels (-march=x86-64-v3, built once per
    test run by `avx2_kernel_env`; a child pytest: one process loads one
    library), whose register blocks are other sizes. Its bits differ from
    the AVX-512 build's, within float32 rounding; among themselves they agree."""
    env = avx2_kernel_env
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                           "slow", f"{__file__}::test_a_lone_row_is_bitwise_the_same_among_1_to_128_"
                           "neighbours"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 passed" in done.stdout


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
def test_without_the_mode_a_neighbour_changes_the_bits():
    """The control for the test above: without the mode, tiny Gemma 3's
    log-probs change in their last bits (about 1e-7) when the target is
    served among 15 neighbours. (The tiny Llama no longer shows it: RMSNorm
    sums each row alone in both modes, `models.blocks.rms_norm`. Should
    Gemma 3's path become batch-invariant as well, this fails, and the test
    above needs another case that can fail.)"""
    model = _model("gemma3", MODEL_WEIGHTS["gemma3"])
    llm = _llm(model, deterministic=False)
    got, alone = _with_neighbours(llm, 15), _serve(llm, [_target(TINY_GEMMA3.vocab_size)])
    assert got[0] == alone[0]
    assert not np.array_equal(got[1], alone[1])


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
def test_a_row_is_bitwise_the_same_whatever_its_batch_chunking_and_prefix_hits(model):
    v = model[0].vocab_size
    llm = _llm(model)
    alone = _serve(llm, [_target(v)], prefill_chunk_size=None)
    for chunk in (1, 3, 16):
        _assert_bitwise(_serve(llm, [_target(v)], prefill_chunk_size=chunk), alone, f"chunk {chunk}")
    for n in (1, 6, 15):       # batch 2, 7 and 16
        _assert_bitwise(_with_neighbours(llm, n), alone, f"{n} neighbours")
    cold = _llm(model, prefix_caching=False)
    for length in (32, 33):    # a prefix hit ending on a page boundary and one token past it
        prompt = ids(length, v, length)
        want = _serve(cold, [_request(prompt)])
        first, again = one_by_one(llm.scheduler(prefill_chunk_size=8), [_request(prompt)] * 2)
        assert (first[2], again[2]) == (0, (length - 1) // 16 * 16)   # the last token is computed
        _assert_bitwise(again[:2], want, f"prefix hit, prompt {length}")


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
def test_greedy_speculation_and_preemption_keep_the_bits(model):
    """Pages of 4 tokens throughout, so the k = 4 drafts cross pages. One
    LLM of 4 slots and a pool of 20 pages serves the references, each
    request alone (it fits the pool), and the five requests at once, which
    do not fit and preempt: each of the five, the preempted and recomputed
    ones among them, must be bitwise its run alone (one set of compiled
    programs for both)."""
    v = model[0].vocab_size
    prompt = (ids(6, v, 7) * 5)[:29]          # repeats: the n-gram proposer finds drafts
    small = _llm(model, page_size=4, num_pages=20, max_num_seqs=4)
    plain = _serve(small, [_request(prompt, GREEDY)])
    spec = _llm(model, page_size=4, num_pages=20, max_num_seqs=4,
                speculative=SpecConfig("ngram", num_speculative_tokens=4))
    _assert_bitwise(_serve(spec, [_request(prompt, GREEDY)]), plain, "speculation k=4")
    requests = [_request(prompt)] + [_request(ids(n, v, 40 + n), GREEDY if n % 2 else SAMPLED)
                                     for n in (9, 14, 6, 11)]
    want = [_serve(small, [r], prefill_chunk_size=8) for r in requests]
    sched = small.scheduler(prefill_chunk_size=8)
    got = run(sched, requests, [0, 0, 1, 2, 2])      # in the order added
    assert sched.num_preempted > 0
    for i, (one, alone) in enumerate(zip(got, want)):
        _assert_bitwise(one, alone, f"request {i} among the preempting five")


@pytest.fixture
def default_xla_flags_env(monkeypatch):
    """XLA_FLAGS as `jaxinfer` runs (none): the refusals below are checked
    apart from the test run's fast-compile flags, which the mode refuses too
    (test_the_mode_refuses_the_test_runs_xla_flags). Nothing here compiles."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype int8: only float32 pools run the ragged "
                                  "attention kernel"),
    (dict(max_num_batched_tokens=1), "max_num_batched_tokens must be >= 2: XLA compiles a "
                                     "one-token step into other code, which changes a row's "
                                     "last bits"),
])
def test_the_mode_refuses_what_it_cannot_keep(kwargs, reason, default_xla_flags_env):
    model = (TINY_LLAMA, random_params(TINY_LLAMA, seed=3))
    with pytest.raises(ValueError) as e:
        _llm(model, **kwargs)
    assert str(e.value) == f"deterministic=True cannot hold here: {reason}"


def test_the_mode_refuses_int8_weights(default_xla_flags_env):
    raw = jax.tree_util.tree_map(jnp.asarray, random_params(TINY_LLAMA, seed=3))
    params = prepare_params(raw, TINY_LLAMA, weights="int8")
    with pytest.raises(ValueError) as e:
        _llm((TINY_LLAMA, params))
    assert str(e.value) == ("deterministic=True cannot hold here: weights int8: the quantized "
                            "matmul changes its summation order with the number of rows (use "
                            "weights float32 or bfloat16)")


def test_the_mode_takes_bfloat16_weights(default_xla_flags_env):
    raw = jax.tree_util.tree_map(jnp.asarray, random_params(TINY_LLAMA, seed=3))
    llm = _llm((TINY_LLAMA, prepare_params(raw, TINY_LLAMA, weights="bfloat16")))
    assert llm.config.deterministic and llm.params["lm_head"].format == "bf16"


def test_the_mode_refuses_the_test_runs_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1 "
                                    "--xla_backend_optimization_level=0 "
                                    "--xla_cpu_use_fusion_emitters=false")
    with pytest.raises(ValueError) as e:
        _llm((TINY_LLAMA, random_params(TINY_LLAMA, seed=3)))
    assert str(e.value) == (
        "deterministic=True cannot hold here: XLA_FLAGS sets --xla_backend_optimization_level=0: "
        "it compiles without XLA's default optimisation level (3), which the bitwise tests run "
        "under; XLA_FLAGS sets --xla_cpu_use_fusion_emitters=false: it emits fusions with XLA's "
        "loop emitters, under which bitwise invariance failed (docs/testing.md)")


@pytest.mark.parametrize("flags,refused", [
    ("", []),
    ("--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true", []),
    ("--xla_cpu_use_fusion_emitters=false --xla_cpu_use_fusion_emitters=true", []),   # the last counts
    ("-xla_cpu_enable_fast_math", ["--xla_cpu_enable_fast_math=true"]),               # bare: true
    ("--xla_cpu_enable_fast_math=FALSE --xla_backend_optimization_level=2",
     ["--xla_backend_optimization_level=2"]),
    ("--xla_cpu_use_fusion_emitters=0 --xla_cpu_enable_fast_math=1",
     ["--xla_cpu_use_fusion_emitters=0", "--xla_cpu_enable_fast_math=1"]),
])
def test_xla_flag_problems_name_each_refused_flag(flags, refused):
    problems = xla_flag_problems(flags)
    assert [p.split(": ")[0] for p in problems] == [f"XLA_FLAGS sets {r}" for r in refused]
