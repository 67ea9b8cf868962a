"""Tools beside the library, installed with it from the same pyproject.toml:
they import `jaxinfer` (the public API) and `jaxinfer.testing` (what they
need of the internals) and nothing else of it, and jaxinfer never imports
them (import-linter contracts in pyproject.toml). The `jaxinfer` command
imports them only when one of their commands is named.

  bench/       `jaxinfer bench`: roofline probes, prefill/decode sweeps, peers, reports
  trace/       `jaxinfer trace`: every number of prefill and decode on a tiny model
  eval/        `jaxinfer eval`: accuracy (and speed) of quantized weights against float32
  toy.py       `jaxinfer train-toy`: the two-layer toy model and its optax training loop
  roofline.py  the cost model: FLOPs and bytes per phase, the roofline, percentiles
"""
