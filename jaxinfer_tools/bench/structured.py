"""`jaxinfer bench --structured`: constrained decoding against unconstrained,
and the time to compile a JSON schema.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --structured [--quick]

Decode: the same chat prompts (asking for a JSON record of a city), greedy,
at each batch size (1 and 16), once with no constraint, once under SCHEMA,
a 10-field JSON schema (docs/structured.md), as device tables, and once
under SCHEMA masked on the host (llguidance, as a context-free grammar is:
`GrammarCompiler(max_table_bytes=0)`; its JSON grammar differs from
outlines-core's in whitespace, so its outputs may differ). Decode tokens/s is
`RunStats.decode_tokens_per_s` summed over the timed batches (tokens after
each request's first, over the time from the first first token to the last
request's end), after one warm-up batch per configuration that compiles.
Each run ends where its requests end (EOS, or the schema's closing brace),
so the two runs decode different token counts; tokens/s compares them. The
three configurations are separate `LLM`s over the same weights, so the
unconstrained one never traces the grammar tables.

Compile: a fresh `GrammarCompiler` over the model's tokenizer: the
vocabulary's bytes (once per tokenizer), SCHEMA's first compile (cold) and
its repeats (cached: the compiler's LRU, median of `cache_repeats`); then
the host path's tokenizer (once per tokenizer) and SCHEMA's cold compile
there.

Peer (`--peers all` or `llamacpp`): llama.cpp's `llama-server` on the
model's GGUF file, the same prompts and schema at batch 1, unconstrained and
with `response_format` json_schema (`structured_peer`); set up on first use
unless `--no-peer-setup`, skipped with the reason otherwise.

`jaxinfer serve` compiles in the background (`GrammarCompiler(background=True)`):
the time its `compile` takes to return SCHEMA's host grammar (a request
decodes under host masks from then on), and the time until its device
tables are built.

Targets (issue 30): constrained >= 0.9x unconstrained decode tokens/s at
batch 16; cold compile of the 10-field schema < 100 ms (the server's: until
a request with that schema decodes); constrained decode at batch 1 ahead of
llama-server's (> 1x).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Callable, Optional

from jaxinfer import LLM, SamplingParams
from jaxinfer.testing import GrammarCompiler, HostGrammar, StructuredOutput, resolve_model
from jaxinfer_tools.bench.common import loadavg, loadavg1
from jaxinfer_tools.bench.report import publish, target_row
from jaxinfer_tools.bench.structured_peer import peer_speed, run_llama_server

_TEXT = {"type": "string", "maxLength": 24}
# Ten fields, every one bounded, as a record an evaluation loop might ask for.
SCHEMA = {"type": "object", "properties": {
    "city": _TEXT, "country": _TEXT, "continent": {"enum": ["Africa", "Asia", "Europe",
                                                            "North America", "Oceania",
                                                            "South America"]},
    "population": {"type": "integer", "maxDigits": 9}, "area_km2": {"type": "number"},
    "capital": {"type": "boolean"}, "language": _TEXT, "currency": _TEXT,
    "founded": {"type": "integer", "maxDigits": 4}, "river": _TEXT},
    "required": ["city", "country", "continent", "population", "area_km2", "capital",
                 "language", "currency", "founded", "river"]}
CITIES = ("Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Rome", "Quito", "Berlin", "Madrid",
          "Nairobi", "Sydney", "Toronto", "Seoul", "Lagos", "Dublin")


@dataclasses.dataclass(frozen=True)
class StructSweep:
    batches: tuple[int, ...] = (1, 16)
    prompts: int = 16
    new_tokens: int = 192
    max_seq_len: int = 512
    cache_repeats: int = 1000


QUICK_STRUCT = StructSweep(batches=(1, 4), prompts=4, new_tokens=48, cache_repeats=100)


def prompts(n: int) -> list[str]:
    """`n` chat prompts asking for a city's JSON record (cities repeat past 16)."""
    return [f"Describe {CITIES[i % len(CITIES)]} as a JSON record: city, country, continent, "
            "population, area_km2, capital, language, currency, founded, river." for i in range(n)]


