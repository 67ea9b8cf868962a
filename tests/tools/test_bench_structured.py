"""`jaxinfer bench --structured`'s plumbing on the tiny random model with a
character tokenizer (tests/structured_cases.py): the runs it makes, the
compile figures' automaton, the targets and the report from hand-made
results. No speed is asserted."""

import dataclasses

import pytest

from jaxinfer.config import StructuredOutput
from jaxinfer.sampling.grammar import GrammarCompiler
from jaxinfer.serving.llm import LLM
from jaxinfer_tools.bench import structured as S
from jaxinfer_tools.bench.run import _add_arguments
from structured_cases import CONFIG, VOCAB, ascii_tokenizer
from tiny import random_params

# The model's vocabulary is the tokenizer's (structured_cases pads it to 128),
# so an unconstrained row never draws an id the tokenizer cannot decode.
CONFIG = dataclasses.replace(CONFIG, vocab_size=len(VOCAB))

pytest.importorskip("outlines_core")

SERVE_COMPILE = ("10-field JSON schema compile, cold, before its first request decodes "
                 "(`jaxinfer serve`: host masks while the tables build) (s)")


@pytest.mark.slow
def test_the_row_runs_every_configuration_on_a_tiny_model():
    base = LLM(CONFIG, random_params(CONFIG, 0), ascii_tokenizer(), max_seq_len=256, decode_chunk=4)
    base.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    sweep = S.StructSweep(batches=(1, 2), prompts=2, new_tokens=12, max_seq_len=256, cache_repeats=3)
    results = S.measure_structured(base, sweep, log=lambda msg: None)
    assert [(r["batch"], r["mode"], r["outputs"]) for r in results["runs"]] == [
        (1, "none", 2), (2, "none", 2), (1, "device", 2), (2, "device", 2), (1, "host", 2),
        (2, "host", 2)]
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
        "B=2: constrained / unconstrained decode tokens/s", SERVE_COMPILE]
    assert c["host_cold_s"] > 0 and c["host_tokenizer_s"] > 0
    assert 0 < c["serve_first_s"] < c["serve_built_s"]
    report = S.format_structured(results)
    assert "| 2 | SCHEMA |" in report and "| 2 | SCHEMA, host-masked |" in report


def test_targets_and_report_from_hand_made_results():
    runs = [{"batch": b, "constrained": c, "decode_tokens_per_s": v, "decoded_tokens": 10,
             "outputs": 4, "stopped": 4, "parsed_json": 4 if c else 0}
            for b, c, v in ((1, False, 50.0), (16, False, 400.0), (1, True, 45.0), (16, True, 380.0))]
    results = {"sweep": {"batches": [1, 16]}, "runs": runs, "compile": {
        "vocabulary_s": 1.5, "cold_s": 2.5, "cached_s": 4e-6, "states": 179, "edges": 9000,
        "table_bytes": 3 << 20, "serve_first_s": 0.25, "serve_built_s": 2.75}}
    got = S.structured_targets(results)
    assert [(t["value"], t["result"]) for t in got] == [(0.95, "PASS"), (0.25, "FAIL")]
    results["runs"] = runs[:2]
    assert S.structured_targets(results)[0]["result"] == "not measured"
    results["targets"] = got
    report = S.format_structured(results).splitlines()
    assert report[0] == "jaxinfer: dtype -, weights -"
    assert report[4] == "| 1 | none | 50.0 | 10 | 4/4 | 0/4 |"
    assert report[7] == ("schema compile: vocabulary 1.5 s (once per tokenizer), cold 2.5 s, "
                         "cached 4 us; 179 states, 9000 edges, 3.00 MiB")
    assert report[11] == ("`jaxinfer serve` (GrammarCompiler(background=True)): SCHEMA's first "
                          "request decodes after 0.25 s under host masks; its device tables are "
                          "built 2.75 s after it arrived")
    assert report[-1] == f"| {SERVE_COMPILE} | 0.25 | < 0.1 | FAIL |"
    # with llama-server: a third target, jaxinfer's B=1 constrained speed over the peer's
    results["runs"] = runs
    results["peer"] = {"runs": [{"batch": 1, "constrained": c, "decode_tokens_per_s": v,
                                 "decoded_tokens": 9, "outputs": 4, "stopped": 4, "parsed_json": 4 * c}
                                for c, v in ((False, 60.0), (True, 50.0))]}
    got = S.structured_targets(results)
    assert (got[2]["name"], got[2]["value"], got[2]["result"]) == (
        "B=1 constrained decode tokens/s: jaxinfer / llama-server", 0.9, "FAIL")
    results["targets"] = got
    report = S.format_structured(results)
    assert "| 1 | SCHEMA | 50.0 | 9 | 4/4 | 4/4 |" in report
    results["peer"] = {"skipped": "llama-server is not built"}
    assert S.structured_targets(results)[2]["result"] == "not measured"
    assert "llama-server: skipped (llama-server is not built)" in S.format_structured(results)


def test_llama_server_runs_through_a_stand_in_server(tmp_path, monkeypatch):
    """`structured_peer.run_llama_server` against tests/fake_openai_server.py
    (llama-server's `timings` on each response): the request it sends, the
    tokens and seconds it sums, and the JSON it parses."""
    import pathlib
    import sys

    from jaxinfer_tools.bench import structured_peer as P

    script = pathlib.Path(__file__).parents[1] / "fake_openai_server.py"
    sent = []
    monkeypatch.setattr(P, "server_command", lambda name, port, **kw: sent.append((name, kw)) or (
        [sys.executable, str(script), "--port", str(port)], {}))
    out = P.run_llama_server("m.gguf", ["a", "b", "c"], 5, 64, S.SCHEMA, tmp_path, setup=False)
    assert sent[0][0] == "llamacpp" and sent[0][1]["max_num_seqs"] == 1 and not sent[0][1]["setup"]
    free, held = out["runs"]
    # 3 timed requests of 5 tokens: 4 after each first, over 3 x 10 ms
    assert (free["constrained"], free["decoded_tokens"], free["decode_s"]) == (False, 12, 0.03)
    assert free["decode_tokens_per_s"] == pytest.approx(400.0)
    assert (free["stopped"], free["parsed_json"]) == (0, 0)
    assert (held["constrained"], held["stopped"], held["parsed_json"]) == (True, 3, 3)
    assert P.response_format(S.SCHEMA)["json_schema"]["schema"] is S.SCHEMA


def test_llama_server_not_set_up_is_skipped_with_the_reason(tmp_path, monkeypatch):
    from jaxinfer_tools.bench import structured_peer as P

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    out = P.run_llama_server("m.gguf", ["a"], 5, 64, S.SCHEMA, tmp_path, setup=False)
    assert out == {"skipped": f"llama-server is not built "
                              f"({tmp_path}/peers/llama-server/build/bin/llama-server missing)"}


def test_the_flag_selects_the_row():
    import argparse

    p = argparse.ArgumentParser()
    _add_arguments(p)
    assert p.parse_args(["--config", "c.yaml", "--structured"]).structured
    assert not p.parse_args(["--config", "c.yaml"]).structured
    assert len(S.SCHEMA["properties"]) == 10 == len(S.SCHEMA["required"])
