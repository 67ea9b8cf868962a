"""GenerationConfig: YAML + key=value overrides, and the CLI's clean errors."""

import pytest

from jaxinfer.cli import main
from jaxinfer.config import GenerationConfig


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: x.gguf\ntemperature: 0.5\nstop: ['END']\n")
    cfg = GenerationConfig.load(str(path), ("top_p=0.9", "seed=3", "chat=false", "stop=[a, b]"))
    assert (cfg.model, cfg.temperature, cfg.top_p, cfg.seed, cfg.chat, cfg.stop) == (
        "x.gguf", 0.5, 0.9, 3, False, ("a", "b"))


def test_unknown_key_rejected():
    with pytest.raises(ValueError, match=r"unknown config keys \['temprature'\]"):
        GenerationConfig.load(None, ("temprature=0.5",))


@pytest.mark.parametrize("override,message", [
    ("temperature=abc", "temperature must be float, got 'abc'"),
    ("chat=maybe", "chat must be bool, got 'maybe'"),
    ("max_new_tokens=2.5", "max_new_tokens must be int, got 2.5"),
    ("max_new_tokens=true", "max_new_tokens must be int, got True"),
    ("system_prompt=yes", "system_prompt must be a string or null, got True"),
    ("stop=5", "stop must be a string or a list of strings, got 5"),
    ("seed=abc", "seed must be an integer or null, got 'abc'"),
    ("dtype=int8", "dtype must be float32, bfloat16 or float16"),
    ("max_new_tokens=0", "max_new_tokens must be >= 1, got 0"),
    ("novalue", "override 'novalue' is not key=value"),
])
def test_bad_values_rejected(override, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        GenerationConfig.load(None, (override,))


def test_cli_reports_bad_model_without_traceback(capsys):
    rc = main(["generate", "--prompt", "hi", "model=no-such-model-name"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown model 'no-such-model-name'" in err and "Traceback" not in err


def test_cli_rejects_bad_sampling_before_loading(capsys):
    rc = main(["generate", "--prompt", "hi", "model=no-such-model-name", "temperature=-1"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err  # reported before the model lookup
