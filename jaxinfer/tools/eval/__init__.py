"""`jaxinfer eval` (see `jaxinfer.tools.eval.run`): accuracy of quantized
weights against float32; `speed` measures their decode speed."""
