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
from jaxinfer.serving.settings import SCHEDULER_KEYS
from jaxinfer.tokenizer import IncrementalDetokenizer


def make_scheduler(decode_llm, client, max_num_seqs=None, **kwargs) -> DisaggScheduler:
    """A `DisaggScheduler` over a new runner of `decode_llm` (an `LLM` on the
    decode mesh, `sharding.load_llm` / `tensor_parallel_llm`), receiving
    from `client`, detokenizing with its tokenizer, on its compile-free
    clock; received pages get each KV head repeated for its plan. kwargs:
    `SchedulerConfig` fields over the LLM's (max_waiting_requests, ...),
    and the others go to `DisaggScheduler` (transfer_timeout_s, ...)."""

    tok = decode_llm.tokenizer
    plan = getattr(decode_llm, "sharding_plan", None)
    mesh = getattr(decode_llm.programs, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
    fields = {k: kwargs.pop(k) for k in SCHEDULER_KEYS if k in kwargs}
    sched = decode_llm.scheduler_config.replace(
        max_num_seqs=max_num_seqs or decode_llm.max_num_seqs, **fields)
    runner = decode_llm.runner(sched.max_num_seqs, sched)
    return DisaggScheduler(runner, client, device, scheduler_config=sched,
                           cache_config=runner.cache_config,
                           kv_repeat=plan.kv_repeat if plan is not None else 1,
                           detokenizer_factory=(lambda: IncrementalDetokenizer(tok)) if tok else None,
                           tokens=decode_llm.tokens, clock=decode_llm.programs.clock, **kwargs)


__all__ = ["DisaggScheduler", "FailedOutput", "LocalTransport", "PrefillResult", "PullTransport",
           "Ticket", "TransferError", "make_scheduler"]
