"""`jaxinfer trace` (see `jaxinfer.tools.trace.run`)."""
