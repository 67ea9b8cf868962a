"""Structured output on SmolLM2-135M-Instruct (slow: the real model and its
49,152-token vocabulary): schema-constrained chat answers to 32 prompts parse
and follow the schema, greedy and sampled, with unconstrained neighbours
unchanged."""

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

from jaxinfer.config import SamplingParams, StructuredOutput  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "country": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer", "maxDigits": 9}},
          "required": ["city", "country", "population"]}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Rome", "Quito", "Berlin", "Madrid",
          "Nairobi", "Sydney", "Toronto", "Seoul", "Lagos", "Dublin", "Vienna", "Hanoi", "Bogota",
          "Athens", "Lisbon", "Prague", "Manila", "Santiago", "Helsinki", "Dakar", "Havana",
          "Jakarta", "Warsaw", "Tunis", "Beijing", "Ottawa"]
assert len(set(CITIES)) == 32


@pytest.fixture(scope="module")
def llm(real_model_path):
    from jaxinfer.serving.llm import LLM

    real_model_path(MODEL)
    return LLM.load(MODEL, max_seq_len=256, max_num_seqs=32, decode_chunk=8, progress=False)


def test_schema_constrained_answers_follow_the_schema(llm):
    prompts = [f"Describe {c} as JSON with city, country and population." for c in CITIES]
    spec = StructuredOutput(json_schema=SCHEMA)
    params = [SamplingParams(structured=spec, temperature=0.0 if i < 16 else 0.8, seed=i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, chat=True, max_new_tokens=96)
    assert len(outs) == 32
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    free = llm.generate(prompts[:2], chat=True, max_new_tokens=24)
    mixed = llm.generate(prompts[:3], [SamplingParams(), SamplingParams(),
                                       SamplingParams(structured=spec)], chat=True,
                         max_new_tokens=24)
    assert [o.token_ids for o in free] == [o.token_ids for o in mixed[:2]]
