"""Structured output through `LLM.generate` on a tiny random model with a
character tokenizer (tests/structured_cases.py): every output is in the
constraint's language, greedy and sampled, with n-gram speculation too; rows
without a constraint give the same tokens as a run without any; EOS comes
only in accepting states; a budget that ends inside the structure finishes
with "length"."""

import json
import re

import numpy as np
import pytest

from jaxinfer.config import SamplingParams, StructuredOutput
from jaxinfer.speculative import SpecConfig
from structured_cases import CONFIG, params, tiny_llm

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "maxDigits": 3},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}
REGEX = "(cat|dog)-[0-9]{2,3}"
CHOICE = ("red", "green", "blue", "dark red")
SPECS = [StructuredOutput(json_schema=SCHEMA), StructuredOutput(regex=REGEX),
         StructuredOutput(choice=CHOICE)]
PROMPTS = ["the cat", "a dog said", "{", "12"]


def _valid(spec: StructuredOutput, text: str) -> bool:
    if spec.choice is not None:
        return text in spec.choice
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    try:
        jsonschema.validate(json.loads(text), json.loads(spec.json_schema))
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.mark.parametrize("spec", SPECS, ids=["json_schema", "regex", "choice"])
def test_greedy_and_sampled_outputs_are_in_the_language(llm, spec):
    params_ = [SamplingParams(structured=spec)] + [
        SamplingParams(structured=spec, temperature=1.5, seed=s) for s in range(7)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(8)], params_, max_new_tokens=100)
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == 0, o
        assert _valid(spec, o.text), o.text


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(llm):
    free = [SamplingParams(), SamplingParams(temperature=0.9, seed=3)]
    alone = llm.generate(PROMPTS[:2], free, max_new_tokens=24)
    mixed = llm.generate(PROMPTS, free + [SamplingParams(structured=SPECS[0]),
                                          SamplingParams(structured=SPECS[2], temperature=1.0, seed=1)],
                         max_new_tokens=24)
    for a, m in zip(alone, mixed[:2]):
        assert a.token_ids == m.token_ids
    assert _valid(SPECS[2], mixed[3].text)


def test_eos_only_in_accepting_states(llm):
    grammar = llm.grammars.compile(SPECS[1])
    for o in llm.generate(PROMPTS, [SamplingParams(structured=SPECS[1], temperature=2.0, seed=s)
                                    for s in range(4)], max_new_tokens=40):
        state = grammar.walk(o.token_ids[:-1])
        assert grammar.final[state] and o.token_ids[-1] in llm.eos_token_ids
        # every earlier state that was not accepting had EOS masked
        for i in range(len(o.token_ids) - 1):
            s = grammar.walk(o.token_ids[:i])
            assert grammar.step(s, 0) is None or grammar.final[s]


def test_a_budget_ending_inside_the_structure_finishes_with_length(llm):
    [o] = llm.generate(["x"], SamplingParams(structured=SPECS[0]), max_new_tokens=5)
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    grammar = llm.grammars.compile(SPECS[0])
    assert not grammar.final[grammar.walk(o.token_ids)]     # a prefix of the language


def test_min_tokens_with_a_constraint_is_refused(llm):
    """The constraint decides where the output ends (its accepting state may
    allow only EOS), so min_tokens > 0 is refused before any work."""
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        llm.generate(["q"], SamplingParams(structured=StructuredOutput(choice=("ab",))),
                     max_new_tokens=8, min_tokens=6)


def test_choice_distribution_is_the_renormalised_model_distribution(llm):
    """Over single-token choices the sampled frequencies follow the model's
    probabilities of those tokens, renormalised (chi-square, 600 draws)."""
    vocab = llm.tokenizer.backend.get_vocab(with_added_tokens=True)
    choice = ("a", "b", "c", "d")
    spec = StructuredOutput(choice=choice)
    n = 600
    outs = llm.generate(["q"] * n, [SamplingParams(structured=spec, temperature=1.0, seed=s)
                                    for s in range(n)], max_new_tokens=2)
    counts = np.array([sum(o.text == c for o in outs) for c in choice])
    assert counts.sum() == n
    logits = llm.score(["q"] * 4, [[vocab[c]] for c in choice])
    p = np.exp(np.array(logits) - max(logits))
    expected = n * p / p.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)      # p = 0.001, 3 degrees of freedom


