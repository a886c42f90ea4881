"""The GPU side: the engine's device and the Triton decode kernel."""