def measure_compile(tokenizer, vocab_size: int, repeats: int) -> dict:
    """Seconds to build the vocabulary, compile SCHEMA cold, and fetch it
    from the cache (median of `repeats`), with the automaton's size."""
    compiler = GrammarCompiler(tokenizer, vocab_size)
    spec = StructuredOutput(json_schema=SCHEMA)
    t0 = time.perf_counter()
    compiler.vocabulary()
    t1 = time.perf_counter()
    grammar = compiler.compile(spec)
    t2 = time.perf_counter()
    cached = []
    for _ in range(repeats):
        s = time.perf_counter()
        again = compiler.compile(StructuredOutput(json_schema=SCHEMA))
        cached.append(time.perf_counter() - s)
    if again is not grammar:
        raise RuntimeError("the grammar compile cache missed a repeated schema")
    host = GrammarCompiler(tokenizer, vocab_size, max_table_bytes=0)
    t3 = time.perf_counter()
    host.host_tokenizer()
    t4 = time.perf_counter()
    host.compile(spec)
    t5 = time.perf_counter()
    server = GrammarCompiler(tokenizer, vocab_size, background=True)   # as `jaxinfer serve` has it
    server.vocabulary()
    server.host_tokenizer()
    t6 = time.perf_counter()
    first = server.compile(spec)
    t7 = time.perf_counter()
    if not isinstance(first, HostGrammar) or not server.wait_built():
        raise RuntimeError("the background compile did not start on the host")
    t8 = time.perf_counter()
    if isinstance(server.compile(spec), HostGrammar):
        raise RuntimeError("the background compile built no device tables")
    return {"vocabulary_s": t1 - t0, "cold_s": t2 - t1, "cached_s": statistics.median(cached),
            "states": grammar.num_states, "edges": int(grammar.tokens.size),
            "table_bytes": grammar.nbytes, "host_tokenizer_s": t4 - t3, "host_cold_s": t5 - t4,
            "serve_first_s": t7 - t6, "serve_built_s": t8 - t6}


def run_decode(llm, texts: list[str], batch: int, new_tokens: int,
               spec: Optional[StructuredOutput], mode: str = "device") -> dict:
    """Greedy generation of `texts`, `batch` at a time, under `spec` (or
    none), one warm-up batch first; decode tokens/s over the timed batches
    and how many constrained outputs parsed as JSON."""
    params = SamplingParams(temperature=0.0, structured=spec)
    llm.generate(texts[:batch], params, max_new_tokens=new_tokens, chat=True)   # compiles
    decoded = seconds = parsed = stopped = 0
    for i in range(0, len(texts), batch):
        outs = llm.generate(texts[i:i + batch], params, max_new_tokens=new_tokens, chat=True)
        decoded += llm.last_stats.decoded_tokens
        seconds += llm.last_stats.decode_s
        stopped += sum(o.finish_reason == "stop" for o in outs)
        for o in outs:
            try:
                parsed += isinstance(json.loads(o.text), dict)
            except ValueError:
                pass
    return {"batch": batch, "constrained": spec is not None,
            "mode": mode if spec is not None else "none", "decoded_tokens": decoded,
            "decode_s": seconds, "decode_tokens_per_s": decoded / seconds if seconds else None,
            "outputs": len(texts), "stopped": stopped, "parsed_json": parsed,
            "loadavg_1m": loadavg1()}


def measure_structured(base, sweep: StructSweep, log=print,
                       peer: Optional[Callable[[list[str]], dict]] = None) -> dict:
    """The module docstring's measurements over the loaded `base` LLM
    (its config, weights and tokenizer); returns the results dict. `peer`,
    given, measures a peer on the same prompts (`structured_peer.run_llama_server`
    with the rest bound) and its result is kept under "peer"."""
    results = {"sweep": dataclasses.asdict(sweep), "schema": SCHEMA, "loadavg_start": loadavg()}
    log("schema compile: cold and cached")
    results["compile"] = measure_compile(base.tokenizer, base.config.vocab_size, sweep.cache_repeats)
    texts = prompts(sweep.prompts)
    results["runs"] = []
    schema = StructuredOutput(json_schema=SCHEMA)
    for spec, mode in ((None, "none"), (schema, "device"), (schema, "host")):
        llm = LLM(base.config, base.params, base.tokenizer, max_seq_len=sweep.max_seq_len,
                  decode_chunk=base.decode_chunk, max_num_seqs=max(sweep.batches))
        llm.programs.progress = base.programs.progress
        if mode == "host":
            llm.grammars.max_table_bytes = 0    # before its first compile: every constraint on the host
        for batch in sweep.batches:
            log(f"decode batch={batch} constraint={mode}")
            results["runs"].append(run_decode(llm, texts, batch, sweep.new_tokens, spec, mode))
    if peer is not None:
        results["peer"] = peer(texts)
    results["loadavg_end"] = loadavg()
    results["targets"] = structured_targets(results)
    return results


def _speed(runs: list, batch: int, constrained: bool, mode: str = "device") -> Optional[float]:
    return next((r["decode_tokens_per_s"] for r in runs
                 if (r["batch"], r["constrained"]) == (batch, constrained)
                 and r.get("mode", "device") in (mode, "none")), None)


