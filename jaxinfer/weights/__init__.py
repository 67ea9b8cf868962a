"""Weight formats and the one matmul dispatch: `prepare` turns checkpoint
params into the layout the phases run on (fused q/k/v and gate/up, packed
panels for the CPU kernels, or quantized codes: `quant`), and `matmul`
multiplies by whichever format a weight has."""
