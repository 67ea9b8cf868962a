"""Strict tool calls on a real model (issue #55, item 1's target): `auto`
and `required` turns on SmolLM2-135M-Instruct served with
examples/chatml_tools.jinja, through the `openai` client.

    python benchmarks/tool_calls.py [--turns 500] [--concurrency 8]

Each turn asks one of a few questions, with two tools (`get_weather`,
`get_time`), tool_choice auto or required (half each), with or without
examples of calls in the conversation, parallel_tool_calls true or false,
sampled (temperature 1, seed = the turn's number). Every returned call must
parse and follow its tool's schema; a turn with parallel_tool_calls false
may hold one call at most; a required turn must hold a call unless its
token limit cut it. Then, once every automaton is on the device, the
greedy turns of each kind are asked whole and streamed: the calls
reassembled from the chunks must equal the whole reply's.

Prints the CPU and its load average, then: turns, calls, turns with calls,
turns cut by the limit, malformed calls (target 0), parallel violations
(target 0), required turns without a call that were not cut (target 0),
streamed turns unequal to the whole (target 0), and the wall time. Run it
alone on the machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import time

import jsonschema
import openai

from jaxinfer import LLM
from jaxinfer.kernels.cpu import cpu_flags
from jaxinfer.server import ServerThread, build_server

MODEL = "smollm2-135m-instruct"
TEMPLATE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "chatml_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"]}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in SCHEMAS.items()]
QUESTIONS = ["What is the weather in Paris?", "What time is it in UTC?",
             "What is the weather in Rome and in Oslo?", "Tell me a joke."]


def _cpu() -> str:
    info = open("/proc/cpuinfo").read().splitlines()
    name = next(line for line in info if line.startswith("model name")).split(":", 1)[1].strip()
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}), {os.cpu_count()} cores"


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


SHOTS = [{"role": "user", "content": "What is the weather in Berlin?"},
         {"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Berlin"})]},
         {"role": "user", "content": "What time is it in CET?"},
         {"role": "assistant", "tool_calls": [_call("get_time", {"zone": "CET"})]}]


def _request(i: int) -> dict:
    """The i-th turn's request fields."""
    question = QUESTIONS[i % len(QUESTIONS)]
    messages = (SHOTS if (i // 4) % 2 else []) + [{"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 96,
            "tool_choice": "required" if (i // 8) % 2 else "auto",
            "parallel_tool_calls": bool((i // 16) % 2 == 0), "temperature": 1.0, "seed": i}


def _malformed(calls) -> int:
    bad = 0
    for call in calls or []:
        try:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            bad += 1
    return bad


def _streamed_calls(client, fields: dict) -> list[tuple[str, str]]:
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **fields):
        for t in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(t.index, [t.function.name, ""])
            entry[1] += t.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    print(f"cpu: {_cpu()}; load average before: {os.getloadavg()}")
    llm = LLM.load(MODEL, max_seq_len=1024, max_num_seqs=args.concurrency, progress=False,
                   chat_template=str(TEMPLATE))
    server = build_server(llm, model_name=MODEL, max_num_seqs=args.concurrency,
                          max_waiting_requests=4 * args.concurrency)
    with ServerThread(server.app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(pool.map(
                lambda i: (i, client.chat.completions.create(**_request(i)).choices[0]),
                range(args.turns)))
        wall = time.perf_counter() - start
        counts = dict.fromkeys(["calls", "turns with calls", "cut by the limit", "malformed calls",
                                "parallel violations", "required without a call"], 0)
        for i, reply in replies:
            calls, fields = reply.message.tool_calls or [], _request(i)
            counts["calls"] += len(calls)
            counts["turns with calls"] += bool(calls)
            counts["cut by the limit"] += reply.finish_reason == "length"
            counts["malformed calls"] += _malformed(calls)
            counts["parallel violations"] += (not fields["parallel_tool_calls"]) and len(calls) > 1
            counts["required without a call"] += (fields["tool_choice"] == "required" and not calls
                                                  and reply.finish_reason != "length")
        for i in range(16):             # every kind's automaton built: a turn masked on the
            client.chat.completions.create(**{**_request(i), "max_tokens": 1})   # host may
        llm.grammars.wait_built(600)    # take other tokens for the same text
        unequal = 0
        for i in range(16):             # greedy: every kind of turn, whole then streamed
            fields = {**_request(i), "temperature": 0}
            whole = client.chat.completions.create(**fields).choices[0].message.tool_calls or []
            unequal += [(c.function.name, c.function.arguments) for c in whole] != \
                _streamed_calls(client, fields)
    print(f"turns: {args.turns} ({args.concurrency} at a time), wall {wall:.1f} s")
    for name, value in counts.items():
        print(f"{name}: {value}")
    print(f"streamed turns unequal to the whole: {unequal} of 16")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
