"""Disaggregated serving on a tiny model, in one process (a prefill worker
thread, the decode scheduler here): a fault injected for one request at
its prefill worker's offer, its KV transfer, or the insert of its pages on
the decode side ends that request with a FailedOutput naming the stage;
the other requests generate exactly the colocated engine's tokens, and no
slot, page or held payload is left behind."""

import threading

import pytest

from jaxinfer.parallel.disagg import FailedOutput, TransferError, make_scheduler
from jaxinfer.parallel.disagg.local import ThreadPrefillClient
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving import faults
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request, RequestOutput
from disagg_cases import drive
from tiny import TINY_LLAMA, random_params

KWARGS = dict(max_seq_len=48, decode_chunk=4, prefill_chunk_size=None, max_num_seqs=4,
              num_pages=64)
REQUESTS = [(list(range(3, 20)), SamplingParams(), 8),
            ([5, 9, 2, 7, 7, 1], SamplingParams(temperature=0.9, top_p=0.95, seed=77), 10),
            (list(range(40, 29, -1)), SamplingParams(), 6),
            ([8, 8, 3, 90, 4, 4, 4, 6, 1], SamplingParams(temperature=0.7, seed=5), 9)]
FAULTY = 2                         # the request the fault is injected into: 11 prompt tokens


def _llm():
    return LLM(TINY_LLAMA, random_params(TINY_LLAMA, seed=11), **KWARGS)


@pytest.fixture(scope="module")
def colocated():
    out = _llm().generate([p for p, _, _ in REQUESTS], [s for _, s, _ in REQUESTS],
                          max_new_tokens=[m for _, _, m in REQUESTS], ignore_eos=True)
    return [c.token_ids for c in out]


def _faulty_length(n) -> bool:
    return int(n) == len(REQUESTS[FAULTY][0])


@pytest.mark.parametrize("stage,message", [
    ("offer", "prefill worker 0: RuntimeError: injected offer fault"),
    ("transfer", "prefill worker 0: TransferError: KV transfer failed: injected"),
    ("insert", "receiving from prefill worker 0: RuntimeError: injected insert fault"),
])
def test_a_fault_at_one_stage_fails_only_its_request(colocated, stage, message):
    client = ThreadPrefillClient([_llm()])
    transport = client.transport()
    scheduler = make_scheduler(_llm(), client, 4)
    faulty_keys, seating = set(), threading.local()
    offer, receive = transport.offer, transport.receive
    write, seat_one = scheduler.runner.write_pages, scheduler._seat_one

    def faulty_offer(payload, device):
        if _faulty_length(payload["length"]):
            if stage == "offer":
                raise RuntimeError("injected offer fault")
            ticket = offer(payload, device)
            faulty_keys.add(ticket.key)
            return ticket
        return offer(payload, device)

    def faulty_receive(ticket, device, timeout_s=60.0):
        if stage == "transfer" and ticket.key in faulty_keys:
            raise TransferError("KV transfer failed: injected")
        return receive(ticket, device, timeout_s)

    def faulty_seat(rid, payload):
        seating.length = int(payload["length"])
        return seat_one(rid, payload)

    def faulty_write(pages, data, to_repeat=1):
        if stage == "insert" and _faulty_length(seating.length):
            raise RuntimeError("injected insert fault")
        return write(pages, data, to_repeat)

    transport.offer, transport.receive = faulty_offer, faulty_receive
    scheduler._seat_one, scheduler.runner.write_pages = faulty_seat, faulty_write
    try:
        requests = [Request(p, s, m, ignore_eos=True) for p, s, m in REQUESTS]
        got = drive(scheduler, requests, timeout_s=600)
    finally:
        client.close()
    tokens, reason, error = got[str(FAULTY)]
    assert (tokens, reason, error) == ([], "error", message)
    others = [i for i in range(len(REQUESTS)) if i != FAULTY]
    assert [got[str(i)][0] for i in others] == [colocated[i] for i in others]
    assert all(got[str(i)][1] == "length" for i in others)
    assert transport.num_held == 0 and scheduler.num_waiting == 0
    assert scheduler.num_in_flight == {"prefilling": 0, "receiving": 0, "draining": 0}
    assert scheduler.slots == [None] * 4 and scheduler.kv_pages.num_used == 0
    assert client.workers[0].pages.pool.num_used == 0


def test_failed_output_is_the_serving_one():
    """Disaggregation re-exports the engine's one failure event."""
    assert FailedOutput is faults.FailedOutput and issubclass(FailedOutput, RequestOutput)
