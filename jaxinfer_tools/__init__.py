"""Tools that stand beside the core: they use jaxinfer's public API only, and
the core never imports them.

  bench/   `jaxinfer bench`: roofline probes, prefill/decode sweeps, peers, reports
  trace/   `jaxinfer trace`: every number of prefill and decode on a tiny model
  eval/    `jaxinfer eval`: accuracy (and speed) of quantized weights against float32
  toy.py   the two-layer toy model and its optax training loop
"""
