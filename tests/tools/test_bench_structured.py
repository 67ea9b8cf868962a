"""`jaxinfer bench --structured`'s plumbing on the tiny random model with a
character tokenizer (tests/structured_cases.py): the runs it makes, the
compile figures' automaton, the targets and the report from hand-made
results. No speed is asserted."""

import dataclasses

import pytest

from jaxinfer.config import StructuredOutput
from jaxinfer.sampling.grammar import GrammarCompiler
from jaxinfer.serving.llm import LLM
from jaxinfer.tools.bench import structured as S
from jaxinfer.tools.bench.run import _add_arguments
from structured_cases import CONFIG, VOCAB, ascii_tokenizer
from tiny import random_params

# The model's vocabulary is the tokenizer's (structured_cases pads it to 128),
# so an unconstrained row never draws an id the tokenizer cannot decode.
CONFIG = dataclasses.replace(CONFIG, vocab_size=len(VOCAB))

pytest.importorskip("outlines_core")


@pytest.mark.slow
def test_the_row_runs_every_configuration_on_a_tiny_model():
    base = LLM(CONFIG, random_params(CONFIG, 0), ascii_tokenizer(), max_seq_len=256, decode_chunk=4,
               min_kv_bucket=16)
    base.tokenizer.hf_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    sweep = S.StructSweep(batches=(1, 2), prompts=2, new_tokens=12, max_seq_len=256, cache_repeats=3)
    results = S.measure_structured(base, sweep, log=lambda msg: None)
    assert [(r["batch"], r["constrained"], r["outputs"]) for r in results["runs"]] == [
        (1, False, 2), (2, False, 2), (1, True, 2), (2, True, 2)]
    for r in results["runs"]:
        assert r["decoded_tokens"] > 0 and r["decode_s"] > 0
        if r["constrained"]:      # 12 tokens cannot close a 10-field object
            assert (r["stopped"], r["parsed_json"], r["decoded_tokens"]) == (0, 0, 2 * 11)
    grammar = GrammarCompiler(base.tokenizer, CONFIG.vocab_size).compile(
        StructuredOutput(json_schema=S.SCHEMA))
    c = results["compile"]
    assert (c["states"], c["edges"], c["table_bytes"]) == (
        grammar.num_states, grammar.tokens.size, grammar.nbytes)
    assert [t["name"] for t in results["targets"]] == [
        "B=2: constrained / unconstrained decode tokens/s", "10-field JSON schema compile, cold (s)"]
    assert "| 2 | SCHEMA |" in S.format_structured(results)


def test_targets_and_report_from_hand_made_results():
    runs = [{"batch": b, "constrained": c, "decode_tokens_per_s": v, "decoded_tokens": 10,
             "outputs": 4, "stopped": 4, "parsed_json": 4 if c else 0}
            for b, c, v in ((1, False, 50.0), (16, False, 400.0), (1, True, 45.0), (16, True, 380.0))]
    results = {"sweep": {"batches": [1, 16]}, "runs": runs, "compile": {
        "vocabulary_s": 1.5, "cold_s": 0.25, "cached_s": 4e-6, "states": 179, "edges": 9000,
        "table_bytes": 3 << 20}}
    got = S.structured_targets(results)
    assert [(t["value"], t["result"]) for t in got] == [(0.95, "PASS"), (0.25, "FAIL")]
    results["runs"] = runs[:2]
    assert S.structured_targets(results)[0]["result"] == "n/a"
    results["targets"] = got
    report = S.format_structured(results).splitlines()
    assert report[2] == "| 1 | none | 50.0 | 10 | 4/4 | 0/4 |"
    assert report[5] == ("schema compile: vocabulary 1.5 s (once per tokenizer), cold 0.25 s, "
                         "cached 4 us; 179 states, 9000 edges, 3.00 MiB")
    assert report[-1] == "| 10-field JSON schema compile, cold (s) | 0.25 | < 0.1 | FAIL |"


def test_the_flag_selects_the_row():
    import argparse

    p = argparse.ArgumentParser()
    _add_arguments(p)
    assert p.parse_args(["--config", "c.yaml", "--structured"]).structured
    assert not p.parse_args(["--config", "c.yaml"]).structured
    assert len(S.SCHEMA["properties"]) == 10 == len(S.SCHEMA["required"])
