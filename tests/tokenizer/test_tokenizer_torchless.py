"""With core dependencies only (no torch), importing transformers through
jaxinfer prints nothing: transformers' "PyTorch was not found" advice is
dropped (the tokenizer path needs no torch). Torch is hidden from a fresh
interpreter with `sys.modules["torch"] = None`."""

import subprocess
import sys

HIDE_TORCH = "import sys; sys.modules['torch'] = None; "


def _stderr(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_transformers_alone_prints_the_advice():
    """The control: with torch hidden, transformers itself prints it."""
    assert "PyTorch was not found" in _stderr("import transformers")


def test_jaxinfer_tokenizer_silences_it():
    code = ("import jaxinfer.tokenizer, transformers, transformers.utils.logging as tl; "
            "tl.get_logger('transformers').warning('another warning')")
    err = _stderr(code)
    assert "PyTorch was not found" not in err
    assert "another warning" in err            # only that message is dropped