def _check_speculation(llm, spec_llm, spec, max_new_tokens):
    """Greedy and three seeded rows under `spec` with `spec_llm`'s speculation:
    every output stops in the language, the greedy one equals `llm`'s plain
    decoding, and drafts were made."""
    params_ = [SamplingParams(structured=spec)] + [
        SamplingParams(structured=spec, temperature=1.2, seed=s) for s in range(3)]
    outs = spec_llm.generate(PROMPTS, params_, max_new_tokens=max_new_tokens)
    assert all(o.finish_reason == "stop" and _valid(spec, o.text) for o in outs), outs
    [plain] = llm.generate(PROMPTS[:1], params_[:1], max_new_tokens=max_new_tokens)
    assert outs[0].token_ids == plain.token_ids
    assert spec_llm.last_stats.drafted > 0


@pytest.mark.slow
def test_ngram_speculation_keeps_outputs_in_the_language_and_greedy_unchanged(llm):
    """Drafts are verified against the masked distribution: a draft outside
    the language has probability 0 there and is rejected at its position."""
    spec_llm = tiny_llm(speculative=SpecConfig(method="ngram", num_speculative_tokens=3))
    _check_speculation(llm, spec_llm, SPECS[0], max_new_tokens=80)


def test_bad_constraint_fails_before_any_work(llm):
    with pytest.raises(ValueError, match="row 1: structured output"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(
            structured=StructuredOutput(regex="(unclosed"))])


@pytest.mark.slow
def test_preempted_constrained_rows_resume_in_their_state():
    """A pool too small for every row at once: rows are preempted and
    recomputed, resuming in the automaton state after their generated tokens
    (`Grammar.walk`); outputs equal a run with a pool for all."""
    from jaxinfer.serving.request import Request
    from serving_runs import ids, run

    spec = StructuredOutput(regex="[a-z]{3}(-[0-9]{4}){5}")
    requests = [Request(ids(n, 90, 40 + n), SamplingParams(structured=spec, temperature=1.0,
                                                           seed=n), max_new_tokens=40)
                for n in (9, 14, 6, 11)]
    big = tiny_llm(page_size=4)
    small = tiny_llm(page_size=4, num_pages=14)
    small.programs = big.programs
    want = run(big.scheduler(4), requests, arrive=[0, 0, 1, 2])
    sched = small.scheduler(4)
    got = run(sched, requests, arrive=[0, 0, 1, 2])
    assert sched.num_preempted > 0
    assert [t for t, _ in got] == [t for t, _ in want]
    for tokens, _ in got:
        assert tokens[-1] == 0 and _valid(spec, small.tokenizer.decode(tokens[:-1]))


@pytest.mark.slow
def test_draft_model_speculation_keeps_outputs_in_the_language(llm):
    """The draft model proposes from its own masked distribution (its rows
    carry the grammar state too); verification keeps the output in the language."""
    from jaxinfer.speculative import DraftModel
    from jaxinfer.weights.prepare import prepare_params

    draft = DraftModel(CONFIG, prepare_params(params(seed=1), CONFIG), "random")
    spec_llm = tiny_llm(speculative=SpecConfig("draft", 3, draft=draft))
    _check_speculation(llm, spec_llm, SPECS[1], max_new_tokens=40)


@pytest.mark.slow      # 1-3 minutes each on a CPU
@pytest.mark.parametrize("speculative", [None, SpecConfig(method="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_a_thousand_seeded_samples_validate_against_the_schema(speculative):
    """1,000 sampled rows (seeds 0..999, temperature 1) under SCHEMA: every
    output ends with EOS and validates with `jsonschema`, with and without
    n-gram speculation."""
    spec_llm = tiny_llm(max_num_seqs=64, speculative=speculative)
    n = 1000
    outs = spec_llm.generate([PROMPTS[i % 4] for i in range(n)],
                             [SamplingParams(structured=SPECS[0], temperature=1.0, seed=s)
                              for s in range(n)], max_new_tokens=100)
    bad = [o.text for o in outs if o.finish_reason != "stop" or not _valid(SPECS[0], o.text)]
    assert len(outs) == n and bad == []
    assert len({o.text for o in outs}) > n // 2          # sampled, not one answer repeated
    if speculative is not None:
        assert spec_llm.last_stats.drafted > 0
