"""Loading a model's weights: safetensors, GGUF and quantized checkpoints into the served form."""
