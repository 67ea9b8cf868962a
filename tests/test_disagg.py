"""Prefill/decode disaggregation (`jaxinfer.disagg`) against the colocated
engine: identical greedy and seeded tokens (prompts longer than the tiny
Gemma's window, a request arriving while others decode), nothing left held
or reserved afterwards; on one host with separate device sets (different
tp on the two sides) and across processes (jax.distributed on 127.0.0.1,
jax.experimental.transfer), and a prefill process killed mid-request.
"""

from __future__ import annotations

import pytest

from multidevice import run_case


@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("gemma3", 1, 2), ("gemma3", 2, 1),
                                                        ("llama", 1, 1), ("smollm2_heads", 3, 1)])
def test_device_sets_match_colocated(model, prefill_tp, decode_tp):
    r = run_case(4, "disagg_cases", "device_sets", model=model, prefill_tp=prefill_tp,
                 decode_tp=decode_tp)
    got = r["disaggregated"]
    assert [got[str(i)][0] for i in range(len(r["colocated"]))] == r["colocated"]
    assert all(got[k][1] == "length" for k in got)
    assert r["held"] == 0 and r["in_flight"] == {"prefilling": 0, "receiving": 0, "draining": 0}
    assert not any(r["slots"])
    assert r["decode_devices"] == sorted(r["decode_mesh"])       # the KV really lives on mesh B
    assert len(r["transfers"]) == len(r["colocated"]) and all(t["bytes"] > 0 for t in r["transfers"])
