"""Prometheus metrics of `jaxinfer serve` (GET /metrics, text exposition
format 0.0.4 through `prometheus_client`).

Each server has its own `CollectorRegistry`, so several servers in one
process (tests) do not share counters. Latencies are measured by the HTTP
server on `time.perf_counter()` from the moment the request body was
validated: TTFT to the first generated token reaching the event loop,
inter-token latency as each later delivery's gap divided by the tokens it
carried (decode runs in chunks of `decode_chunk` tokens), end-to-end to
the last token. Names follow vLLM's where one exists (`..._seconds`,
`..._total`).
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, generate_latest)

from jaxinfer.serving.request import Timings
from jaxinfer.server.async_engine import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


# The gauges `ServerMetrics.render` sets from an engine snapshot, labelled
# model_name (and the extra labels after the help): key -> (name, help, *labels).
_GAUGES = {
    "running": ("jaxinfer_num_requests_running", "Requests in decode slots"),
    "waiting": ("jaxinfer_num_requests_waiting",
                "Requests accepted, not yet decoding (queued or prefilling)"),
    "slots_used": ("jaxinfer_slots_used", "Decode slots holding a request"),
    "slots_total": ("jaxinfer_slots_total", "Decode slots (max_num_seqs)"),
    "kv_usage": ("jaxinfer_kv_cache_usage_ratio",
                 "Fraction of the allocated KV-cache positions holding live tokens"),
    "kv_capacity": ("jaxinfer_kv_cache_capacity_tokens",
                    "KV-cache positions allocated per slot (the cache bucket)"),
    "kv_bytes": ("jaxinfer_kv_cache_bytes", "Bytes of the decode state's KV cache"),
    "kv_pages": ("jaxinfer_kv_cache_pages", "Pages of the paged KV pool by state: used (held by "
                 "requests), free, cached (kept for prefix hits)", "state"),
    "prefix_queries": ("jaxinfer_prefix_cache_query_tokens",
                       "Prompt tokens looked up in the prefix cache so far"),
    "prefix_hits": ("jaxinfer_prefix_cache_hit_tokens",
                    "Prompt tokens served from the prefix cache so far"),
    "prefix_hit_rate": ("jaxinfer_prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                        "cache over those looked up, so far (0 before any)"),
    "preempted": ("jaxinfer_num_preemptions", "Requests preempted so far (the KV page pool ran "
                  "dry; they are recomputed)"),
    "steps": ("jaxinfer_engine_steps", "Scheduler steps so far"),
    "compiles": ("jaxinfer_programs_compiled", "Compiled programs so far"),
    "live": ("jaxinfer_programs_live", "Compiled programs held now (at most the max_programs "
             "cap; each keeps its machine code mapped)"),
    "compile_s": ("jaxinfer_compile_seconds", "Seconds spent compiling so far"),
    "grammar_bytes": ("jaxinfer_grammar_cache_bytes", "Bytes of the device tables of structured "
                      "output's automata (padded; at most jaxinfer_grammar_cache_limit_bytes)"),
    "grammar_entries": ("jaxinfer_grammar_cache_entries",
                        "Structured-output automata held on the device"),
    "grammar_limit": ("jaxinfer_grammar_cache_limit_bytes",
                      "The cap on the automata's device tables (grammar_cache_bytes)"),
    "grammar_evictions": ("jaxinfer_grammar_cache_evictions", "Automata evicted from the device "
                          "so far (built again when needed)"),
}


class ServerMetrics:
    """The server's counters, gauges and histograms.

    Args:
      model_name: the served model name (label `model_name` on every series).
      kv_bytes_per_position: KV-cache bytes per cached position of one slot
        (all layers, K and V), for `jaxinfer_kv_cache_bytes`.
    """

    def __init__(self, model_name: str, kv_bytes_per_position: int = 0):
        self.registry = CollectorRegistry()
        self.kv_bytes_per_position = kv_bytes_per_position
        ProcessCollector(registry=self.registry)          # process_resident_memory_bytes, ...
        r, m = self.registry, ["model_name"]
        self._model = model_name
        self.http_requests = Counter("jaxinfer_http_requests", "HTTP requests by route and status code",
                                     m + ["route", "status"], registry=r)
        self.finished = Counter("jaxinfer_requests_finished", "Engine requests (choices) finished, "
                                "by finish reason (stop, length, abort)", m + ["finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens of accepted requests",
                                     m, registry=r)
        self.generation_tokens = Counter("jaxinfer_generation_tokens", "Generated tokens", m,
                                         registry=r)
        self.gauges = {key: Gauge(name, doc, m + list(extra), registry=r)
                       for key, (name, doc, *extra) in _GAUGES.items()}
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxinfer_inter_token_latency_seconds", "Inter-token latency", m,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "End-to-end request latency",
                             m, buckets=_LATENCY_BUCKETS, registry=r)

    def count_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self._model, route, str(status)).inc()

    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)

    def tokens_generated(self, n: int) -> None:
        if n:
            self.generation_tokens.labels(self._model).inc(n)

    def request_finished(self, reason: str, timings: Optional[Timings]) -> None:
        """Count a finished choice and observe its latencies (timings on perf_counter)."""
        self.finished.labels(self._model, reason).inc()
        if timings is None or reason == "abort":
            return
        if timings.ttft is not None:
            self.ttft.labels(self._model).observe(timings.ttft)
        if timings.e2e is not None:
            self.e2e.labels(self._model).observe(timings.e2e)
        itl = self.itl.labels(self._model)
        for gap in timings.inter_token_latencies():
            itl.observe(gap)

    def render(self, stats: EngineStats, waiting: int, num_compiles: int, compile_s: float,
               num_live: int) -> bytes:
        """The exposition text, with the gauges set from an engine snapshot
        (num_live: compiled programs held now)."""
        m = self._model
        values = {"running": stats.running, "waiting": waiting, "slots_used": stats.running,
                  "slots_total": stats.slots, "kv_usage": stats.kv_cache_usage,
                  "kv_capacity": stats.cache_capacity,
                  "kv_bytes": stats.slots * stats.cache_capacity * self.kv_bytes_per_position,
                  "preempted": stats.num_preempted, "steps": stats.steps,
                  "compiles": num_compiles, "live": num_live, "compile_s": compile_s,
                  "grammar_bytes": stats.grammar_bytes, "grammar_entries": stats.grammar_entries,
                  "grammar_limit": stats.grammar_limit_bytes,
                  "grammar_evictions": stats.grammar_evictions}
        if stats.num_pages:
            for state in ("used", "free", "cached"):
                self.gauges["kv_pages"].labels(m, state).set(getattr(stats, f"pages_{state}"))
            values.update(prefix_queries=stats.prefix_query_tokens,
                          prefix_hits=stats.prefix_hit_tokens,
                          prefix_hit_rate=(stats.prefix_hit_tokens / stats.prefix_query_tokens
                                           if stats.prefix_query_tokens else 0.0))
        for key, value in values.items():
            self.gauges[key].labels(m).set(value)
        return generate_latest(self.registry)
