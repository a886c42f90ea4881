"""The rolling-batch (continuous batching) engine.

Pure-Python policy (``sequence``, ``kv_cache``, ``scheduler``) is separate from torch mechanism
(``runner``, ``sampling``); ``engine.LLMEngine`` ties them together one step at a time.
"""
