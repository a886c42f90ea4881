"""What is decided before a model loads, torch-free: the engine's options, the families it serves, the
checkpoint's figures, the host's memory and CPU, the memory plan."""
