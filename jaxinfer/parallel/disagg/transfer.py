"""Moving a prefilled request (the payload of `worker`: its prompt's pages,
first token and log-probs) from a prefill worker to the decode worker.

    sender:    ticket = transport.offer(tree)      # holds the buffers
    receiver:  receipt = transport.receive(ticket, device)   # starts the copy, returns at once
               receipt.ready() ... receipt.result()         # the tree on `device`
    receiver -> sender: transport.release(ticket)  # the pull is acknowledged: buffers freed

Two transports behind that one interface:

* `LocalTransport`: prefill and decode in one process on different device
  sets; the copy is `jax.device_put`.
* `PullTransport`: separate processes; the sender registers its buffers
  with `jax.experimental.transfer` (`TransferServer.await_pull`), the
  receiver pulls them (`TransferConnection.pull`). Checked on CPU with jax
  0.10.2 (see docs/disaggregation.md): it works between processes on
  127.0.0.1, single-device and sharded arrays. A pull whose sender dies
  mid-transfer fails (the pulled arrays raise "Connection closed"); a pull
  of a uuid nobody registered, or from an address nobody serves, never
  completes and ignores its `timeout` argument, so the receiver polls
  `is_ready()` against its own deadline instead of blocking. A zero-size
  array (the top log-probs of a request asking for none are [0]) never
  completes either, so empty leaves are not sent: the receiver makes them. There is no
  way to withdraw an `await_pull`: a registered tree stays in the sender's
  server until pulled, so an aborted request is still pulled (and dropped).

Wire form: the tree is sent as a flat list of plain arrays (typed PRNG keys
as their uint32 key data) gathered onto one device of the sender; the
`Ticket` carries the pytree structure and the shapes, and the receiver
places the pages on its own mesh (`sharding.place`, inside `MeshPrograms`),
whatever the two sides' tp.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from typing import Any, Optional

import jax
import numpy as np


class TransferError(RuntimeError):
    """A KV transfer failed or did not finish before its deadline."""


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What the receiver needs to fetch one offered tree.

    Attributes:
      key: the sender's id for the tree (the `await_pull` uuid).
      address: the sender's transfer-server address ("" for `LocalTransport`).
      treedef: the tree's structure; shapes / dtypes: per leaf, in wire form.
      key_leaves: per leaf, whether it is a typed PRNG key array (sent as
        key data) and its key implementation name.
      nbytes: bytes on the wire.
    """

    key: int
    address: str
    treedef: Any
    shapes: tuple
    dtypes: tuple
    key_leaves: tuple
    nbytes: int


def _to_wire(tree, device) -> tuple[list, Ticket]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = tuple(str(jax.random.key_impl(x)) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                 else "" for x in leaves)
    plain = [jax.random.key_data(x) if k else x for x, k in zip(leaves, keys)]
    plain = jax.device_put(plain, jax.sharding.SingleDeviceSharding(device))   # gather shards
    ticket = Ticket(0, "", treedef, tuple(tuple(x.shape) for x in plain),
                    tuple(np.dtype(x.dtype).str for x in plain), keys,
                    sum(int(x.nbytes) for x in plain))
    return plain, ticket


def _from_wire(leaves: list, ticket: Ticket):
    leaves = [jax.random.wrap_key_data(x, impl=k) if k else x
              for x, k in zip(leaves, ticket.key_leaves)]
    return jax.tree_util.tree_unflatten(ticket.treedef, leaves)