def structured_targets(results: dict) -> list[dict]:
    """Issue 30's targets: constrained / unconstrained decode tokens/s at
    the largest batch (>= 0.9), the schema's cold compile (< 0.1 s) and,
    where llama-server was measured, constrained decode at batch 1 against
    its constrained decode (> 1)."""
    runs, batch = results["runs"], max(results["sweep"]["batches"])
    free, held = _speed(runs, batch, False), _speed(runs, batch, True)
    out = [target_row(f"B={batch}: constrained / unconstrained decode tokens/s",
                      held / free if held and free else None, ">=", 0.9),
           target_row("10-field JSON schema compile, cold, before its first request decodes "
                      "(`jaxinfer serve`: host masks while the tables build) (s)",
                      results["compile"].get("serve_first_s"), "<", 0.1)]
    if "peer" in results:
        ours, theirs = _speed(runs, 1, True), peer_speed(results["peer"], True)
        out.append(target_row("B=1 constrained decode tokens/s: jaxinfer / llama-server",
                              ours / theirs if ours and theirs else None, ">", 1.0))
    return out


def format_structured(results: dict) -> str:
    fmt = lambda x, spec=".3g": "-" if x is None else format(x, spec)
    c = results["compile"]
    lines = [f"jaxinfer: dtype {results.get('dtype', '-')}, weights {results.get('weights', '-')}", "",
             "| B | constraint | decode tok/s | tokens | stopped | parsed JSON |",
             "|---|---|---|---|---|---|"]
    for r in results["runs"]:
        name = {"none": "none", "device": "SCHEMA", "host": "SCHEMA, host-masked"}[r.get("mode", "device")
                                                                          if r["constrained"] else "none"]
        lines.append(f"| {r['batch']} | {name} | "
                     f"{fmt(r['decode_tokens_per_s'], '.1f')} | {r['decoded_tokens']} | "
                     f"{r['stopped']}/{r['outputs']} | {r['parsed_json']}/{r['outputs']} |")
    peer = results.get("peer")
    if peer is not None and "skipped" in peer:
        lines += ["", f"llama-server: skipped ({peer['skipped']})"]
    elif peer is not None:
        lines += ["", "llama-server (same prompts, one slot, `response_format` json_schema):", "",
                  "| B | constraint | decode tok/s | tokens | stopped | parsed JSON |",
                  "|---|---|---|---|---|---|"]
        for r in peer["runs"]:
            lines.append(f"| 1 | {'SCHEMA' if r['constrained'] else 'none'} | "
                         f"{fmt(r['decode_tokens_per_s'], '.1f')} | {r['decoded_tokens']} | "
                         f"{r['stopped']}/{r['outputs']} | {r['parsed_json']}/{r['outputs']} |")
    lines += ["", f"schema compile: vocabulary {fmt(c['vocabulary_s'])} s (once per tokenizer), "
                  f"cold {fmt(c['cold_s'])} s, cached {fmt(c['cached_s'] * 1e6)} us; "
                  f"{c['states']} states, {c['edges']} edges, {c['table_bytes'] / 2**20:.2f} MiB",
              "", f"host-masked (llguidance): tokenizer {fmt(c.get('host_tokenizer_s'))} s (once per "
                  f"tokenizer), SCHEMA cold {fmt(c.get('host_cold_s'))} s",
              "", f"`jaxinfer serve` (GrammarCompiler(background=True)): SCHEMA's first request "
                  f"decodes after {fmt(c.get('serve_first_s'))} s under host masks; its device "
                  f"tables are built {fmt(c.get('serve_built_s'))} s after it arrived",
              "", "| target | measured | goal | result |", "|---|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['name']} | {fmt(t['value'])} | {t['op']} {t['goal']:g} | {t['result']} |")
    return "\n".join(lines)


def cmd_structured(args, cfg, sweep: StructSweep) -> int:
    log = (lambda msg: None) if args.no_progress else (
        lambda msg: print(f"[structured] {msg}", file=sys.stderr, flush=True))
    base = LLM.load(cfg.model, dtype=cfg.dtype, weights=cfg.weights, activations=cfg.activations,
                    max_seq_len=sweep.max_seq_len, decode_chunk=cfg.decode_chunk)
    peer = None
    if args.peers in ("all", "llamacpp"):
        gguf, logs = str(resolve_model(cfg.model)), pathlib.Path(args.out)
        peer = lambda texts: run_llama_server(  # noqa: E731
            gguf, texts, sweep.new_tokens, sweep.max_seq_len, SCHEMA, logs,
            setup=not args.no_peer_setup, log=log)
    results = {**measure_structured(base, sweep, log, peer), "dtype": cfg.dtype, "weights": cfg.weights}
    return publish(results, cfg, args.out, "structured", format_structured, pages=args.pages)
