"""jaxinfer.pytree: frozen dataclasses registered as pytrees (flax.struct's contract)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import pytree


@pytree.dataclass
class Pair:
    a: jax.Array
    b: jax.Array
    size: int = pytree.field(pytree_node=False, default=4)


@pytree.dataclass
class Triple(Pair):
    c: jax.Array = None


def test_leaves_in_field_order_and_static_fields_in_the_treedef():
    x = Pair(jnp.ones(2), jnp.zeros(3), size=7)
    leaves, tree = jax.tree_util.tree_flatten(x)
    assert [leaf.shape for leaf in leaves] == [(2,), (3,)]
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.a is x.a and back.b is x.b and back.size == 7
    assert tree != jax.tree_util.tree_structure(Pair(jnp.ones(2), jnp.zeros(3), size=8))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(x)[0]]
    assert paths == [".a", ".b"]
    assert [f.metadata.get("pytree_node", True) for f in dataclasses.fields(Pair)] == [True, True, False]


def test_frozen_replace_subclass_and_jit():
    x = Triple(jnp.ones(2), jnp.zeros(2), size=2, c=jnp.full(2, 3.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.a = jnp.zeros(2)
    y = x.replace(b=jnp.ones(2))
    assert isinstance(y, Triple) and y.size == 2 and np.array_equal(y.b, np.ones(2))
    assert np.array_equal(x.b, np.zeros(2))              # the original is unchanged

    @jax.jit
    def step(t: Triple) -> Triple:
        return t.replace(a=t.a * t.size + t.c)

    out = step(x)
    assert isinstance(out, Triple) and out.size == 2
    np.testing.assert_array_equal(out.a, np.full(2, 5.0))
    assert len(jax.tree_util.tree_leaves(out)) == 3
