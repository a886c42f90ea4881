"""Which transformers architectures the rolling engine serves exactly, and why it refuses the others.

Design note: torch-free and driven by ``config.json`` alone, so the frontend can decide
``option.rolling_batch=auto`` (engine or dynamic batching) before any worker starts, and ``serving config``
can say it without loading weights. The engine repeats the check at load time and, on top, probes one
forward pass for attention arguments it does not implement (``handlers.engine.execution.forward.paged_attention``): a
feature the engine cannot honour refuses the model by name, it is never dropped silently.

Families run either through transformers' attention interface (the model is unchanged, its attention
calls ``paged_attention_forward``) or through an adapter of ours that replaces the attention module's
forward (``handlers.engine.execution.forward.falcon_attention``: Falcon).

An architecture off the verified list (``SUPPORTED``) is not refused for its name: when transformers has a
causal-LM class for it (``AutoModelForCausalLM``; read from transformers' source, so this stays torch-free)
and it passes the feature screens below, the engine admits it provisionally and the worker verifies it at
load (``handlers.engine.execution.self_check``: the engine's logits against transformers' own forward); a difference
refuses it there, naming the first one. ``admission`` says which way a config goes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# model_type -> how the engine runs it. Every entry is covered by the family matrix test
# (tests/engine/test_families.py), which compares the engine with transformers' generate().
ATTENTION_INTERFACE = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "starcoder2", "olmo", "olmo2", "gpt_oss", "gpt2", "gpt_neox", "cohere", "granite", "stablelm", "phi",
})
ADAPTED = frozenset({"falcon"})
SUPPORTED = ATTENTION_INTERFACE | ADAPTED

# Families whose layers tensor parallelism knows how to shard
# (``handlers.engine.execution.parallel.sharding.shard_model``):
# separate q/k/v/o and gate/up/down projections, or Falcon's fused QKV (after its adapter). Not OLMo-2: its
# q/k norms span all heads, which a head shard cannot compute without another all-reduce; not StableLM: its
# attention reshapes with the configured head count.
TENSOR_PARALLEL = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo",
                             "granite", "cohere", "falcon"})

# Known families the engine refuses, with the feature it lacks.
_REFUSED = {
    "bloom": "ALiBi position bias (the engine implements rotary and learned positions only)",
    "mpt": "ALiBi position bias (the engine implements rotary and learned positions only)",
}
# RoPE variants whose frequencies depend on the sequence's current length: exact only while no sequence
# can pass the original context, where they equal plain RoPE.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


# How an architecture is admitted (``GET /models/{name}`` reports the worker's final word as "admitted").
ADMITTED_BY_LIST = "verified list"
PENDING_SELF_CHECK = "pending load-time self-check"


class UnsupportedModel(ValueError):
    """The rolling engine cannot serve this model exactly; the message names the architecture and feature."""


def unsupported_reason(config: Mapping[str, Any], max_model_len: int | None = None) -> str | None:
    """Why the rolling engine cannot serve a model with this ``config.json``, or None when it can.

    ``max_model_len``: the context the engine will allow (0/None = the model's ``max_position_embeddings``).
    """
    model_type = str(config.get("model_type") or "")
    arch = _arch_name(config)
    if not model_type:
        return f"{arch}: config.json has no model_type; the rolling engine cannot tell the architecture"
    if model_type in _REFUSED:
        return f"{arch} (model_type={model_type}): {_REFUSED[model_type]}"
    if model_type not in SUPPORTED and not _causal_lm_loadable(config):
        return (f"{arch} (model_type={model_type}) is not on the rolling engine's verified list "
                f"({', '.join(sorted(SUPPORTED))}) and transformers has no AutoModelForCausalLM class for it, so "
                "the load-time self-check cannot run")
    if model_type == "falcon" and config.get("alibi"):
        return f"{arch} (model_type=falcon, alibi=true): ALiBi position bias is not implemented by the engine"
    if config.get("use_bidirectional_attention"):
        return f"{arch} (model_type={model_type}): bidirectional attention (use_bidirectional_attention=true)"
    limit = int(max_model_len or config.get("max_position_embeddings") or 0)
    for params in _rope_parameter_sets(config):
        rope = str(params.get("rope_type") or params.get("type") or "default")
        if rope not in _LENGTH_DEPENDENT_ROPE:
            continue
        original = int(params.get("original_max_position_embeddings")
                       or config.get("original_max_position_embeddings") or 0)
        if not original or limit > original:
            return (f"{arch} (model_type={model_type}): RoPE scaling {rope!r} changes with a sequence's length, "
                    f"which the engine does not compute per sequence; set option.max_model_len <= "
                    f"{original or 'original_max_position_embeddings'} to serve it without scaling")
    return None


def needs_self_check(model_type: str) -> bool:
    """True for an architecture off the verified list: the worker verifies it at load before serving it."""
    return model_type not in SUPPORTED


def admission(config: Mapping[str, Any]) -> str:
    """How a config that ``unsupported_reason`` lets through is admitted: ``ADMITTED_BY_LIST`` or, for an
    architecture off the list, ``PENDING_SELF_CHECK`` (the worker's self-check decides)."""
    return PENDING_SELF_CHECK if needs_self_check(str(config.get("model_type") or "")) else ADMITTED_BY_LIST


def _causal_lm_loadable(config: Mapping[str, Any]) -> bool:
    """Whether ``AutoModelForCausalLM`` can build this config: its ``auto_map`` names a remote class, or
    transformers maps its model_type to a causal-LM class. True when transformers' mapping cannot be read
    (the worker's load then decides)."""
    auto_map = config.get("auto_map")
    if isinstance(auto_map, Mapping) and "AutoModelForCausalLM" in auto_map:
        return True
    known = transformers_causal_lm_types()
    return known is None or str(config.get("model_type") or "") in known


@functools.lru_cache(maxsize=1)
def transformers_causal_lm_types() -> frozenset[str] | None:
    """The model_types of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, read from its source without
    importing transformers (which imports torch), or None when that cannot be read."""
    spec = importlib.util.find_spec("transformers")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    path = Path(locations[0]) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
                and any(isinstance(t, ast.Name) and t.id == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
                        for t in node.targets)):
            try:
                pairs = ast.literal_eval(node.value.args[0])
            except ValueError:
                return None
            return frozenset(str(pair[0]) for pair in pairs)
    return None


def tensor_parallel_reason(config: Mapping[str, Any], degree: int) -> str | None:
    """Why ``degree`` ranks cannot shard this model, or None when they can (checked before ranks start).
    Query heads and the MLP must split evenly; KV heads split evenly or, when fewer than the ranks, are
    replicated (the degree must then be a multiple of them)."""
    if degree <= 1:
        return None
    model_type = str(config.get("model_type") or "")
    arch = _arch_name(config)
    if model_type not in TENSOR_PARALLEL:
        return (f"{arch} (model_type={model_type}): tensor parallelism supports {', '.join(sorted(TENSOR_PARALLEL))}; "
                "set option.tensor_parallel_degree=1")
    heads = int(config.get("num_attention_heads") or 0)
    if model_type == "falcon":
        kv = int(config.get("num_kv_heads") or heads) if config.get("new_decoder_architecture") else \
            1 if config.get("multi_query", True) else heads
        inter = int(config.get("ffn_hidden_size") or 4 * int(config.get("hidden_size") or 0))
    else:
        kv = int(config.get("num_key_value_heads") or heads)
        inter = int(config.get("intermediate_size") or 0)
    if not heads or heads % degree:
        return f"{arch}: tensor_parallel_degree={degree} does not divide num_attention_heads={heads}"
    if inter % degree:
        return f"{arch}: tensor_parallel_degree={degree} does not divide the MLP width {inter}"
    if (kv >= degree and kv % degree) or (kv < degree and degree % kv):
        return (f"{arch}: {kv} KV heads can neither be split nor replicated evenly over "
                f"tensor_parallel_degree={degree}")
    return None


def check_config(config: Mapping[str, Any], max_model_len: int | None = None, tensor_parallel_degree: int = 1) -> None:
    """Raise ``UnsupportedModel`` when ``unsupported_reason`` or ``tensor_parallel_reason`` gives one."""
    reason = unsupported_reason(config, max_model_len) or tensor_parallel_reason(config, tensor_parallel_degree)
    if reason is not None:
        raise UnsupportedModel(reason)


def _arch_name(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    return str(config.get("model_type") or "unknown architecture")


def _rope_parameter_sets(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every RoPE parameter set of a config: ``rope_parameters``/``rope_scaling``, or one per layer type
    (Gemma-3 style ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, Mapping):
            nested = [v for v in value.values() if isinstance(v, Mapping)]
            return nested or [value]
    return []
