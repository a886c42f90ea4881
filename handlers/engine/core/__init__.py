"""Scheduling and the KV cache's bookkeeping: pure Python, no torch (the scheduler, sequences, the block
allocator, the prefill time bound, n-gram drafting, detokenization)."""
