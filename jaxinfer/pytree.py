"""Frozen dataclasses that are JAX pytrees.

    @pytree.dataclass
    class KVCache:
        k: jax.Array                                         # a leaf (traced)
        page_size: int = pytree.field(pytree_node=False)     # static: part of the tree's structure

The `flax.struct` idiom (same decorator, `field(pytree_node=...)` and
`.replace(**changes)`), built on `jax.tree_util.register_dataclass`, so the
engine needs no flax import. Fields keep their declaration order as pytree
children; `pytree_node=False` fields are compared and hashed as part of the
treedef, so they must be hashable. `checkpoint.prepared` reads the same
`pytree_node` field metadata to store static fields by value.
"""

from __future__ import annotations

import dataclasses

import jax


def field(*, pytree_node: bool = True, **kwargs):
    """`dataclasses.field(**kwargs)` marked as a pytree child (default) or as
    static metadata (`pytree_node=False`)."""
    metadata = {**(kwargs.pop("metadata", None) or {}), "pytree_node": pytree_node}
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes):
    """A copy with `changes` applied (`dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)


def dataclass(cls=None, **kwargs):
    """Make `cls` a frozen dataclass (`dataclasses.dataclass(frozen=True, **kwargs)`)
    registered as a pytree, with a `.replace(**changes)` method."""
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, **kwargs)(cls)
        fields = [f for f in dataclasses.fields(cls)]
        jax.tree_util.register_dataclass(
            cls, data_fields=[f.name for f in fields if f.metadata.get("pytree_node", True)],
            meta_fields=[f.name for f in fields if not f.metadata.get("pytree_node", True)])
        cls.replace = _replace
        return cls

    return wrap if cls is None else wrap(cls)
