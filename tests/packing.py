"""Test helper: the plain [I, O] matrix a `kernels.packed.PackedWeight` holds
(the inverse of `kernels.packed.pack_weight`), for comparing packed params with
plain ones."""

import numpy as np


def unpack_weight(w) -> np.ndarray:
    """float32 [I, O] from a PackedWeight: float32 panels [P, I, width], or
    bfloat16 panels [P, I/2, 2 * width] of input-row pairs (I comes back
    rounded up to even, the padding row zero). Zero padding past O dropped."""
    panels = np.asarray(w.panels.astype("float32"))
    p, rows, width = panels.shape
    if str(w.panels.dtype) == "bfloat16":
        panels = panels.reshape(p, rows, width // 2, 2).transpose(0, 1, 3, 2).reshape(p, 2 * rows, -1)
    return panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)[:, :w.n]
