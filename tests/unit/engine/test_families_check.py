"""The torch-free family check: which config.json the rolling engine accepts, and the reasons it gives."""

from __future__ import annotations

from typing import Any

import pytest

from handlers.engine.planning.families import UnsupportedModel, check_config, unsupported_reason

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192}
LONGROPE = {**LLAMA, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope"}}
DYNAMIC = {**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                        "original_max_position_embeddings": 4096}}
GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "max_position_embeddings": 32768,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                              "sliding_attention": {"rope_type": "default"}}}
GEMMA3_DYNAMIC = {**GEMMA3, "rope_parameters": {
    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8192},
    "sliding_attention": {"rope_type": "default"}}}

CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("llama", LLAMA, 0, None),
    ("yarn-like static scaling", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, 0, None),
    ("longrope past the original context", LONGROPE, 0, "RoPE scaling 'longrope'"),
    ("longrope capped at the original context", LONGROPE, 4096, None),
    ("dynamic NTK past the original context", DYNAMIC, 0, "RoPE scaling 'dynamic'"),
    ("dynamic NTK within it", DYNAMIC, 4000, None),
    ("per-layer-type static RoPE", GEMMA3, 0, None),
    ("per-layer-type dynamic RoPE", GEMMA3_DYNAMIC, 0, "RoPE scaling 'dynamic'"),
    ("bloom", {"model_type": "bloom", "architectures": ["BloomForCausalLM"]}, 0,
     "BloomForCausalLM (model_type=bloom): ALiBi"),
    ("alibi falcon", {"model_type": "falcon", "alibi": True}, 0, "alibi=true): ALiBi"),
    ("rotary falcon", {"model_type": "falcon", "alibi": False}, 0, None),
    ("unknown family", {"model_type": "fancy"}, 0, "fancy (model_type=fancy) is not on the rolling engine's verified"),
    # off the verified list, but a transformers causal LM: admitted, pending the worker's load-time self-check
    ("unlisted transformers family", {"model_type": "xglm"}, 0, None),
    ("no model_type", {}, 0, "no model_type"),
    ("bidirectional", {**GEMMA3, "use_bidirectional_attention": True}, 0, "bidirectional attention"),
]


@pytest.mark.parametrize(("name", "config", "max_model_len", "reason"), CASES, ids=[c[0] for c in CASES])
def test_unsupported_reason(name: str, config: dict[str, Any], max_model_len: int, reason: str | None) -> None:
    got = unsupported_reason(config, max_model_len)
    if reason is None:
        assert got is None
        check_config(config, max_model_len)
    else:
        assert got is not None and reason in got
        with pytest.raises(UnsupportedModel, match="model_type|no model_type"):
            check_config(config, max_model_len)


TP_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("llama tp2", {**LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}, 2, None),
    ("llama kv replicated", {**LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64}, 4,
     None),
    ("llama kv 3 over 2", {**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 64}, 2,
     "3 KV heads can neither be split nor replicated evenly"),
    ("heads do not divide", {**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 64}, 4,
     "does not divide num_attention_heads=6"),
    ("falcon-7b mqa", {"model_type": "falcon", "num_attention_heads": 4, "multi_query": True, "hidden_size": 64}, 2,
     None),
    ("falcon-40b", {"model_type": "falcon", "num_attention_heads": 8, "num_kv_heads": 2, "hidden_size": 64,
                    "new_decoder_architecture": True}, 4, None),
    ("phi3 fused projections", {"model_type": "phi3", "num_attention_heads": 4}, 2,
     "tensor parallelism supports"),
    ("any model, one rank", {"model_type": "phi3"}, 1, None),
]


@pytest.mark.parametrize(("name", "config", "degree", "reason"), TP_CASES, ids=[c[0] for c in TP_CASES])
def test_tensor_parallel_reason(name: str, config: dict[str, Any], degree: int, reason: str | None) -> None:
    from handlers.engine.planning.families import tensor_parallel_reason

    got = tensor_parallel_reason(config, degree)
    assert got is None if reason is None else (got is not None and reason in got), got
