"""Running the model: loading, the runner and its kernels (C, Triton, oneDNN prepacking, quantized linears),
paged attention, sampling, grammars, tensor parallelism, devices, CUDA graphs."""
