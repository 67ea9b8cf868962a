"""Model families and their registry.

A family (`models.base.Family`: names, config parsing, weight names, layout
fixes, preparation and the embed / layer / unembed forward) is one module;
this registry maps `ModelConfig.arch`, Hugging Face model types and GGUF
architectures to families. The checkpoint readers and the engine ask it,
so a new family is one module plus one `register` line below (the load
cache's key follows the registry: `BUILT_IN`, `family_modules`), and
research code can register its own at run time (examples/byo_model.py).

    family(config.arch).layer(p, x, kv, rope, attend, config)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxinfer.models import gemma3, llama, qwen3
from jaxinfer.models.base import CheckpointError, Family

__all__ = ["BUILT_IN", "CheckpointError", "Family", "families", "family", "family_for_gguf",
           "family_for_hf", "family_modules", "gguf_architectures", "hf_architecture_type",
           "hf_model_types", "register"]

_FAMILIES: dict[str, Family] = {}


def register(new: Family, *, replace: bool = False) -> Family:
    """Make `new` the family of `ModelConfig.arch == new.name` and of the
    checkpoints it lists. Registering the same object again does nothing.

    Args:
      new: a `Family`.
      replace: allow replacing a registered family of the same name.
    Returns:
      `new`.
    Raises:
      TypeError: `new` is not a `Family`.
      ValueError: the name is taken (without replace), or one of its HF
        model types or GGUF architectures is another family's.
    """
    if not isinstance(new, Family):
        raise TypeError(f"register takes a jaxinfer.models.Family, got {type(new).__name__}")
    old = _FAMILIES.get(new.name)
    if old is new:
        return new
    if old is not None and not replace:
        raise ValueError(f"a model family named {new.name!r} is already registered; pass "
                         "replace=True to replace it")
    others = [f for name, f in _FAMILIES.items() if name != new.name]
    for what, mine, theirs in (("Hugging Face model type", new.hf_model_types, "hf_model_types"),
                               ("GGUF architecture", new.gguf_architectures, "gguf_architectures")):
        for other in others:
            taken = sorted(set(mine) & set(getattr(other, theirs)))
            if taken:
                raise ValueError(f"family {new.name!r}: {what} {taken[0]!r} is already read by "
                                 f"family {other.name!r}")
    _FAMILIES[new.name] = new
    return new


def family(arch: str) -> Family:
    """The family registered as `arch` (a `ModelConfig.arch`).

    Raises:
      ValueError: no family of that name, naming the registered ones.
    """
    try:
        return _FAMILIES[arch]
    except KeyError:
        raise ValueError(f"unknown model architecture {arch!r}; registered families: "
                         f"{', '.join(_FAMILIES)} (add one with jaxinfer.models.register)"
                         ) from None


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_modules(f: Family) -> tuple[str, ...]:
    """The names of the modules that define `f`'s functions, in field order:
    its own module and those it borrows from (Qwen3's forward is Llama's)."""
    names = (getattr(getattr(f, field.name), "__module__", None)
             for field in dataclasses.fields(f) if callable(getattr(f, field.name)))
    return tuple(dict.fromkeys(name for name in names if name))


def hf_model_types() -> tuple[str, ...]:
    """Every Hugging Face model type a registered family reads, in registration order."""
    return tuple(t for f in _FAMILIES.values() for t in f.hf_model_types)


def gguf_architectures() -> tuple[str, ...]:
    """Every GGUF `general.architecture` a registered family reads, in registration order."""
    return tuple(a for f in _FAMILIES.values() for a in f.gguf_architectures)


def family_for_hf(model_type: Optional[str]) -> Optional[Family]:
    """The family reading config.json `model_type`, or None."""
    return next((f for f in _FAMILIES.values() if model_type in f.hf_model_types), None)


def hf_architecture_type(architecture: str) -> Optional[str]:
    """The model type of a config.json `architectures` entry (e.g.
    "LlamaForCausalLM" -> "llama"), or None when no family lists it."""
    return next((f.hf_architectures[architecture] for f in _FAMILIES.values()
                 if architecture in f.hf_architectures), None)


def family_for_gguf(architecture: Optional[str]) -> Optional[Family]:
    """The family reading GGUF `general.architecture`, or None."""
    return next((f for f in _FAMILIES.values() if architecture in f.gguf_architectures), None)


register(llama.FAMILY)
register(gemma3.FAMILY)
register(qwen3.FAMILY)

# The families registered above, on import; `families()` also holds those registered later.
BUILT_IN: tuple[Family, ...] = families()
