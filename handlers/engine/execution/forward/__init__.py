"""One step's forward pass: the runner, the lean forward, attention, CUDA graphs, pooling and LoRA rows."""
