"""Attention backends of the serving step's ragged paged attention: each is
one module here with

    applies(backend, q, kv, softcap) -> bool    may it serve this layer's call (static facts)
    attend(backend, q, kv, block_tables, seg, window, softcap) -> out

over the contract of `engine.ragged.attend` (q [T, K, G, H] pre-scaled, the
layer's pool `kv` with the step's K/V already written, block tables [S, M],
the step's `Segments`; out [T, K, G, H], zeros for tokens of no segment).
A module may also set `NATIVE_PLATFORMS`, the platforms where its kernel
compiles (a Pallas kernel's "gpu", "tpu"); named on any other platform, it
runs with `interpret=True`. A call the chosen backend does not apply to runs
on `xla`, which serves every pool codec, soft-cap and platform. Adding a
backend is one module and one line in `BACKENDS`; `engine.ragged.choose_backend`
picks one per loaded model.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.backends import cpu_kernels, pallas, xla


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """How attention runs inside a compiled step (hashable: a static argument).

    Attributes:
      name: a key of `BACKENDS`.
      interpret: run a Pallas kernel through Pallas' interpreter (any
        platform, CPU included; how the tests run the "pallas" backend).
    """

    name: str
    interpret: bool = False

    def __post_init__(self):
        if self.name not in BACKENDS:
            raise ValueError(f"unknown attention backend {self.name!r}; one of {sorted(BACKENDS)}")

    @classmethod
    def named(cls, name: str, platform: str) -> "AttentionBackend":
        """The backend `name` on `platform`: interpreted where its module's
        `NATIVE_PLATFORMS` (when it sets one) leave `platform` out.

        Raises:
          ValueError: `name` is not a key of `BACKENDS`.
        """
        native = getattr(BACKENDS.get(name), "NATIVE_PLATFORMS", None)
        return cls(name, interpret=native is not None and platform not in native)

    @property
    def kernels(self) -> bool:
        """The C++ CPU kernels serve this backend's attention."""
        return self.name == "cpu_kernels"


BACKENDS = {"xla": xla, "cpu_kernels": cpu_kernels, "pallas": pallas}

XLA = AttentionBackend("xla")
CPU_KERNELS = AttentionBackend("cpu_kernels")
PALLAS = AttentionBackend("pallas")


def attend(backend: AttentionBackend, q, kv, block_tables, seg, window: int, softcap=None):
    """Ragged attention of q [T, K, G, H] over a layer's pool through
    `backend` where it applies, else through `xla`."""
    chosen = BACKENDS[backend.name]
    if chosen is not xla and chosen.applies(backend, q, kv, softcap):
        return chosen.attend(backend, q, kv, block_tables, seg, window, softcap)
    return xla.attend(backend, q, kv, block_tables, seg, window, softcap)
