"""`LLM.prompt_logprobs` (the prompt tokens' log-probs, ranks and top n,
#54 item 3) against `LLM.score` and the float64 reference, and
`EngineThread.call`, which runs it between two steps of a running batch."""

import numpy as np
import pytest

import reference
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.serving.thread import EngineError, EngineThread
from tiny import TINY_LLAMA, random_params

PROMPTS = [[1, 5, 7, 9, 11, 3], [2, 4], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [6]]


@pytest.fixture(scope="module")
def params():
    return random_params(TINY_LLAMA)


@pytest.fixture(scope="module")
def llm(params):
    return LLM(TINY_LLAMA, params, max_seq_len=64, max_num_seqs=2)


def _ref_logp(params, ids):
    logits = reference.forward(params, ids, TINY_LLAMA)
    logp = logits - logits.max(-1, keepdims=True)
    return logp - np.log(np.exp(logp).sum(-1, keepdims=True))


def test_prompt_logprobs_equal_score_and_the_reference(llm, params):
    out = llm.prompt_logprobs(PROMPTS, top_n=3)
    for ids, entries in zip(PROMPTS, out):
        assert len(entries) == len(ids) and entries[0] is None
        if len(ids) == 1:
            continue
        assert [e.token for e in entries[1:]] == ids[1:]
        total = sum(e.logprob for e in entries[1:])
        assert total == pytest.approx(llm.score([ids[:1]], [ids[1:]])[0], abs=1e-5)
        ref = _ref_logp(params, ids)
        for t, e in enumerate(entries[1:]):
            assert e.logprob == pytest.approx(ref[t, ids[t + 1]], abs=1e-4)
            assert e.rank == 1 + int((ref[t] > ref[t, ids[t + 1]]).sum())
            best = np.argsort(-ref[t], kind="stable")[:3]
            assert [i for i, _ in e.top] == best.tolist()
            np.testing.assert_allclose([lp for _, lp in e.top], ref[t, best], atol=1e-4)
    assert all(e.top == [] for e in llm.prompt_logprobs(PROMPTS[:1], top_n=0)[0][1:])


def test_prompt_logprobs_refuses_bad_input(llm):
    with pytest.raises(ValueError, match="top_n"):
        llm.prompt_logprobs(PROMPTS, top_n=21)
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.prompt_logprobs([[1] * 65])


def test_engine_thread_call_runs_between_steps(llm):
    engine = EngineThread(llm.scheduler(2)).start()
    try:
        alone = [e for e in engine.submit(Request((1, 2, 3), SamplingParams(), 12, ignore_eos=True))]
        handle = engine.submit(Request((1, 2, 3), SamplingParams(), 12, ignore_eos=True))
        future = engine.call(lambda: llm.prompt_logprobs(PROMPTS[:2], 2))
        assert future.result(120) == llm.prompt_logprobs(PROMPTS[:2], 2)
        beside = list(handle)
        assert sum((e.token_ids for e in beside), []) == sum((e.token_ids for e in alone), [])
        with pytest.raises(ZeroDivisionError):      # the caller's exception, the engine goes on
            engine.call(lambda: 1 / 0).result(60)
        assert engine.running
    finally:
        engine.stop()
    with pytest.raises(EngineError):
        engine.call(lambda: None)
