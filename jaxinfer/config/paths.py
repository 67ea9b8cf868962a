"""Where jaxinfer keeps what it caches on disk (models, tokenizers, prepared
params, built kernels, compiled programs)."""

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
