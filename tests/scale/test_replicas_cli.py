"""`jaxinfer serve --replicas`' usage errors: refused before Ray or a model
is touched (the replicas themselves: test_replicas.py)."""

import pytest

from jaxinfer import cli


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "-1"], "--replicas and --replica-cpus must be >= 0"),
    (["--replicas", "2", "--prefill-workers", "1"], "cannot be combined"),
])
def test_serve_replicas_usage_errors(flags, message, capsys):
    assert cli.main(["serve", *flags, "max_seq_len=32"]) == 2
    assert message in capsys.readouterr().err
