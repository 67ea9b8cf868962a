"""GenerationConfig: YAML + key=value overrides, and the CLI's clean errors."""

import re

import pytest

from jaxinfer.cli import main
from jaxinfer.config import GenerationConfig
from jaxinfer.sampling import SamplingParams


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: x.gguf\ntemperature: 0.5\nstop: ['END']\n")
    cfg = GenerationConfig.load(str(path), ("top_p=0.9", "seed=3", "chat=false", "stop=[a, b]"))
    assert (cfg.model, cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.seed, cfg.chat,
            cfg.stop) == ("x.gguf", 0.5, 0.9, 3, False, ("a", "b"))


def test_unknown_key_rejected():
    with pytest.raises(ValueError, match=r"unknown config keys \['temprature'\]"):
        GenerationConfig.load(None, ("temprature=0.5",))


@pytest.mark.parametrize("override,error,message", [
    ("temperature=abc", TypeError, "SamplingParams.temperature must be a real number, got 'abc'"),
    ("chat=maybe", ValueError, "chat must be bool, got 'maybe'"),
    ("max_new_tokens=2.5", ValueError, "max_new_tokens must be int, got 2.5"),
    ("max_new_tokens=true", ValueError, "max_new_tokens must be int, got True"),
    ("system_prompt=yes", ValueError, "system_prompt must be a string or null, got True"),
    ("stop=5", ValueError, "stop must be a string or a list of strings, got 5"),
    ("seed=abc", TypeError, "SamplingParams.seed must be an int or None, got 'abc'"),
    ("top_k=-3", ValueError,
     "SamplingParams.top_k must be >= -1 (0 and -1 mean no top-k filter), got -3"),
    ("dtype=int8", ValueError, "dtype must be float32, bfloat16 or float16"),
    ("max_new_tokens=0", ValueError, "max_new_tokens must be >= 1, got 0"),
    ("novalue", ValueError, "override 'novalue' is not key=value"),
    ("sampling=1", ValueError, "unknown config keys ['sampling']"),
    ("repetition_penalty=1.0e+300", ValueError, "SamplingParams.repetition_penalty must be at most "
     "3.402823e+38 in magnitude (float32), got 1e+300"),
])
def test_bad_values_rejected(override, error, message):
    with pytest.raises(error, match=re.escape(message)):
        GenerationConfig.load(None, (override,))


def test_int8_activations_need_q4_weights():
    with pytest.raises(ValueError, match=re.escape("activations=int8 needs weights=q4 (int8 "
                                                   "activations multiply 4-bit weights), got "
                                                   "weights='int8'")):
        GenerationConfig.load(None, ("weights=int8", "activations=int8"))
    with pytest.raises(ValueError, match=re.escape("activations must be float32 or int8, got 'int4'")):
        GenerationConfig.load(None, ("weights=q4", "activations=int4"))
    assert GenerationConfig.load(None, ("weights=q4", "activations=int8")).activations == "int8"


def test_int8_activations_without_the_int8_kernel_fail_before_loading(monkeypatch):
    from jaxinfer.kernels import quant as quant_kernels
    from jaxinfer.serving import loading

    monkeypatch.setattr(quant_kernels, "enabled", lambda: True)
    monkeypatch.setattr(quant_kernels, "has_q4_x8", lambda: False)
    with pytest.raises(RuntimeError, match="activations=int8 needs AVX512-VNNI, BW and VBMI, or AVX2"):
        loading.load_model("/nonexistent/model.gguf", activations="int8")


def test_sampling_keys_build_one_sampling_params():
    cfg = GenerationConfig.load(None, ("temperature=0.7", "top_k=-1", "seed=5"))
    assert cfg.sampling == SamplingParams(temperature=0.7, top_k=-1, seed=5)
    assert GenerationConfig().sampling == SamplingParams() and SamplingParams().temperature == 0.0


def test_every_key_is_documented():
    docs = GenerationConfig.key_docs()
    assert list(docs) == list(GenerationConfig.keys())
    assert "logprobs" not in docs and "sampling" not in docs
    assert all(len(text) > 10 for text in docs.values()), docs
    assert docs["top_k"].startswith("keep the k most likely tokens")


def test_yaml_file_errors_name_the_file(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: expected a mapping of key: value, got list")):
        GenerationConfig.load(str(path))
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid YAML")):
        GenerationConfig.load(str(path))


def test_cli_reports_bad_model_without_traceback(capsys):
    rc = main(["generate", "--prompt", "hi", "model=no-such-model-name"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown model 'no-such-model-name'" in err and "Traceback" not in err


def test_cli_rejects_bad_sampling_before_loading(capsys):
    rc = main(["generate", "--prompt", "hi", "model=no-such-model-name", "temperature=-1"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err  # reported before the model lookup
