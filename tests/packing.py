"""Test helper: the plain [I, O] matrix a `cpu_kernels.PackedWeight` holds
(the inverse of `cpu_kernels.pack_weight`), for comparing packed params with
plain ones."""

import numpy as np


def unpack_weight(w) -> np.ndarray:
    """float32 [I, O] from a PackedWeight's panels [P, I, PANEL] (zero padding dropped)."""
    panels = np.asarray(w.panels, np.float32)
    return panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)[:, :w.n]
