"""The serving benchmark's traces: every request fits the max_seq_len the
bench loads the model with (a 2,048-token prompt + 16 new tokens once
overflowed the config's 2,048 after 17 minutes of running)."""

import math

import pytest

from jaxinfer.tools.bench.serving import LONG_OUTPUT, QUICK_SERVING, ServingSweep, make_trace, mixed_trace


@pytest.mark.parametrize("sweep,expected", [(ServingSweep(), 2048 + LONG_OUTPUT),
                                            (QUICK_SERVING, 512 + LONG_OUTPUT)])
def test_every_trace_request_fits_the_sweeps_max_seq_len(sweep, expected):
    assert sweep.max_seq_len == expected
    traces = [make_trace(1000, sweep.num_requests, sweep.prompt_len, sweep.output_len, sweep.rate,
                         sweep.seed),
              make_trace(1000, sweep.num_requests, sweep.prompt_len, sweep.output_len, math.inf,
                         sweep.seed),
              mixed_trace(1000, sweep)]
    longest = max(len(r.prompt_ids) + r.max_new_tokens for trace in traces for r in trace)
    assert longest <= sweep.max_seq_len
    assert sum(r.kind == "long" for r in traces[2]) == sweep.long_prompts


def test_worker_error_tail_drops_progress_bars():
    from jaxinfer.tools.bench.common import error_tail

    stderr = ("Loading weights:   0%|          | 0/272 [00:00<?, ?it/s]\r"
              "Loading weights: 100%|##########| 272/272 [00:00<00:00, 22271.37it/s]\n"
              "Traceback (most recent call last):\n  ...\nMemoryError: out of memory\n"
              "Converting: 90%|######### | 246/272 [00:01<00:00, 290.69it/s]\n")
    assert error_tail(stderr) == "Traceback (most recent call last):\n  ...\nMemoryError: out of memory"
    assert error_tail(stderr, chars=9) == "of memory"
