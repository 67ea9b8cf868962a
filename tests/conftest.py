import gc
import os
import pathlib
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

sys.path.insert(0, os.path.dirname(__file__))

ROOT = pathlib.Path(__file__).resolve().parents[1]


_COMPILE_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                          "jax_persistent_cache_min_entry_size_bytes")

# The test run's own JAX persistent compilation cache: the tiny models' programs
# are the same HLO in many modules (and in both of .ci/run's runs), and each
# module's end drops the compiled programs (`_release_compiled_programs`), so
# without it they are compiled again and again. "off" turns it off.
TEST_XLA_CACHE_ENV = "JAXINFER_TEST_XLA_CACHE"


def _xla_cache_dir() -> str | None:
    """The folder of the test run's compilation cache ($JAXINFER_TEST_XLA_CACHE,
    default `.test-xla-cache/` in the checkout), or None when it is "off"."""
    folder = os.environ.get(TEST_XLA_CACHE_ENV) or str(ROOT / ".test-xla-cache")
    return None if folder == "off" else folder


def pytest_configure(config):
    folder = _xla_cache_dir()
    if folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def xla_cache_off():
    """The test compiles every program itself: JAX's persistent compilation
    cache off (restored after by `_compile_cache_options_restored`)."""
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _compile_cache_options_restored():
    """The CLI points JAX's persistent compilation cache at the user's cache
    for the whole process (`serving.loading.enable_compilation_cache`); a
    test that runs it in-process must not leave every later test writing
    executables there, so the options and JAX's cache object are restored
    to the test run's own (`pytest_configure`)."""
    before = {name: getattr(jax.config, name) for name in _COMPILE_CACHE_OPTIONS}
    yield
    if any(getattr(jax.config, name) != value for name, value in before.items()):
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends.

    XLA:CPU maps every compiled executable's code into memory regions of
    its own; one process running the whole suite compiles thousands of
    programs, and past the kernel's limit on mappings per process
    (`vm.max_map_count`, 65,530 by default) compiling crashes the process
    (a segfault or an abort inside XLA). Programs held by session-scoped
    fixtures stay."""
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()


def load_hf_gguf(gguf_path):
    """(transformers model in float32 eval mode, its tokenizer) for a GGUF
    file, the reference the real-model tests compare against."""
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


class OneAtATime:
    """Loads values by key and keeps only the latest: asking for another key
    drops the held value first (and collects), so two large models never
    stack up, while tests that ask for the same model in a row share one load."""

    def __init__(self, load):
        self._load = load
        self._key = self._value = None

    def get(self, key):
        if key != self._key:
            self.clear()
            self._value, self._key = self._load(key), key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None
        gc.collect()


@pytest.fixture(scope="session")
def real_model_path():
    """name -> the named model's verified .gguf path, or a skip when it cannot be fetched."""
    from jaxinfer.checkpoint.sources import ModelSourceError, resolve_model

    def get(name: str) -> pathlib.Path:
        try:
            return resolve_model(name)
        except ModelSourceError as e:
            pytest.skip(f"model {name} unavailable: {e}")
    return get


@pytest.fixture(scope="session")
def hf_gguf():
    """`.get(gguf path)` -> (transformers model, tokenizer), one model held at a
    time across the session (see `OneAtATime`); the last module using a model
    calls `.clear()`, and the session's end releases whatever is left."""
    holder = OneAtATime(load_hf_gguf)
    yield holder
    holder.clear()


# --- the two-layer toy model, trained once per session -----------------------------------


@pytest.fixture(scope="session")
def toy_config():
    from jaxinfer.tools import toy

    return toy.ToyConfig.load(ROOT / "configs" / "toy-two-layer.yaml")


@pytest.fixture(scope="session")
def toy_trained(toy_config):
    from jaxinfer.tools import toy

    return toy.train(toy_config)


@pytest.fixture(scope="session")
def toy_folder(toy_trained, toy_config, tmp_path_factory):
    """An HF Llama folder (config, safetensors, tokenizer) of the trained toy."""
    from jaxinfer.tools import toy

    path = tmp_path_factory.mktemp("toy") / "toy-two-layer"
    toy.save_hf_folder(path, toy_trained, toy_config)
    return path
