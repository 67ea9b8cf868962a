"""Compiled programs stored on disk (`serving.executables`): the key names
everything that determines a trace, a stored program loads without tracing
and computes bit for bit what the compiled one does, a bad file is removed
and recompiled, and a serving run from stored programs equals a fresh one."""

import dataclasses
import functools
import logging
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.kernels.packed import PackedWeight
from jaxinfer.serving import executables
from jaxinfer.serving.executables import ExecutableStore, Unkeyable, program_key, static_repr
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import import_python_file, load_python_model
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.speculative import SpecConfig
from tiny import TINY_LLAMA, random_params

# stored programs must be compiled here, never taken from the test run's XLA cache
pytestmark = pytest.mark.usefixtures("xla_cache_off")


TRACES = []


@functools.partial(jax.jit, static_argnames=("scale",), donate_argnames=("x",))
def _f(x, y, scale):
    TRACES.append(scale)
    return jnp.tanh(x @ y) * scale + jnp.cumsum(x, axis=0)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    a: int
    b: tuple = ("x", 1.5)


@dataclasses.dataclass
class _Mutable:
    a: int


def _args(n=4, dtype=jnp.float32):
    x = jnp.arange(n * 8, dtype=dtype).reshape(n, 8) / 17
    return x, jnp.ones((8, 8), dtype) / 3


def test_static_repr_names_every_field_and_refuses_what_it_cannot_name():
    assert static_repr(_Frozen(1)) != static_repr(_Frozen(2)) != static_repr(_Frozen(1, ("x", 2.5)))
    assert static_repr(1) != static_repr(1.0) != static_repr(True) != static_repr("1")
    assert static_repr(SpecConfig("ngram", 3)) != static_repr(SpecConfig("ngram", 4))
    for bad in (_Mutable(1), {"a": 1}, [1], np.float32(1), jnp.zeros(2), object(),
                _Frozen(1, (jnp.zeros(2),))):
        with pytest.raises(Unkeyable):
            static_repr(bad)


def test_program_key_tells_apart_what_changes_the_trace():
    x, y = _args()
    base = program_key(_f, (x, y), {"scale": 2.0})
    assert program_key(_f, (x, y), {"scale": 2.0}) == base
    assert program_key(_f, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                  (x, y)), {"scale": 2.0}) == base
    others = [program_key(_f, (x, y), {"scale": 3.0}),
              program_key(_f, _args(5), {"scale": 2.0}),
              program_key(_f, _args(4, jnp.bfloat16), {"scale": 2.0}),
              program_key(_f, (x, jax.ShapeDtypeStruct((8, 8), jnp.float32, weak_type=True)),
                          {"scale": 2.0}),
              program_key(_f, ((x,), y), {"scale": 2.0}),
              program_key(jax.jit(lambda x, y, scale: x), (x, y), {"scale": 2.0})]
    assert len({base, *others}) == 1 + len(others)
    panels = jnp.zeros((2, 4, 8))        # a static pytree field (the column count) is in the key
    assert program_key(_f, (PackedWeight(panels, 13),), {}) != program_key(_f, (PackedWeight(panels, 14),), {})
    with pytest.raises(Unkeyable):
        program_key(_f, (x, y), {"scale": np.float32(2)})


def test_fingerprint_follows_the_environment(monkeypatch):
    before = executables.fingerprint()
    assert executables.fingerprint() == before
    monkeypatch.setenv("JAXINFER_SOMETHING", "1")
    assert executables.fingerprint() != before
    monkeypatch.delenv("JAXINFER_SOMETHING")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert executables.fingerprint() != before


def test_a_stored_program_loads_without_tracing_and_equals_the_compiled_one(tmp_path, caplog):
    store = ExecutableStore(tmp_path)
    x, y = _args()
    want = np.asarray(ProgramCache(store=store)(_f, jnp.array(x), y, scale=2.0))
    [entry] = list(store.folder.glob("*.bin"))
    jax.clear_caches()                       # JAX's own trace cache would hide a second trace
    TRACES.clear()
    second = ProgramCache(store=store)
    got = np.asarray(second(_f, jnp.array(x), y, scale=2.0))
    assert TRACES == [] and second.num_compiles == 1
    np.testing.assert_array_equal(got, want)

    entry.write_bytes(b"not a stored executable")                 # a bad file: removed, recompiled
    with caplog.at_level(logging.WARNING, "jaxinfer.serving.executables"):
        again = np.asarray(ProgramCache(store=store)(_f, jnp.array(x), y, scale=2.0))
    np.testing.assert_array_equal(again, want)
    assert TRACES == [2.0] and [r.getMessage()[:55] for r in caplog.records] == [
        "jaxinfer: removing an unreadable stored executable " + entry.name[:4]]
    assert entry.read_bytes() != b"not a stored executable"      # stored again after the compile


def test_unkeyable_programs_compile_as_before(tmp_path):
    store = ExecutableStore(tmp_path)
    cache = ProgramCache(store=store)
    x, y = _args()
    cache(_f, x, y, scale=np.float32(2))                           # a numpy scalar static: no key
    assert cache.num_compiles == 1 and not list(tmp_path.rglob("*.bin"))


