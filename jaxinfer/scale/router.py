"""`PrefixAffinityRouter`: Ray Serve's request router for the jaxinfer
replicas, sending a request to the replica that holds its prompt's first
pages, with load as the tiebreak.

It is a `ray.serve.request_router.RequestRouter` (Ray's extension point;
named in the replica deployment's `RequestRouterConfig`) and runs in the
process that calls the replicas (the ingress, `scale.deployment`). The
ingress passes each request's page hashes (`scale.prefix.PromptPages`)
as the keyword argument `page_hashes`, and the router ranks the replicas
(a request pinned to a replica, keyword argument `pinned`, goes to that
replica alone while it is a candidate):

  1. those the longest run of the request's first pages was routed to
     (`scale.prefix.PrefixTable`), unless their least queue is more than
     `imbalance` requests longer than the least queue of all replicas;
  2. then every replica, least loaded first, and among equal loads the one
     holding the fewest pages (so new prefixes spread over the replicas).

Ray's base class takes the first rank with a replica under its
`max_ongoing_requests` and, within it, the replica with the shortest queue
(its cached or probed queue lengths), so a full holder passes the request
on to the next rank. Ray LLM's `PrefixCacheAffinityRouter` matches text
prefixes in a tree held by a separate actor; this one matches the prefix
cache's own page hashes, in the router's process.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from jaxinfer.scale.forward import PAGE_HASHES, PINNED
from jaxinfer.scale.prefix import PrefixTable


class PrefixAffinityRouter(RequestRouter):
    """See the module docstring. `request_router_kwargs`: max_pages (page
    hashes remembered, `PrefixTable`), imbalance (queue-length gap, in
    requests, past which load wins over a prefix match)."""

    def initialize_state(self, max_pages: int = 1 << 20, imbalance: int = 8):
        if imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {imbalance}")
        self.table = PrefixTable(max_pages)
        self.imbalance = int(imbalance)

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def rank(self, candidates: List[RunningReplica], hashes) -> List[List[RunningReplica]]:
        """The ranks (most preferred first) of `candidates` for a request of
        page hashes `hashes` (see the module docstring)."""
        by_load = sorted(candidates, key=lambda r: (self._load(r), self.table.held(r.replica_id)))
        if not hashes or not by_load:
            return [by_load]
        matched = self.table.match(hashes)
        best = max((matched.get(r.replica_id, 0) for r in candidates), default=0)
        if best == 0:
            return [by_load]
        holders = [r for r in by_load if matched.get(r.replica_id, 0) == best]
        if self._load(holders[0]) - self._load(by_load[0]) > self.imbalance:
            return [by_load]
        return [holders, by_load]

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = [r for r in candidate_replicas
                  if kwargs.get(PINNED) is not None and r.replica_id.unique_id == kwargs[PINNED]]
        return [pinned] if pinned else self.rank(candidate_replicas, kwargs.get(PAGE_HASHES))

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        hashes = pending_request.kwargs.get(PAGE_HASHES) if pending_request is not None else None
        if hashes:
            self.table.record(hashes, replica_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self.table.drop(gone)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.drop(replica_id)
