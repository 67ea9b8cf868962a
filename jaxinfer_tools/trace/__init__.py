"""`jaxinfer trace` (see `jaxinfer_tools.trace.run`)."""