def test_old_fingerprints_are_pruned(tmp_path):
    for i in range(6):
        (tmp_path / f"old{i}").mkdir()
        os.utime(tmp_path / f"old{i}", (i, i))
    store = ExecutableStore(tmp_path)
    assert store.folder.name == executables.fingerprint()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted(["old5", "old4", "old3"])                # the folder itself is made on save


def test_store_follows_jax_compilation_cache_unless_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv(executables.ENABLE_ENV, raising=False)     # on by default
    assert ProgramCache().store is None                            # the cache is off in tests
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        assert ProgramCache().store.root == tmp_path / executables.FOLDER
        monkeypatch.setenv(executables.ENABLE_ENV, "0")
        assert ProgramCache().store is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_serving_from_stored_programs_equals_a_fresh_run(tmp_path, caplog, monkeypatch):
    """The serving programs (admission, the step with the C++ kernels where
    they run, paged KV) stored by one LLM and loaded by another give the
    same tokens and log-probs."""
    params = random_params(TINY_LLAMA, seed=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20, 40))]

    def run(store):
        llm = LLM(TINY_LLAMA, params, max_seq_len=64, max_num_seqs=4, page_size=4)
        llm.programs = ProgramCache(store=store)
        outs = llm.generate(prompts, max_new_tokens=6, logprobs=2)
        return llm, [(o.token_ids, o.logprobs) for o in outs]

    _, fresh = run(None)
    jax.clear_caches()                # else JAX hands back these executables from memory: not stored
    store = ExecutableStore(tmp_path)
    saving_llm, saved = run(store)
    stored = len(list(store.folder.glob("*.bin")))
    assert stored == saving_llm.programs.num_compiles > 0
    saves = []
    real_save = ExecutableStore.save
    monkeypatch.setattr(ExecutableStore, "save", lambda self, *a: saves.append(1) or real_save(self, *a))
    with caplog.at_level(logging.WARNING, "jaxinfer.serving.executables"):
        loaded_llm, loaded = run(store)
    assert not caplog.records and saves == []                   # every program loaded, none compiled
    assert loaded_llm.programs.num_compiles == stored
    assert loaded == saved == fresh


BYO_MODEL = pathlib.Path(__file__).resolve().parents[2] / "examples" / "byo_model.py"
BYO_ARCH = "byo-nnx-decoder"


def test_brought_files_are_a_family_module_and_what_it_imports_from_outside(tmp_path, monkeypatch):
    (tmp_path / "helper.py").write_text("def gate(x):\n    return x\n")
    (tmp_path / "mine.py").write_text(
        "import json\nimport numpy as np\nfrom jaxinfer import nn\nfrom helper import gate\n"
        "def layer(p, x, kv, rope, attend, config):\n    return gate(x), kv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mine", "helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    mine = import_python_file(tmp_path / "mine.py")
    # the built-in families only: a brought family an earlier test in this process
    # registered (the tiny NNX model of update_weights' tests) is not this test's
    monkeypatch.setattr(models, "_FAMILIES", {f.name: f for f in models.BUILT_IN})
    assert executables.brought_digest() == ""                     # built-in families: none
    models.register(models.Family("mine", embed=len, layer=functools.partial(mine.layer),
                                  unembed=len))
    assert executables.brought_files() == [tmp_path / "helper.py", tmp_path / "mine.py"]
    before = executables.brought_digest()
    (tmp_path / "helper.py").write_text("def gate(x):\n    return -x\n")
    assert executables.brought_digest() not in ("", before)

    shell = types.ModuleType("shell")                               # a function with no file
    exec("def layer(p, x, kv, rope, attend, config):\n    return x, kv\n", shell.__dict__)
    monkeypatch.setitem(sys.modules, "shell", shell)
    models.register(models.Family("mine", embed=len, layer=shell.layer, unembed=len),
                    replace=True)
    with pytest.raises(Unkeyable, match="model family 'mine': layer has no source file"):
        program_key(_f, _args(), {"scale": 2.0})


def test_an_edited_brought_model_is_compiled_again_not_taken_from_the_store(tmp_path, monkeypatch):
    """A "python:" model edited in place (gelu -> relu: same name, config
    and shapes) gives the edited model's greedy tokens from a store that
    holds the old model's programs: its source is in the key."""
    path = tmp_path / "byo.py"
    path.write_text(BYO_MODEL.read_text())
    monkeypatch.setattr(models, "_FAMILIES",        # registered here, gone after (test_examples' too)
                        {k: v for k, v in models._FAMILIES.items() if k != BYO_ARCH})

    def run(store):
        config, params, tokenizer = load_python_model(f"python:{path}:build", prepared=True)
        llm = LLM(config, params, tokenizer, max_seq_len=32, max_num_seqs=2)
        llm.programs = ProgramCache(store=store)
        [c] = llm.generate(["Hello, world"], SamplingParams(temperature=0.0), max_new_tokens=12,
                           ignore_eos=True)
        return c.token_ids

    def edit(old, new):                               # what a new process importing it would see
        monkeypatch.delitem(sys.modules, import_python_file(path).__name__)
        monkeypatch.delitem(models._FAMILIES, BYO_ARCH)
        assert path.read_text().count(old) == 1
        path.write_text(path.read_text().replace(old, new))
        jax.clear_caches()            # JAX's trace cache keys the engine by config, not by family

    jax.clear_caches()                # else JAX may hand back executables from memory: not stored
    store = ExecutableStore(tmp_path / "store")
    gelu = run(store)
    assert list(store.folder.glob("*.bin"))
    edit("jax.nn.gelu(", "jax.nn.relu(")
    relu = run(store)
    assert relu == run(None) != gelu


def _tiny_generate(params, store):
    """(the LLM, its greedy tokens for two prompts) of the tiny Llama with
    `params`, its programs kept in `store` (None: none)."""
    llm = LLM(TINY_LLAMA, params, max_seq_len=64, max_num_seqs=4, page_size=4)
    llm.programs = ProgramCache(store=store)
    return llm, [o.token_ids for o in llm.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]],
                                                   max_new_tokens=6)]


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_what_is_stored_is_compiled_afresh_not_taken_from_xla_cache(tmp_path):
    """An executable XLA's persistent cache returned, serialized again, loads
    but fails when run ("Function select_bitcast_fusion not found"): such a
    program is not stored; one XLA compiled is."""
    from jaxinfer.serving.loading import enable_compilation_cache

    enable_compilation_cache(str(tmp_path / "xla"))      # the conftest fixture turns it off after
    params = random_params(TINY_LLAMA, seed=4)

    def run(store):
        return _tiny_generate(params, store)[1]

    want = run(None)                                      # fills XLA's cache only
    jax.clear_caches()
    store = ExecutableStore(tmp_path / "store")
    assert run(store) == want                             # every program from XLA's cache: none stored
    assert not list(store.root.rglob("*.bin"))
    jax.clear_caches()
    enable_compilation_cache(str(tmp_path / "xla-empty"))
    assert run(store) == want                             # XLA compiles: stored
    stored = len(list(store.folder.glob("*.bin")))
    assert stored > 0
    jax.clear_caches()
    assert run(store) == want                             # loaded from the store, and they run
    assert len(list(store.folder.glob("*.bin"))) == stored


