"""Liveness of the job's processes between steps: each follower counts up
its key in the coordination service every second (a thread of its own), and
process 0 reports a follower whose count stopped for `stall_s` seconds
(`JobSettings.heartbeat_s`): one that died while nothing ran, or that is
stopped, swapped out or hung. A collective with a dead process fails at
once by itself; this catches the rest.

    jaxinfer/tp/alive/{rank}   process rank -> process 0   its beat count
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from jaxinfer.parallel.disagg.process import _try_get
from jaxinfer.parallel.multiprocess.job import PREFIX, _client

ALIVE = f"{PREFIX}/alive"


class Liveness:
    """One process's side: a follower `beat`s, process 0 asks `stalled`.

    Args:
      num_processes, process_id: the job's size and this process's rank.
      stall_s: a follower not heard from this long is stalled (> 0).
      every_s: seconds between beats and between checks.
      client: the key-value store (default: this process's
        `jax.distributed` client): key_value_set(key, value,
        allow_overwrite=) and key_value_try_get_bytes(key).
      clock: monotonic seconds.
    Raises:
      ValueError: stall_s or every_s not above 0.
    """

    def __init__(self, num_processes: int, process_id: int, stall_s: float, every_s: float = 1.0,
                 client=None, clock: Callable[[], float] = time.monotonic):
        if stall_s <= 0 or every_s <= 0:
            raise ValueError(f"stall_s and every_s must be > 0, got {stall_s} and {every_s}")
        self.process_id, self.stall_s, self.every_s = process_id, stall_s, every_s
        self._client, self._clock, self._count = client, clock, 0
        start = clock()
        self._seen = {rank: (None, start) for rank in range(1, num_processes)}

    def _kv(self):
        return self._client if self._client is not None else _client()

    def beat(self) -> None:
        """A follower: one beat."""
        self._count += 1
        self._kv().key_value_set(f"{ALIVE}/{self.process_id}", str(self._count),
                                 allow_overwrite=True)

    def stalled(self) -> list[tuple[int, float]]:
        """Process 0: (rank, seconds since its count last changed) of each
        follower not heard from for more than stall_s (since this object was
        made, for one that never beat)."""
        now, out = self._clock(), []
        for rank, (value, since) in self._seen.items():
            current = _try_get(self._kv(), f"{ALIVE}/{rank}")
            if current != value:
                self._seen[rank] = (current, now)
            elif now - since > self.stall_s:
                out.append((rank, now - since))
        return out

    def start(self, on_stalled: Callable[[list], None],
              stop: Optional[threading.Event] = None) -> threading.Thread:
        """A daemon thread: a follower beats every every_s until `stop`;
        process 0 checks as often and calls `on_stalled(stalled())` once,
        then ends. Errors of the store end the thread (the job's steps
        report a lost coordination service themselves)."""
        stop = stop or threading.Event()

        def run():
            while not stop.wait(self.every_s):
                try:
                    if self.process_id:
                        self.beat()
                    elif stalled := self.stalled():
                        on_stalled(stalled)
                        return
                except Exception:  # noqa: BLE001 - the service is gone: the steps say so
                    return

        thread = threading.Thread(target=run, name="jaxinfer-liveness", daemon=True)
        thread.start()
        return thread


__all__ = ["ALIVE", "Liveness"]
