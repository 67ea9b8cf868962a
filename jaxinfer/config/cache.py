"""`CacheConfig`: the KV cache's settings, validated once, and `parse_bytes`
for its memory budget."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache of the serving engine: its dtypes, its page pool, prefix
    caching and its layout.

    Attributes:
      max_seq_len: tokens per request (prompt + generated), the KV capacity
        of a slot; >= 1 (`LLM` also checks it against the model's context).
      dtype: activations' and K/V compute dtype name, "float32", "bfloat16"
        or "float16"; None: the params' dtype (`LLM` fills it in).
      kv_cache_dtype: K/V storage, the name of a codec in `cache.CODECS`:
        None (as dtype), "float32", "bfloat16", "float16" or "int8" (codes
        plus a float32 scale per token per kv head); checked against the
        registry where the layout is resolved (`cache.resolve_layout`).
      page_size: tokens per KV page, >= 1.
      num_pages: pages in the pool, >= 1; None: from kv_cache_memory.
      kv_cache_memory: the pool's budget in bytes, >= 1 (an int, or a string
        such as "512MiB": `parse_bytes`); None: enough for every slot's
        max_seq_len tokens within `cache.kv.DEFAULT_KV_CACHE_MEMORY`.
        At most one of num_pages and kv_cache_memory is given.
      prefix_caching: requests share the pages of equal prompt prefixes;
        None: on where the layout supports it (`cache.LAYOUTS`), True on a
        layout that does not is refused where the layout is resolved
        (`cache.resolve_layout`).
      layout: the name of a layout in `cache.LAYOUTS` ("paged", or
        "paged_ring": sliding-window layers in a fixed ring of pages per
        slot); checked against the registry where it is resolved.

    Raises:
      ValueError: naming the field, for a value of the wrong type or out of
        range, or both num_pages and kv_cache_memory.
    """

    max_seq_len: int = 2048
    dtype: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    page_size: int = 16
    num_pages: Optional[int] = None
    kv_cache_memory: Union[int, str, None] = None
    prefix_caching: Optional[bool] = None
    layout: str = "paged"

    def __post_init__(self):
        for name in ("max_seq_len", "page_size"):
            _check_int(name, getattr(self, name), optional=False)
        memory = self.kv_cache_memory
        if memory is not None and (not isinstance(memory, (int, str)) or isinstance(memory, bool)):
            raise ValueError(f"kv_cache_memory must be an int, a string such as 512MiB, or null, "
                             f"got {memory!r}")
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory",
                               parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
        for name in ("num_pages", "kv_cache_memory"):
            _check_int(name, getattr(self, name), optional=True)
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_pages or kv_cache_memory, not both")
        if self.dtype is not None and self.dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPE_NAMES} or None, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and (not isinstance(self.kv_cache_dtype, str)
                                                or not self.kv_cache_dtype):
            raise ValueError(f"kv_cache_dtype must be null or a codec's name (cache.CODECS), got "
                             f"{self.kv_cache_dtype!r}")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be bool or null, got {self.prefix_caching!r}")
        if not isinstance(self.layout, str) or not self.layout:
            raise ValueError(f"layout must be a layout's name (cache.LAYOUTS), got {self.layout!r}")

    @property
    def pages_per_seq(self) -> int:
        """Block-table columns of a slot: ceil(max_seq_len / page_size)."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def store_dtype(self) -> Optional[str]:
        """The K/V storage dtype name: kv_cache_dtype, else dtype."""
        return self.kv_cache_dtype or self.dtype

    def replace(self, **changes) -> "CacheConfig":
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value, optional: bool) -> None:
    """Raise ValueError naming `name` unless value is an int >= 1 (or None
    when optional); a bool is not an int here."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be int{' or null' if optional else ''}, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1{' or null' if optional else ''}, got {value}")


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, name: str = "size") -> int:
    """Bytes of "123", "512MiB", "1.5 GB" (SI units are powers of 1000, IEC
    ones of 1024; case-insensitive).

    Raises:
      ValueError: naming `name`, for anything else.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if unit not in _BYTE_UNITS:
        raise ValueError(f"{name} must be a number of bytes such as 536870912, 512MiB or 2GB, "
                         f"got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


__all__ = ["CacheConfig", "parse_bytes"]
