"""Speculative decoding: n-gram proposals, acceptance bookkeeping
(`sampling.rows.accept_drafts`) on hand-made logits, and the output
distribution (chi-square). Greedy equality with plain decoding through the
serving step is in tests/engine/test_step.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling
from jaxinfer.engine import phases
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN, RowState, accept_drafts
from jaxinfer.serving.request import Request, RequestState
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.rows import row_inputs, stop_tokens
from jaxinfer.speculative import SpecConfig, as_spec_config, ngram_propose
from jaxinfer.weights.prepare import prepare_params
from tiny import TINY_LLAMA, random_params

GREEDY = SamplingParams(temperature=0.0)


# --- n-gram proposals ---------------------------------------------------------------------------


def _history(rows, width=16):
    h = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        h[i, :len(r)] = r
    return jnp.asarray(h), jnp.array([len(r) for r in rows], jnp.int32)


def test_ngram_proposes_what_followed_the_latest_match():
    history, n = _history([
        [5, 6, 7, 8, 9, 5, 6],          # last 2 = (5, 6): seen at 0, followed by 7 8 9
        [1, 2, 3, 1, 2, 4, 1, 2],       # (1, 2) seen twice: the latest (3) is followed by 4 1 2
        [1, 2, 3, 4],                   # no repeat
        [7, 8, 7, 8, 7],                # (8, 7) at 1, followed by 8 7 and the end of the history
        [3, 9, 9, 3],                   # n = 2 (9, 3) unseen; n = 1 (3) at 0: 9 9 3
    ])
    drafts, num = ngram_propose(history, n, k=3, ngram_min=1, ngram_max=2)
    assert np.asarray(num).tolist() == [3, 3, 0, 2, 3]
    assert np.asarray(drafts).tolist() == [[7, 8, 9], [4, 1, 2], [0, 0, 0], [8, 7, 0], [9, 9, 3]]


def test_ngram_stops_at_the_end_of_the_history():
    history, n = _history([[4, 5, 6, 4, 5]])         # (4, 5) at 0 -> 6 4 5, capped by k = 2
    drafts, num = ngram_propose(history, n, k=2, ngram_min=2, ngram_max=2)
    assert np.asarray(num).tolist() == [2] and np.asarray(drafts).tolist() == [[6, 4]]
    history, n = _history([[4, 5, 6, 9, 4, 5]])
    drafts, num = ngram_propose(history, n, k=4, ngram_min=2, ngram_max=3)
    assert np.asarray(num).tolist() == [4] and np.asarray(drafts).tolist() == [[6, 9, 4, 5]]


# --- acceptance bookkeeping on scripted logits ------------------------------------------------------

V = 12
EOS = 11


def _rows(prompts, max_new=20, min_tokens=0, params=GREEDY):
    reqs = [Request(p, params, max_new, min_tokens) for p in prompts]
    inputs = row_inputs(reqs, V, 64)
    b = len(prompts)
    return RowState(
        tokens=jnp.array([p[-1] for p in prompts], jnp.int32), done=jnp.zeros(b, bool),
        num_generated=jnp.zeros(b, jnp.int32), max_new_tokens=inputs.max_new_tokens,
        min_tokens=inputs.min_tokens, ignore_eos=inputs.ignore_eos, seen=inputs.seen,
        counts=jnp.zeros((b, V), jnp.int32), history=inputs.history, history_len=inputs.history_len,
        keys=inputs.keys, sampling=inputs.sampling)


def _logits(argmaxes):
    """[B, k + 1, V] logits whose argmax at each position is given."""
    a = np.asarray(argmaxes)
    out = np.zeros(a.shape + (V,), np.float32)
    np.put_along_axis(out, a[..., None], 5.0, axis=-1)
    return jnp.asarray(out)


def _accept(argmaxes, drafts, num, **kw):
    rows = _rows([[1, 2]] * len(drafts), **kw)
    rows, out = accept_drafts(_logits(argmaxes), jnp.asarray(drafts, jnp.int32),
                              jnp.asarray(num, jnp.int32), None, rows, stop_tokens([EOS], [EOS]), -1)
    return rows, jax.device_get(out)


def test_greedy_acceptance_rows_with_different_counts():
    # target argmax at positions 0..3 is 3 4 5 6 (k = 3)
    target = [[3, 4, 5, 6]] * 4
    drafts = [[7, 7, 7],      # 0 accepted: emit the target's 3
              [3, 4, 5],      # all 3 accepted: 3 4 5 + bonus 6
              [3, 9, 5],      # reject in the middle: 3, then the correction 4
              [3, 4, 5]]      # only 2 drafts offered: 3 4 + the target's 5
    rows, out = _accept(target, drafts, [3, 3, 3, 2])
    assert out.token.tolist() == [[3, NO_TOKEN, NO_TOKEN, NO_TOKEN], [3, 4, 5, 6],
                                  [3, 4, NO_TOKEN, NO_TOKEN], [3, 4, 5, NO_TOKEN]]
    assert out.accepted.tolist() == [0, 3, 1, 2] and out.drafted.tolist() == [3, 3, 3, 2]
    assert np.asarray(rows.num_generated).tolist() == [1, 4, 2, 3]
    assert np.asarray(rows.tokens).tolist() == [3, 6, 4, 5]
    assert np.asarray(rows.history_len).tolist() == [3, 6, 4, 5]
    assert np.asarray(rows.history)[1, :6].tolist() == [1, 2, 3, 4, 5, 6]


def test_eos_among_accepted_drafts_ends_the_row():
    rows, out = _accept([[3, EOS, 5, 6]], [[3, EOS, 5]], [3])
    assert out.token.tolist() == [[3, EOS, NO_TOKEN, NO_TOKEN]] and out.done.tolist() == [True]
    assert int(rows.num_generated[0]) == 2


def test_a_finished_row_emits_nothing_and_records_nothing():
    """Row 1 is already done: it emits -1 at every position, drafts nothing,
    and its bookkeeping is unchanged; row 0 beside it accepts as usual."""
    rows = _rows([[1, 2]] * 2)
    rows = rows.replace(done=jnp.array([False, True]))
    before = jax.device_get(rows)
    rows, out = accept_drafts(_logits([[3, 4, 5, 6]] * 2), jnp.array([[3, 4, 5]] * 2), jnp.array([3, 3]),
                              None, rows, stop_tokens([EOS], [EOS]), -1)
    assert np.asarray(out.token).tolist() == [[3, 4, 5, 6], [-1, -1, -1, -1]]
    assert np.asarray(out.drafted).tolist() == [3, 0] and np.asarray(out.accepted).tolist() == [3, 0]
    assert int(rows.num_generated[1]) == 0 and int(rows.history_len[1]) == 2
    assert np.array_equal(np.asarray(rows.counts[1]), before.counts[1])


def test_budget_reached_mid_block_emits_exactly_the_budget():
    rows, out = _accept([[3, 4, 5, 6]], [[3, 4, 5]], [3], max_new=2)
    assert out.token.tolist() == [[3, 4, NO_TOKEN, NO_TOKEN]] and out.done.tolist() == [True]
    assert int(rows.num_generated[0]) == 2


def test_stop_draft_before_min_tokens_is_rejected():
    # the target puts EOS first, but min_tokens = 2 masks it: its second choice (0) comes out
    logits = np.array(_logits([[EOS, 4, 5]]))
    logits[0, 0, 0] = 4.0
    rows = _rows([[1, 2]], min_tokens=2)
    rows, out = accept_drafts(jnp.asarray(logits), jnp.array([[EOS, 4]]), jnp.array([2]), None, rows,
                              stop_tokens([EOS], [EOS]), -1)
    assert np.asarray(out.token).tolist() == [[0, NO_TOKEN, NO_TOKEN]]
    assert not bool(out.done[0])


class _CharDetok:
    """push(ids) -> text, one character per id (a stand-in for IncrementalDetokenizer)."""

    def push(self, ids):
        return "".join("abcdefghijkl"[i] for i in ids)

    def flush(self):
        return ""


def test_stop_string_across_accepted_tokens_is_cut():
    """A round's tokens arrive together; a stop string spanning them ends the
    request and its text is excluded."""
    state = RequestState(0, Request([1], GREEDY, 10, stop=("dfg",)), _CharDetok(), [EOS], [EOS], 0.0)
    for token in (1, 2, 3, 5, 6, 7, 8):       # b c d f g h i: "dfg" spans the 3rd..5th tokens
        state.add(token)
    assert state.finished and state.finish_reason == "stop"
    assert state.text == "bc" and state.token_ids == [1, 2, 3, 5, 6]


# --- the output distribution -----------------------------------------------------------------------


def _chi_square_p(counts, probs):
    from scipy import stats

    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5)], ids=["t1", "t0.7-p0.9", "k5"])
def test_first_token_distribution_matches_the_target(params):
    """The first token after a fixed prefix, drawn 40,000 times (one row per
    seed) with speculation, from a draft model whose distribution q differs
    from the target's p on purpose, and without: both pass a chi-square
    test against the target's processed distribution p at significance 0.001."""
    from jaxinfer.cache.kv import init_cache

    config = TINY_LLAMA.replace(vocab_size=16)
    n, v = 40_000, 16

    def model(seed):   # embeddings scaled down: logits O(1), so p spreads over several tokens
        params = random_params(config, seed=seed)
        params["embed_tokens"] = params["embed_tokens"] * 0.2
        return prepare_params(jax.tree_util.tree_map(jnp.asarray, params), config)

    target, draft = model(3), model(4)
    prefix = [3, 1, 4, 1, 5]

    def last_logits(params, ids):
        tokens = jnp.zeros((1, 8), jnp.int32).at[0, :len(ids)].set(jnp.asarray(ids))
        out, _ = phases.prefill(params, init_cache(config, 1, 8), tokens, jnp.array([len(ids)]),
                                config=config)
        return out[0]

    rows = _sampled_rows(prefix, n, v, params)
    one = jax.tree_util.tree_map(lambda x: x[:1], rows.sampling)
    p_logits = last_logits(target, prefix)
    p = np.asarray(sampling.distribution(p_logits[None], one))[0]
    q = sampling.distribution(last_logits(draft, prefix)[None], one)[0]
    assert np.abs(np.asarray(q) - p).max() > 0.05                  # q differs from p on purpose
    assert (p > 0.01).sum() >= 4                                    # p is not degenerate
    u = jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(rows.keys, 77))
    d = sampling.inverse_cdf(jnp.broadcast_to(q, (n, v)), u)        # the drafts, d ~ q
    after = jnp.stack([last_logits(target, prefix + [t]) for t in range(v)])   # logits after d
    logits = jnp.stack([jnp.broadcast_to(p_logits, (n, v)), after[d]], axis=1)  # [n, 2, V]
    _, out = accept_drafts(logits, d[:, None], jnp.ones((n,), jnp.int32),
                           jnp.broadcast_to(q, (n, 1, v)), rows, stop_tokens([], []), -1)
    spec_counts = np.bincount(np.asarray(out.token[:, 0]), minlength=v)
    plain = sampling.sample(jnp.broadcast_to(p_logits, (n, v)),
                            sampling.step_keys(rows.keys, rows.num_generated), rows.sampling)
    plain_counts = np.bincount(np.asarray(plain), minlength=v)
    assert _chi_square_p(spec_counts, p) > 1e-3
    assert _chi_square_p(plain_counts, p) > 1e-3
    # the test has power: the drafts themselves (distribution q) fail it
    assert _chi_square_p(np.bincount(np.asarray(d), minlength=v) * (p > 0), p) < 1e-3
    rate = float(np.asarray(out.accepted).mean())
    assert 0.05 < rate < 0.98     # both branches (accept, resample) were exercised


