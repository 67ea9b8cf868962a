"""C++ CPU kernels called from jit code through the XLA FFI (a leaf package):
`cpu` builds, loads and switches the library; `attention`, `ragged`,
`packed` and `quant` wrap its targets."""
