"""Files on disk: where jaxinfer keeps what it caches (models, tokenizers,
prepared params, built kernels, compiled programs), and reading a file the
user named (a config, a chat template, a prompts file) with errors that name it."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """The user cache root: $JAXINFER_CACHE_DIR, $XDG_CACHE_HOME/jaxinfer or ~/.cache/jaxinfer."""
    if os.environ.get("JAXINFER_CACHE_DIR"):
        return pathlib.Path(os.environ["JAXINFER_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "jaxinfer"
    return pathlib.Path.home() / ".cache" / "jaxinfer"


def read_user_file(path: str | os.PathLike, *, label: str, missing: str,
                   binary: bool = False) -> str | bytes:
    """The whole of a file the user named: UTF-8 text, or bytes with `binary`.

    Args:
      label: how errors name the file, e.g. "config file <path>".
      missing: the FileNotFoundError's message.
    Raises:
      FileNotFoundError(missing): no such file.
      ValueError: "<label>: <the OS's reason>" when it cannot be read (a
        folder, no permission); "<label>: not UTF-8 text (<reason> at byte
        <offset>)" for text that does not decode.
    """
    try:
        with open(path, "rb") if binary else open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(missing) from None
    except OSError as e:
        raise ValueError(f"{label}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{label}: not UTF-8 text ({e.reason} at byte {e.start})") from None
