"""Prefill/decode disaggregation: prompts are prefilled by prefill workers
on their own devices (or processes), the pages of their KV move to the
decode worker, which decodes every running request in its slots.

    scheduler.py        DisaggScheduler: the colocated Scheduler with remote prefill
    transfer.py         LocalTransport (jax.device_put) / PullTransport (jax.experimental.transfer)
    worker.py           PrefillWorker: the device work of one prefill worker
    local.py            ThreadPrefillClient: workers on device sets of this process
    process.py          worker processes joined by jax.distributed, supervised by the decode process
    process_worker.py   the prefill worker process's main loop
    engine.py           DisaggEngine: the EngineThread interface (submit / events / abort / health)

Why (DistServe, Zhong et al., OSDI 2024, arXiv:2401.09670): prefill is
compute-bound and decode bandwidth-bound; on shared devices every long
prompt stalls the decodes around it.
"""

from __future__ import annotations

import jax

from jaxinfer.parallel.disagg.scheduler import DisaggScheduler, FailedOutput, PrefillResult
from jaxinfer.parallel.disagg.transfer import LocalTransport, PullTransport, Ticket, TransferError
from jaxinfer.tokenizer import IncrementalDetokenizer


def make_scheduler(decode_llm, client, max_num_seqs=None, **kwargs) -> DisaggScheduler:
    """A `DisaggScheduler` over a new runner of `decode_llm` (an `LLM` on the
    decode mesh, `sharding.load_llm` / `tensor_parallel_llm`), receiving
    from `client`, detokenizing with its tokenizer, on its compile-free
    clock; received pages get each KV head repeated for its plan. kwargs go
    to `DisaggScheduler` (transfer_timeout_s, max_waiting_requests, ...)."""

    tok = decode_llm.tokenizer
    plan = getattr(decode_llm, "sharding_plan", None)
    mesh = getattr(decode_llm.programs, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    kwargs.setdefault("prefill_chunk_size", decode_llm.prefill_chunk_size)
    kwargs.setdefault("decode_chunk", decode_llm.decode_chunk)
    kwargs.setdefault("prefix_caching", decode_llm.prefix_caching)
    return DisaggScheduler(decode_llm.runner(max_num_seqs or decode_llm.max_num_seqs), client, device,
                           kv_repeat=plan.kv_repeat if plan is not None else 1,
                           detokenizer_factory=(lambda: IncrementalDetokenizer(tok)) if tok else None,
                           stop_token_ids=decode_llm.stop_token_ids,
                           eos_token_ids=decode_llm.eos_token_ids, clock=decode_llm.programs.clock,
                           **kwargs)


__all__ = ["DisaggScheduler", "FailedOutput", "LocalTransport", "PrefillResult", "PullTransport",
           "Ticket", "TransferError", "make_scheduler"]