def _sampled_rows(prompt, n, vocab, params):
    """n rows after `prompt`, one seed each (0 .. n - 1), sampling with `params`."""
    reqs = [Request(prompt, SamplingParams(**{**params.__dict__, "seed": s}), 4) for s in range(n)]
    inputs = row_inputs(reqs, vocab, 16)
    return RowState(
        tokens=jnp.full((n,), prompt[-1], jnp.int32), done=jnp.zeros(n, bool),
        num_generated=jnp.zeros(n, jnp.int32), max_new_tokens=inputs.max_new_tokens,
        min_tokens=inputs.min_tokens, ignore_eos=inputs.ignore_eos, seen=inputs.seen,
        counts=jnp.zeros((n, vocab), jnp.int32), history=inputs.history,
        history_len=inputs.history_len, keys=inputs.keys, sampling=inputs.sampling)


def test_ids_past_the_tokenizer_are_never_drawn():
    """A model vocabulary padded past the tokenizer's (num_ids = 10 of V = 12):
    id 10 holds the largest logit, yet the greedy row takes the best real id
    (3) and 63 seeded sampled rows never draw 10 or 11; without the limit the
    greedy row takes 10 (the control)."""
    from jaxinfer.engine.step import new_rows
    from jaxinfer.sampling.rows import sample_step

    reqs = [Request((1, 2), GREEDY, 8)] + [Request((1, 2), SamplingParams(temperature=1.0, seed=s), 8)
                                          for s in range(63)]
    rows = new_rows(row_inputs(reqs, V, 64))
    logits = jnp.zeros((64, V)).at[:, 10].set(5.0).at[:, 3].set(1.0)
    _, out = sample_step(logits, rows, stop_tokens([EOS], [EOS], num_ids=10), -1)
    tokens = np.asarray(out.token)
    assert tokens[0] == 3 and (tokens < 10).all() and len(set(tokens[1:].tolist())) > 3
    _, out = sample_step(logits, rows, stop_tokens([EOS], [EOS]), -1)
    assert int(out.token[0]) == 10


def test_speculative_as_a_string():
    assert as_spec_config("ngram") == SpecConfig("ngram") and as_spec_config(None) is None
    spec = SpecConfig("ngram", 2)
    assert as_spec_config(spec) is spec
    with pytest.raises(ValueError, match=r"speculative='draft' needs its draft model: pass "
                                         r"SpecConfig\('draft', k, draft=DraftModel\(config, params\)\)"):
        as_spec_config("draft")
    with pytest.raises(ValueError, match="speculative must be 'ngram', a SpecConfig or None, got 'eagle'"):
        as_spec_config("eagle")
    with pytest.raises(TypeError, match="speculative must be a SpecConfig, 'ngram' or None, got int"):
        as_spec_config(4)
    llm = LLM(TINY_LLAMA, random_params(TINY_LLAMA), max_seq_len=32, speculative="ngram")
    assert llm.speculative == SpecConfig("ngram")
