import dataclasses
import gc
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import threading

# XLA:CPU compile options for the test run, set before JAX starts its backend
# (processes the tests start inherit them): compiling is most of the run's
# time, and these flags about halve it. `--xla_backend_optimization_level=0`
# leaves out LLVM's optimisation passes; `--xla_cpu_use_fusion_emitters=false`
# emits fusions with XLA's loop emitters instead of its MLIR fusion emitters.
# Both are XLA's own supported paths; the programs run slower, and no test
# times them. JAXINFER_TEST_XLA_FLAGS=default compiles as `jaxinfer` does.
# Tests marked `default_xla_flags` run in a child pytest that compiles as
# `jaxinfer` does (`pytest_pyfunc_call` below): the deterministic mode's bitwise
# batch invariance holds for the programs XLA's default emitters write. A test
# the child skipped is failed, or skipped where its marker allows skipping.
TEST_XLA_FLAGS_ENV = "JAXINFER_TEST_XLA_FLAGS"
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# XLA_FLAGS as the run was started, kept in the environment by the first conftest to run: the
# test processes of `pytest -n` (xdist workers) inherit XLA_FLAGS with the flags above added.
ORIGINAL_XLA_FLAGS_ENV = "JAXINFER_TEST_ORIGINAL_XLA_FLAGS"
os.environ.setdefault(ORIGINAL_XLA_FLAGS_ENV, json.dumps(os.environ.get("XLA_FLAGS")))
ORIGINAL_XLA_FLAGS = json.loads(os.environ[ORIGINAL_XLA_FLAGS_ENV])
if os.environ.get(TEST_XLA_FLAGS_ENV) != "default":
    os.environ["XLA_FLAGS"] = f"{ORIGINAL_XLA_FLAGS or ''} {FAST_COMPILE_FLAGS}".strip()

# Programs compile (or come from the test run's XLA cache) in every test and in the
# processes tests start: no executable store (`serving.executables`, on by default),
# whose entries would carry programs from one test into another. Its own tests pass
# a store explicitly.
os.environ["JAXINFER_EXECUTABLE_STORE"] = "0"

# A folder for the whole test run, shared by its test processes (pytest -n's
# workers inherit it from the process that started them) and removed by that
# process when the run ends (`pytest_unconfigure`).
RUN_DIR_ENV = "JAXINFER_TEST_RUN_DIR"
_OWNS_RUN_DIR = RUN_DIR_ENV not in os.environ
if _OWNS_RUN_DIR:
    os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="jaxinfer-test-run-")