def test_a_program_jax_kept_in_memory_from_xla_cache_is_not_stored(tmp_path):
    """JAX keeps each executable in memory by its lowered module: compiling
    a program again in the process that took it from XLA's persistent cache
    returns that executable with no cache event at all. Serialized, it would
    fail when run in a later process ("Function and_select_fusion.13 not
    found"), so only a program whose compile ran XLA in the block is stored."""
    from jaxinfer.serving.loading import enable_compilation_cache

    enable_compilation_cache(str(tmp_path / "xla"))      # the conftest fixture turns it off after
    params = random_params(TINY_LLAMA, seed=5)
    _, want = _tiny_generate(params, None)                # XLA compiles; its cache is filled
    jax.clear_caches()
    _, from_xla_cache = _tiny_generate(params, None)      # every executable from XLA's cache
    store = ExecutableStore(tmp_path / "store")
    llm, got = _tiny_generate(params, store)              # the same executables, from memory
    assert got == from_xla_cache == want
    assert llm.programs.num_compiles > 0
    assert not list(store.root.rglob("*.bin"))


_CHILD = """
import sys
from jaxinfer.serving.executables import ExecutableStore
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import import_python_file, load_python_model
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.weights.prepare import prepare_params
from tiny import TINY_LLAMA, random_params

saves = []
real_save = ExecutableStore.save
ExecutableStore.save = lambda self, *a: saves.append(1) or real_save(self, *a)
params = prepare_params(random_params(TINY_LLAMA, seed=6), TINY_LLAMA, weights="q4")
llm = LLM(TINY_LLAMA, params, max_seq_len=64, max_num_seqs=4, page_size=4)
llm.programs = ProgramCache(store=ExecutableStore(sys.argv[1]))
outs = llm.generate([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]], max_new_tokens=6)
print([o.token_ids for o in outs], len(saves), llm.programs.num_compiles)
"""


@pytest.mark.skipif(not quant_kernels.enabled(), reason="the C++ kernels do not run here")
def test_a_stored_program_calling_the_kernels_loads_first_thing_in_a_new_process(tmp_path):
    """A process that loads a stored program before tracing anything has
    registered none of the kernels' FFI targets (they register when a trace
    first calls one): the store registers them before it loads, or the
    load fails with "No FFI handler registered for jaxinfer_q4_matmul"."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items()            # XLA compiles: no cache of the test run
           if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])

    def child():
        out = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "unreadable stored executable" not in out.stderr, out.stderr[-3000:]
        return out.stdout.strip()

    first, second = child(), child()
    tokens, saves, programs = second.rsplit(" ", 2)
    assert first == f"{tokens} {programs} {programs}" and int(programs) > 0
    assert saves == "0"                                    # the second process compiled nothing
