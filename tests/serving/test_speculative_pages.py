"""Speculative decoding's pages in the scheduler: every position a drafted
block writes has a page of its own slot when the step is dispatched.

A decoding row under speculation writes its last token and up to k drafted
tokens (a block of 1 + num positions) at its device-side length, which the
host knows only as an upper bound (`Scheduler._positions`: the tokens
read so far plus what the dispatched, unread steps can still add). The fake
runner below models that: it keeps each row's real length, writes 1 + num
positions per block (num = min(max_drafts, k, tokens the row may still emit
- 1), as `engine.step`), accepts a scripted number of drafts, and asserts
the pages of every position it writes (`FakeRunner._write`). The emitted
tokens follow the fake model's chain whatever is accepted, so each test
also checks that no token is dropped or repeated. Blocks cross one and two
page boundaries, at page sizes 4 and 16, streamed (one step per dispatch)
and in decode loops, with the pool's last page, preemption and prefix hits.

Then the same through the real step on the tiny model (whose C++ attention
kernel refuses a block-table entry that is not a page): n-gram speculation
streamed, up to a request that fills max_seq_len, with float32 and int8 KV
pools, gives the greedy tokens of plain decoding.
"""

import types

import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.serving.runner import Dispatched
from jaxinfer.speculative import SpecConfig
from tiny import TINY_LLAMA, random_params
from test_scheduler import FakeRunner, chain, req, run, sched, tokens_of


class SpecFakeRunner(FakeRunner):
    """The fake runner with speculative decoding of k drafted tokens per
    block, of which `accept(round)` are accepted (all by default: a copy
    task, where the host's bound is tightest)."""

    def __init__(self, k, accept=None, **kwargs):
        super().__init__(**kwargs)
        self.k, self.width = k, 1 + k
        self.speculative = types.SimpleNamespace(num_speculative_tokens=k)
        self.accept = accept or (lambda i: k)
        self.crossed = []      # page boundaries inside each written block

    def segment_width(self, segment):
        return self.width if segment.decode else len(segment.tokens)

    def _block(self, slot, row, max_drafts, tables):
        """Write one drafted block of a decoding row; returns its emitted
        tokens, drafts and accepted drafts."""
        num = min(max_drafts, self.k, max(row["max"] - row["n"] - 1, 0))
        start = row["length"]
        self._write(slot, row, 1 + num, tables)
        self.crossed.append((start + num) // self.page_size - start // self.page_size)
        accepted = min(num, self.accept(len(self.crossed) - 1))
        out = [self._sample(row)]
        while len(out) <= accepted and not row["done"]:
            out.append(self._sample(row))
        row["length"] = start + len(out)
        return out, num, len(out) - 1

    def _outputs(self, steps, n):
        return (np.full((steps, n, self.width), NO_TOKEN), np.zeros((steps, n), bool),
                np.zeros((steps, n), np.int32), np.zeros((steps, n), np.int32))

    def _decode_row(self, out, step, i, slot, max_drafts, tables):
        tokens, done, drafted, accepted = out
        row = self.rows[slot]
        if row["done"]:
            tokens[step, i, 0] = -1
        else:
            emitted, drafted[step, i], accepted[step, i] = self._block(slot, row, max_drafts,
                                                                        tables)
            tokens[step, i, :len(emitted)] = emitted
        done[step, i] = row["done"]

    def step(self, segments, tables, num_logprobs=-1):
        assert sum(self.segment_width(s) for s in segments) <= self.token_budget
        out = self._outputs(1, len(segments))
        for i, s in enumerate(segments):
            row = self.rows[s.slot]
            if s.decode:
                self.decode_steps += 1
                self._decode_row(out, 0, i, s.slot, s.max_drafts, tables)
                continue
            self._write(s.slot, row, len(s.tokens), tables)
            row["last"] = s.tokens[-1]
            if s.sample:
                out[0][0, i, 0] = self._sample(row)
            out[1][0, i] = row["done"]
        return self._dispatched(out, 1)

    def decode(self, slots, tables, num_steps, max_drafts=None, num_logprobs=-1, rows=0):
        out = self._outputs(num_steps, len(slots))
        for step in range(num_steps):
            for i, slot in enumerate(slots):
                self._decode_row(out, step, i, slot, max_drafts[i], tables)
        self.decode_steps += num_steps
        return self._dispatched(out, num_steps)

    @staticmethod
    def _dispatched(out, steps):
        tokens, done, drafted, accepted = out
        return Dispatched(StepOutput(tokens, done, drafted=drafted, accepted=accepted), steps)


def _serve(runner, requests, stream, **kwargs):
    """Run `requests` to the end on a scheduler over `runner`; their tokens."""
    s = sched(runner, decode_chunk=4, isolate_faults=False, **kwargs)
    ids = [s.add_request(r, stream=stream) for r in requests]
    events = run(s, max_steps=500)
    assert s.kv_pages.num_available == runner.num_pages or s.kv_pages.prefix_caching
    return s, [tokens_of(events[i]) for i in ids]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "loop"])
