"""Host inputs sent as what changed: one runner's program calls repeat most
of their host inputs (the block tables change a row when a request gains
a page; a decode step's slots stay as they were), so each numpy leaf is
sent whole only when more than half its rows changed since the same leaf
of that runner's previous call of the same program, else as the rows that
did (`Changed`). Process 0 encodes, each follower decodes with its own
copy of the previous leaves: both see the same calls in the same order.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np


class Changed:
    """A leaf sent as its changed rows (axis 0): their indices and values."""

    __slots__ = ("rows", "values")

    def __init__(self, rows: np.ndarray, values: np.ndarray):
        self.rows, self.values = rows, values

    def __getstate__(self):
        return self.rows, self.values

    def __setstate__(self, state):
        self.rows, self.values = state


class HostCodec:
    """One runner's previous host leaves, by (program, argument, leaf)."""

    def __init__(self):
        self._last: dict = {}

    def encode(self, program: str, position: int, tree):
        """`tree` (numpy leaves) with each leaf whole or as `Changed`."""
        index = itertools.count()

        def one(x):
            key = (program, position, next(index))
            if not isinstance(x, np.ndarray):
                return x
            prev, self._last[key] = self._last.get(key), x
            if prev is None or prev.shape != x.shape or prev.dtype != x.dtype or x.ndim == 0:
                return x
            rows = np.flatnonzero((x != prev).reshape(len(x), -1).any(axis=1))
            return x if 2 * len(rows) >= len(x) else Changed(rows, x[rows])
        return jax.tree_util.tree_map(one, tree)

    def decode(self, program: str, position: int, tree):
        """The tree `encode` was given, from what it returned.

        Raises:
          ValueError: a `Changed` leaf without a previous one (calls out of order).
        """
        index = itertools.count()

        def one(x):
            key = (program, position, next(index))
            if isinstance(x, Changed):
                prev = self._last.get(key)
                if prev is None:
                    raise ValueError(f"changed rows of {key} without its previous value")
                full = prev.copy()
                full[x.rows] = x.values
                x = full
            if isinstance(x, np.ndarray):
                self._last[key] = x
            return x
        return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, Changed))


__all__ = ["Changed", "HostCodec"]
