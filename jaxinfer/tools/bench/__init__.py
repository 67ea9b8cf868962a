"""`jaxinfer bench` (see `jaxinfer.tools.bench.run`)."""
