"""examples/rl_rollouts.py (#54, item 6): REINFORCE with jaxinfer's rollouts,
a few steps on its tiny model: the reward rises, the trainer's log-probs
(`jaxinfer.token_logprobs` inside its jitted `value_and_grad`) equal the
rollouts' within 1e-5 (bitwise with deterministic=True), and after the
first step nothing compiles (the rollouts, the gradient step and
`update_weights` reuse their programs)."""

from __future__ import annotations

import pathlib

import pytest

from jaxinfer.serving.loading import import_python_file

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_rollouts.py"


def _check(history, bound: float) -> None:
    rewards = [h["reward"] for h in history]
    assert max(rewards[-2:]) > rewards[0] + 0.1, rewards
    assert max(h["logp_diff"] for h in history) <= bound, history
    assert [h["compiles"] for h in history[1:]] == [0] * (len(history) - 1), history
    assert history[0]["compiles"] > 0          # the counter sees XLA's compiles


def test_the_rl_example_learns_its_task_on_the_engines_log_probs():
    """Default mode: log-probs within float32 rounding (measured up to 2e-6)."""
    _check(import_python_file(EXAMPLE).run(steps=5, log=lambda line: None), 1e-5)


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
def test_the_deterministic_rl_example_has_importance_ratio_one():
    _check(import_python_file(EXAMPLE).run(steps=5, deterministic=True, log=lambda line: None), 0.0)