class Receipt:
    """A transfer in progress on the receiver: `ready()` polls, `result()`
    returns the tree (or raises `TransferError`); both return at once."""

    def __init__(self, leaves: list, ticket: Ticket, deadline: float):
        self._leaves, self.ticket, self.deadline = leaves, ticket, deadline
        self.started = time.perf_counter()

    def ready(self) -> bool:
        return all(x.is_ready() for x in self._leaves)

    def expired(self, now: Optional[float] = None) -> bool:
        return (time.monotonic() if now is None else now) > self.deadline

    def wait(self, timeout_s: float) -> "Receipt":
        """Poll until ready, at most `timeout_s` seconds.

        Raises:
          TransferError: still not ready after timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise TransferError(f"the KV transfer did not finish within {timeout_s:g} s")
            time.sleep(0.001)
        return self

    def result(self):
        """The received tree, once `ready()`.

        Raises:
          TransferError: the transfer failed (e.g. the sender died), or is not ready yet.
        """
        if not self.ready():
            raise TransferError("the KV transfer has not finished")
        try:
            jax.block_until_ready(self._leaves)
        except Exception as e:  # noqa: BLE001 - the runtime's error type varies by backend
            raise TransferError(f"KV transfer failed: {e}") from e
        return _from_wire(self._leaves, self.ticket)


class LocalTransport:
    """Prefill and decode in one process (separate device sets): the sender
    keeps the tree, the receiver copies it with `jax.device_put`."""

    def __init__(self):
        self._held: dict[int, list] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()

    def offer(self, tree, device) -> Ticket:
        """Hold `tree` (gathered onto `device`) until `release`; returns its ticket."""
        leaves, ticket = _to_wire(tree, device)
        with self._lock:
            key = next(self._keys)
            self._held[key] = leaves
        return dataclasses.replace(ticket, key=key)

    def receive(self, ticket: Ticket, device, timeout_s: float = 60.0) -> Receipt:
        with self._lock:
            leaves = self._held.get(ticket.key)
        if leaves is None:
            raise TransferError(f"nothing is held under ticket {ticket.key}")
        out = jax.device_put(leaves, jax.sharding.SingleDeviceSharding(device))
        return Receipt(out, ticket, time.monotonic() + timeout_s)

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            self._held.pop(ticket.key, None)

    @property
    def num_held(self) -> int:
        """Trees offered and not yet released."""
        return len(self._held)


class PullTransport:
    """Between processes, over `jax.experimental.transfer`: one transfer
    server per process (`start_transfer_server` on the local client); the
    sender `await_pull`s, the receiver `connect`s and `pull`s.

    Args:
      host: the address the server listens on and publishes (127.0.0.1
        on one machine; the host's cluster address across machines).
    """

    def __init__(self, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._held: dict[int, tuple[list, float]] = {}
        self._connections: dict[str, Any] = {}
        self._keys = itertools.count(1)
        self._lock = threading.Lock()

    # --- sender -----------------------------------------------------------------------------

    def offer(self, tree, device) -> Ticket:
        """Register `tree` (gathered onto `device`) for one pull and hold its
        buffers until `release` (the receiver's acknowledgement)."""
        leaves, ticket = _to_wire(tree, device)
        leaves = [x for x in leaves if x.size]          # empty arrays never complete a pull
        with self._lock:
            key = next(self._keys)
            self._held[key] = (leaves, time.monotonic())
        self.server.await_pull(key, leaves)
        return dataclasses.replace(ticket, key=key, address=self.address)

    def release(self, ticket_or_key) -> None:
        key = getattr(ticket_or_key, "key", ticket_or_key)
        with self._lock:
            self._held.pop(int(key), None)

    def held_keys(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def expire(self, older_than_s: float) -> list[int]:
        """Drop held trees offered more than `older_than_s` seconds ago
        (their receiver is gone); returns their keys."""
        now = time.monotonic()
        with self._lock:
            old = [k for k, (_, t) in self._held.items() if now - t > older_than_s]
            for k in old:
                del self._held[k]
        return old

    @property
    def num_held(self) -> int:
        return len(self._held)

    # --- receiver ---------------------------------------------------------------------------

    def receive(self, ticket: Ticket, device, timeout_s: float = 60.0) -> Receipt:
        """Start pulling `ticket`'s tree onto `device`; returns at once."""
        conn = self._connections.get(ticket.address)
        if conn is None:
            conn = self._connections[ticket.address] = self.server.connect(ticket.address)
        sharding = jax.sharding.SingleDeviceSharding(device)
        specs = [jax.ShapeDtypeStruct(s, np.dtype(d), sharding=sharding)
                 for s, d in zip(ticket.shapes, ticket.dtypes) if math.prod(s)]
        pulled = iter(conn.pull(ticket.key, specs))
        leaves = [next(pulled) if math.prod(s) else
                  jax.device_put(np.zeros(s, np.dtype(d)), sharding)
                  for s, d in zip(ticket.shapes, ticket.dtypes)]
        return Receipt(leaves, ticket, time.monotonic() + timeout_s)

    def forget(self, address: str) -> None:
        """Drop the connection to a sender that is gone."""
        self._connections.pop(address, None)