RUN_DIR = pathlib.Path(os.environ[RUN_DIR_ENV])

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import child_pytest  # noqa: E402  (tests/, on sys.path just above)
import durations  # noqa: E402

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
    config.addinivalue_line("markers", "default_xla_flags(skip_allowed=False): run in a child pytest "
                                       "with XLA's default compile flags; a skip there fails the test "
                                       "unless skip_allowed (tests/conftest.py)")
    (RUN_DIR / "hf-gguf").mkdir(parents=True, exist_ok=True)
    folder = _xla_cache_dir()
    if folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        # and in the processes tests start (multi-device cases, disaggregation workers),
        # through JAX's own environment variables; the CLI's `enable_compilation_cache`
        # still points `jaxinfer serve` and `generate` at their own cache
        os.environ.update(JAX_COMPILATION_CACHE_DIR=folder,
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def pytest_unconfigure(config):
    if _OWNS_RUN_DIR:
        shutil.rmtree(RUN_DIR, ignore_errors=True)


AVX2_ARCH = "x86-64-v3"


@pytest.fixture(scope="session")
def avx2_kernel_env() -> dict:
    """The environment of a child process that loads the C++ kernels built for
    AVX2 (`JAXINFER_KERNEL_ARCH=x86-64-v3`): os.environ with the arch and a
    kernel cache shared by the whole test run (`RUN_DIR`/avx2-cache), so the
    AVX2 library is compiled once per run, by the first test process to ask
    (under a file lock), not once per test. Skips off x86-64, and where this
    run's own kernels are already the AVX2 build (a CPU without AVX-512:
    8-float vectors), whose paths the run's kernel tests then ran. Raises
    AssertionError with the build's stderr when the build fails or loads
    another arch."""
    import filelock
    import platform
    import subprocess

    from jaxinfer.kernels import cpu as cpu_kernels

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    native = cpu_kernels.kernel_info()
    if native.get("vector_lanes") == 8:
        pytest.skip(f"this run's kernels ({native['arch']}) are the AVX2 build already: "
                    "8-float vectors, no AVX-512; the run's own kernel tests ran its paths")
    folder = RUN_DIR / "avx2-cache"
    env = dict(os.environ, JAXINFER_KERNEL_ARCH=AVX2_ARCH, JAXINFER_CACHE_DIR=str(folder))
    code = "from jaxinfer.kernels import cpu as c; assert c.enabled(); print(c.kernel_info()['arch'])"
    with filelock.FileLock(f"{folder}.lock"):
        built = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert built.stdout.split() == [f"-march={AVX2_ARCH}"], built.stderr[-2000:]
    return env


@pytest.fixture(scope="session")
def jaxinfer_xla_flags() -> str:
    """XLA_FLAGS as `jaxinfer` compiles, without the test run's fast-compile
    flags: for a process a test starts whose run time, not its compiling, is
    most of its time (`multidevice.run_case(xla_flags=...)`)."""
    return ORIGINAL_XLA_FLAGS or ""


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


# Threads that compile in the background: a warm-up's other buckets
# (`serving.warmup.WarmUp.compile_behind`), a schema's device tables
# (`sampling.grammar`, started by a server for each new schema) and a larger
# grammar pool's step (`serving.grammar_rows`).
BACKGROUND_THREADS = ("jaxinfer-compile", "jaxinfer-grammar", "jaxinfer-grammar-compile")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends.

    XLA:CPU maps every compiled executable's code into memory regions of
    its own; one process running the whole suite compiles thousands of
    programs, and past the kernel's limit on mappings per process
    (`vm.max_map_count`, 65,530 by default) compiling crashes the process
    (a segfault or an abort inside XLA). Programs held by session-scoped
    fixtures stay. Background work a module's LLM or server left compiling
    (`BACKGROUND_THREADS`) is waited for first, so that it neither compiles
    into the next module's time, nor counts among the compiles that module's
    tests count, nor adds memory maps under its measurements."""
    yield
    for thread in threading.enumerate():
        if thread.name in BACKGROUND_THREADS:
            thread.join(600)
    gc.collect()
    jax.clear_caches()
    gc.collect()


def load_hf_gguf(gguf_path, keep_dir=None):
    """(transformers model in float32 eval mode, its tokenizer) for a GGUF
    file, the reference the real-model tests compare against.

    keep_dir: a folder where the pair is pickled (`torch.save`) after the
    first load and read back on later ones: transformers' GGUF conversion is
    slow (docs/testing.md has the figures) and it cannot `save_pretrained` a
    model it loaded from GGUF; the pickle gives back the same weights,
    config and tokenizer. The pickle is named by the file's resolved path,
    size and modification time and by the transformers and torch versions,
    and written under a file lock then renamed into place: the test
    processes of one run (`pytest -n`) share one conversion per model."""
    import filelock
    import torch
    import transformers

    if keep_dir is not None:
        path = pathlib.Path(gguf_path).resolve()
        stat = path.stat()
        key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|"
                             f"{torch.__version__}".encode()).hexdigest()[:16]
        kept = pathlib.Path(keep_dir) / f"{path.stem}-{key}.pt"
        with filelock.FileLock(f"{kept}.lock"):
            if not kept.is_file():
                model, tok = _convert_hf_gguf(gguf_path)
                torch.save((model, tok), f"{kept}.partial")
                os.replace(f"{kept}.partial", kept)
                return model.eval(), tok
        model, tok = torch.load(kept, weights_only=False)
        return model.eval(), tok
    return _convert_hf_gguf(gguf_path)


def _convert_hf_gguf(gguf_path):
    """transformers' own GGUF reader and conversion, float32, eval mode."""
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
    time in each test process (see `OneAtATime`); the last module using a
    model calls `.clear()`, and the session's end releases whatever is left.
    Each model is converted once per test run and read back from the run's
    pickle of it by every later ask, in any of the run's test processes
    (`load_hf_gguf`'s keep_dir: `RUN_DIR`, deleted when the run ends)."""
    holder = OneAtATime(lambda path: load_hf_gguf(path, RUN_DIR / "hf-gguf"))
    yield holder
    holder.clear()


# --- the two-layer toy model, trained once per session -----------------------------------


@pytest.fixture(scope="session")
def toy_config():
    from jaxinfer_tools import toy

    return toy.ToyConfig.load(ROOT / "configs" / "toy-two-layer.yaml")


@pytest.fixture(scope="session")
def toy_trained(toy_config):
    from jaxinfer_tools import toy

    return toy.train(toy_config)


@pytest.fixture(scope="session")
def toy_folder(toy_trained, toy_config, tmp_path_factory):
    """An HF Llama folder (config, safetensors, tokenizer) of the trained toy."""
    from jaxinfer_tools import toy

    path = tmp_path_factory.mktemp("toy") / "toy-two-layer"
    toy.save_hf_folder(path, toy_trained, toy_config)
    return path


@pytest.hookimpl(trylast=True)   # after `-m` and `-k` deselected what does not run
def pytest_collection_modifyitems(config, items):
    """The costliest test files first, by tests/durations.json's seconds of
    their selected tests (`tests/durations.py`); files it does not know keep
    their order, after them. With `-n 2` and `--dist loadfile` a free worker
    takes the next file (`--no-loadscope-reorder` in pyproject.toml keeps this
    order instead of pytest-xdist's most-tests-first), so the long files start
    early and the two workers end together: longest-processing-time-first."""
    cost = durations.module_costs([i.nodeid for i in items], durations.load())
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (-cost[item.nodeid.split("::")[0]], first[item.nodeid.split("::")[0]]))


CHILD_TIMEOUT_S = 1800   # one module's `default_xla_flags` child (tests/serving/test_deterministic.py: its 11)


# One child pytest per test module: its marked tests that this process runs, in one run
# (a child's start, imports and compiles are shared by the module's tests).
_CHILD_RUNS: dict = {}


def _junit_key(nodeid: str) -> str:
    """The "classname::name" of a test in a JUnit report (`child_pytest.read_junit`)."""
    path, *names = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", ".")] + names[:-1]) + "::" + names[-1]


def _module_child(item) -> child_pytest.ChildRun:
    """The child pytest, with XLA's default flags, of every `default_xla_flags`
    test of `item`'s module that this process runs (started by the first)."""
    module = item.nodeid.split("::")[0]
    if module not in _CHILD_RUNS:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env[TEST_XLA_FLAGS_ENV] = "default"
        if ORIGINAL_XLA_FLAGS is not None:
            env["XLA_FLAGS"] = ORIGINAL_XLA_FLAGS
        nodeids = [i.nodeid for i in item.session.items if i.nodeid.split("::")[0] == module
                   and i.get_closest_marker("default_xla_flags") is not None]
        _CHILD_RUNS[module] = child_pytest.run(["-m", "slow or not slow", *nodeids], env=env,
                                               timeout_s=CHILD_TIMEOUT_S)
    return _CHILD_RUNS[module]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `default_xla_flags`, in a run with the fast-compile flags,
    runs instead in a child pytest with XLA's default flags (one child per
    module, `_module_child`). It passes when the child ran it and it passed
    (`child_pytest.check` on its own outcome): a child that skipped it fails
    it, unless the marker says `skip_allowed=True` (a real-model test whose
    model cannot be fetched), and then it is skipped with the child's
    reason. A test missing from the child's report fails with the child's output."""
    marker = pyfuncitem.get_closest_marker("default_xla_flags")
    if marker is None or os.environ.get(TEST_XLA_FLAGS_ENV) == "default":
        return None
    child = _module_child(pyfuncitem)
    key = _junit_key(pyfuncitem.nodeid)
    mine = {key: child.outcomes[key]} if key in child.outcomes else {}
    failed = not mine or mine[key][0] in ("failed", "error")
    child_pytest.check(dataclasses.replace(child, outcomes=mine, returncode=int(failed)),
                       skip_allowed=marker.kwargs.get("skip_allowed", False),
                       what="XLA's default flags")
    return True
