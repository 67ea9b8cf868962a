"""The converted-tokenizer cache: a GGUF's tokenizer, built once by transformers.

    <jaxinfer cache dir>/tokenizers/<gguf stem>-<key>/
        tokenizer.json, tokenizer_config.json, ...   transformers' `save_pretrained`
        jaxinfer_tokenizer.json                      what tokenizer.json does not hold

The key hashes the GGUF's resolved path, size and mtime, the installed
transformers and tokenizers versions and `FORMAT`. `jaxinfer_tokenizer.json`
records the transformers tokenizer class, its special tokens
(`special_tokens_map`), its chat template and the caller's extra fields (the
GGUF's EOS ids). `load` reads `tokenizer.json` with `tokenizers` and that
file, without importing transformers. Entries are written atomically (a
temporary folder renamed into place); a failed write is a warning on this
module's logger, never an error.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable, Mapping

from jaxinfer.config import cache_dir as default_cache_dir

log = logging.getLogger(__name__)

FORMAT = 4   # 2: built without torch; 3: the tokenizer class is recorded;
             # 4: special tokens and chat template recorded (loads without transformers)
META_FILE = "jaxinfer_tokenizer.json"


def cache_root(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """`cache_dir`, else `jaxinfer.config.cache_dir()` ($JAXINFER_CACHE_DIR,
    else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer)."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    return default_cache_dir()


def slot(path: pathlib.Path, cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """The cache folder for the tokenizer converted from the GGUF at `path`
    (resolved; it must exist)."""
    from importlib.metadata import version   # not `import transformers`: a cached load skips it

    st = path.stat()
    key = json.dumps([str(path), st.st_size, st.st_mtime_ns, version("transformers"),
                      version("tokenizers"), FORMAT])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root(cache_dir) / "tokenizers" / f"{path.stem}-{digest}"


def holds(folder: pathlib.Path) -> bool:
    """True when `folder` holds a complete entry (its metadata file is written last)."""
    return (folder / META_FILE).is_file()


def load(folder: pathlib.Path) -> tuple[Any, dict, Callable[[], Any]]:
    """(the `tokenizers.Tokenizer`, the metadata dict, a function that loads the
    transformers tokenizer from the folder with its own class).

    Raises:
      OSError, ValueError, KeyError, Exception from `tokenizers`: a damaged entry.
    """
    import tokenizers

    meta = json.loads((folder / META_FILE).read_text())
    module, _, name = meta["tokenizer_class"].partition(":")
    if not module.startswith("transformers."):
        raise ValueError(f"unexpected tokenizer class {meta['tokenizer_class']!r}")
    for field in ("special_tokens", "chat_template"):
        if field not in meta:
            raise KeyError(f"{META_FILE} has no {field!r}")

    def hf_loader():
        return getattr(importlib.import_module(module), name).from_pretrained(str(folder))

    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), meta, hf_loader


def special_tokens_of(hf) -> dict[str, Any]:
    """transformers' `special_tokens_map` of `hf`, as plain strings (lists kept)."""
    return {k: ([str(t) for t in v] if isinstance(v, (list, tuple)) else str(v))
            for k, v in hf.special_tokens_map.items() if v is not None}


def save(hf, folder: pathlib.Path, *, extra: Mapping[str, Any]) -> None:
    """Write the transformers tokenizer `hf` to `folder` with its metadata
    (its class, special tokens and chat template, and `extra`), atomically;
    warn, don't fail, on OSError."""
    meta = {**extra, "tokenizer_class": f"{type(hf).__module__}:{type(hf).__qualname__}",
            "special_tokens": special_tokens_of(hf), "chat_template": hf.chat_template}
    tmp = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        hf.save_pretrained(str(tmp))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        os.rename(tmp, folder)
        tmp = None
    except OSError as e:
        if not holds(folder):  # not just a concurrent writer that won
            log.warning("jaxinfer tokenizer cache: could not write %s: %s", folder, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
