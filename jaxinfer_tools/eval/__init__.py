"""`jaxinfer eval` (see `jaxinfer_tools.eval.run`): accuracy of quantized
weights against float32; `speed` measures their decode speed."""
