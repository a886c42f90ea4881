"""Tensor parallelism: the ranks of one worker, on one host or across hosts."""