@pytest.mark.parametrize("page_size,k,boundaries", [(4, 3, 1), (4, 5, 2), (16, 3, 1), (16, 17, 2)])
def test_drafted_blocks_have_their_pages(page_size, k, boundaries, stream):
    # 15-token prompts: the first block starts at position 15, one before a page boundary
    runner = SpecFakeRunner(k, page_size=page_size, max_seq_len=128, loops=not stream)
    _, got = _serve(runner, [req(7, n_prompt=15, max_new=60, ignore_eos=True),
                             req(11, n_prompt=15, max_new=45, ignore_eos=True)], stream)
    assert got == [chain(7, 60, ignore_eos=True), chain(11, 45, ignore_eos=True)]
    assert max(runner.crossed) == boundaries


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "loop"])
@pytest.mark.parametrize("page_size,k", [(4, 5), (16, 17)])
def test_a_block_may_use_the_last_page_of_the_pool(page_size, k, stream):
    """The pool holds exactly what `check_fits` asks of one request: its
    prompt, max_new_tokens and one block."""
    prompt, max_new = 5, 40
    num_pages = -(-(prompt + max_new + 1 + k) // page_size)
    runner = SpecFakeRunner(k, page_size=page_size, max_seq_len=64, num_pages=num_pages,
                            max_num_seqs=1, loops=not stream)
    _, got = _serve(runner, [req(3, n_prompt=prompt, max_new=max_new, ignore_eos=True)], stream)
    assert got == [chain(3, max_new, ignore_eos=True)]


@pytest.mark.parametrize("accept", [lambda i: 5, lambda i: (5, 0, 2, 1)[i % 4]], ids=["all", "some"])
def test_preempted_speculating_rows_resume_exactly(accept):
    runner = SpecFakeRunner(5, accept=accept, page_size=4, max_seq_len=40, num_pages=13,
                            max_num_seqs=2)
    s, got = _serve(runner, [req(10, max_new=30, ignore_eos=True), req(20, max_new=30, ignore_eos=True)],
                    True)
    assert s.num_preempted >= 1
    assert got == [chain(10, 30, ignore_eos=True), chain(20, 30, ignore_eos=True)]


def test_a_prefix_hit_then_drafted_blocks():
    runner = SpecFakeRunner(5, page_size=4, max_seq_len=64, max_num_seqs=1)
    s = sched(runner, decode_chunk=4)
    s.add_request(Request([5] * 10 + [7], max_new_tokens=20, ignore_eos=True), stream=True)
    run(s)
    second = s.add_request(Request([5] * 10 + [9], max_new_tokens=20, ignore_eos=True), stream=True)
    events = run(s)
    assert s.kv_pages.hit_tokens == 8
    assert tokens_of(events[second]) == chain(9, 20, ignore_eos=True)


# --- the real step on the tiny model -------------------------------------------------------------

COUNTING = TINY_LLAMA.replace(tie_word_embeddings=False)
PROMPTS = [list(range(10, 40)) + list(range(10, 14)), list(range(50, 70)) + list(range(50, 53)),
           list(range(70, 90)) + [70]]
MAX_SEQ_LEN = 64      # the first prompt (34 tokens) + 30 new tokens fills it


def counting_params() -> dict:
    """The tiny Llama made to count: greedy emits (last token + 1) mod V. The
    layers' outputs are scaled down (attention still reads every cached
    position) and the LM head's column y is the embedding of y - 1, so a
    prompt that repeats the start of a run is copied, and n-gram drafts are
    accepted as in a copy task."""
    params = random_params(COUNTING)
    for name in ("o_proj", "down_proj"):
        params["layers"][name] = params["layers"][name] * 0.01
    params["lm_head"] = np.ascontiguousarray(np.roll(params["embed_tokens"], 1, axis=0).T)
    return params


def _greedy_streamed(llm, max_new):
    """Each prompt's greedy tokens, streamed together; and (drafted, accepted) in all."""
    s = llm.scheduler(max_num_seqs=4, isolate_faults=False)
    ids = [s.add_request(Request(p, SamplingParams(temperature=0.0), max_new, ignore_eos=True),
                         stream=True) for p in PROMPTS]
    events = run(s, max_steps=500)
    assert s.kv_pages.num_available == s.runner.num_pages
    specs = [events[i][-1].spec for i in ids]
    counts = (sum(x.drafted for x in specs), sum(x.accepted for x in specs)) if specs[0] else None
    return [tokens_of(events[i]) for i in ids], counts


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_streamed_ngram_speculation_on_the_tiny_model_gives_the_greedy_tokens(kv_cache_dtype):
    params = counting_params()
    make = lambda **kw: LLM(COUNTING, params, max_seq_len=MAX_SEQ_LEN, max_num_seqs=4, page_size=4,
                            decode_chunk=4, kv_cache_dtype=kv_cache_dtype, **kw)
    max_new = MAX_SEQ_LEN - len(PROMPTS[0])
    plain, _ = _greedy_streamed(make(), max_new)
    assert plain == [[(p[-1] + 1 + i) % COUNTING.vocab_size for i in range(max_new)] for p in PROMPTS]
    fast, (drafted, accepted) = _greedy_streamed(make(speculative=SpecConfig("ngram", 6)), max_new)
    assert fast == plain
    assert drafted >= accepted > 30
