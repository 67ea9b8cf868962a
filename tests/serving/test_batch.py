"""Batched generation with per-row state on a tiny random Llama (float32, CPU):
a row's output depends only on its own prompt, parameters and seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.serving.llm import LLM
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer.stop import StopMatcher
from tiny import TINY_LLAMA, random_params

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def np_params():
    return random_params(TINY_LLAMA, seed=3)


@pytest.fixture(scope="module")
def llm(np_params):
    params = jax.tree_util.tree_map(jnp.asarray, np_params)
    return LLM(TINY_LLAMA, params, max_seq_len=64, decode_chunk=4)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(0, TINY_LLAMA.vocab_size, n).tolist()


PROMPTS = [_prompt(3, 0), _prompt(17, 1), _prompt(40, 2)]


@pytest.mark.slow
def test_seeded_row_independent_of_neighbours_and_position(llm):
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    [alone] = llm.generate([PROMPTS[1]], seeded, max_new_tokens=10)
    runs = [
        llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(temperature=1.0), seeded], max_new_tokens=10)[1],
        llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0]],
                     [seeded, SamplingParams(temperature=0.5, seed=7), GREEDY], max_new_tokens=10)[0],
        llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[2], PROMPTS[1]],
                     [SamplingParams(temperature=1.3, top_k=3, repetition_penalty=1.5)] * 3 + [seeded],
                     max_new_tokens=[4, 12, 6, 10])[3],
    ]
    for row in runs:
        assert row.token_ids == alone.token_ids


def test_same_seed_same_tokens_different_seed_differs(llm):
    p = SamplingParams(temperature=1.0, seed=5)
    a = llm.generate([PROMPTS[0]], p, max_new_tokens=12)[0].token_ids
    b = llm.generate([PROMPTS[0]], p, max_new_tokens=12)[0].token_ids
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=6), max_new_tokens=12)[0].token_ids
    assert a == b
    assert a != c


def test_per_row_max_new_tokens(llm):
    out = llm.generate(PROMPTS, GREEDY, max_new_tokens=[2, 9, 5])
    assert [len(c.token_ids) for c in out] == [2, 9, 5]
    assert all(c.finish_reason == "length" for c in out)


def test_changing_sampling_params_does_not_recompile(llm):
    llm.generate(PROMPTS, GREEDY, max_new_tokens=4)
    before = llm.programs.num_compiles
    llm.generate(PROMPTS, [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05,
                                          repetition_penalty=1.3, presence_penalty=0.5,
                                          frequency_penalty=0.2, seed=s) for s in range(3)],
                 max_new_tokens=4)
    assert llm.programs.num_compiles == before


@pytest.mark.slow
def test_fifty_random_prompts_compile_a_handful_of_times(np_params):
    params = jax.tree_util.tree_map(jnp.asarray, np_params)
    fresh = LLM(TINY_LLAMA, params, max_seq_len=64, decode_chunk=4)
    rng = np.random.default_rng(0)
    prompts = [_prompt(int(n), i) for i, n in enumerate(rng.integers(1, 50, 50))]
    for i in range(0, 50, 10):  # five batches of ten, lengths 1..49
        fresh.generate(prompts[i:i + 10], GREEDY, max_new_tokens=3)
    fresh.generate(prompts, GREEDY, max_new_tokens=3)  # all 50 at once
    # per slot count {16, 64}: the step at the token buckets the prompts fill, admission
    # at the admission buckets, and no decode loop (none compiled ahead of time)
    assert fresh.programs.num_compiles <= 12


def test_logprobs_match_reference(llm, np_params):
    [out] = llm.generate([PROMPTS[0]], GREEDY, max_new_tokens=3, logprobs=4)
    seq = list(PROMPTS[0])
    for token, lp, top in out.logprobs:
        ref = reference.forward(np_params, seq, TINY_LLAMA)[-1]
        ref_lp = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
        order = np.argsort(-ref_lp)[:4]
        assert token == order[0]
        assert lp == pytest.approx(ref_lp[token], abs=1e-4)
        assert [i for i, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref_lp[order], atol=1e-4)
        seq.append(token)


def test_score_matches_reference(llm, np_params):
    prompts, conts = [PROMPTS[0], PROMPTS[1]], [_prompt(5, 9), _prompt(2, 10)]
    scores = llm.score(prompts, conts)
    for p, c, got in zip(prompts, conts, scores):
        ref = reference.forward(np_params, p + c, TINY_LLAMA)
        logp = ref - ref.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        expected = sum(logp[len(p) - 1 + i, tok] for i, tok in enumerate(c))
        assert got == pytest.approx(expected, abs=1e-4)


def test_score_rejects_empty_continuation(llm):
    with pytest.raises(ValueError, match="empty continuation"):
        llm.score([PROMPTS[0]], [[]])


# --- stop strings ---------------------------------------------------------------------


def test_stop_string_in_three_pieces_is_never_released():
    m = StopMatcher(["END!"])
    pieces = [m.push(t) for t in ["hello E", "N", "D", "! more"]]
    assert pieces == [("hello ", False), ("", False), ("", False), ("", True)]
    assert m.text == "hello "


def test_false_start_is_released_once_disproved():
    m = StopMatcher(["END"])
    assert m.push("an E") == ("an ", False)
    assert m.push("N") == ("", False)
    assert m.push("x") == ("ENx", False)
    assert m.flush() == ""
    assert m.text == "an ENx"


def test_held_text_flushed_at_end_of_generation():
    m = StopMatcher(["\n\n", "User:"])
    assert m.push("fine\nUs") == ("fine\n", False)  # only "Us" could start a stop string
    assert m.flush() == "Us"


def test_earliest_stop_string_wins():
    m = StopMatcher(["b", "abc"])
    assert m.push("xxabc") == ("xx", True)  # "abc" starts at 2, before "b" at 3


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])
