"""Serving on the host: requests, the scheduler, the runner and the `LLM` API.

  `llm`        `LLM`: load a model, generate / stream / score (research code)
  `scheduler`  continuous batching: each iteration fills a token budget and
               runs one step; owns the KV pages (`pages`)
  `runner`     the device side: dispatches the compiled step by token bucket;
               its compile plan is what warm-up compiles
  `thread`     the scheduler on its own thread, for servers
  `request`, `stats`, `loading`, `programs`, `buckets`
"""
