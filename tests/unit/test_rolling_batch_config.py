"""``option.rolling_batch``: requested -> effective, from the model's architecture (config.json), with the reason;
an explicit rolling engine on an architecture it cannot serve is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config.config_report import describe_model_config
from serving.config.model_config import load_model_config
from tests.unit.config_cases import make_model

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}
BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom"}
MPT = {"architectures": ["MPTForCausalLM"], "model_type": "mpt"}
UNKNOWN = {"architectures": ["FancyForCausalLM"], "model_type": "fancy"}
LONGROPE = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope"}}
ALIBI = "ALiBi position bias (the engine implements rotary and learned positions only)"
# Off the verified list and unknown to transformers: nothing can self-check it, so it is refused by the screen.
UNLISTED_UNKNOWN = "FancyForCausalLM (model_type=fancy) is not on the rolling engine's verified list"
# Off the verified list but a transformers causal LM: the engine takes it, pending the worker's self-check.
GLM4 = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "max_position_embeddings": 2048}
PENDING = ("rolling engine, pending load-time self-check; Glm4ForCausalLM (model_type=glm4) is not on the verified "
           "list: the worker compares the engine's logits with transformers' forward when it loads and fails the "
           "model on a difference (option.rolling_batch=disable serves it with dynamic batching)")


def make_arch_model(tmp_path: Path, config: dict[str, object] | None, properties: str, **kw: object) -> Path:
    model_dir = make_model(tmp_path, properties, **kw)  # type: ignore[arg-type]
    if config is not None:
        (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(("config", "requested", "effective", "reason"), [
    (LLAMA, "auto", "scheduler",
     "option.rolling_batch=auto: rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "scheduler", "scheduler",
     "option.rolling_batch=scheduler: rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "vllm", "scheduler", "option.rolling_batch=vllm (DJL's name, served by rollserve's rolling engine): "
                                 "rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "lmi-dist", "scheduler", "option.rolling_batch=lmi-dist (DJL's name, served by rollserve's rolling "
                                     "engine): rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "disable", "disable", "option.rolling_batch=disable: dynamic batching"),
    (BLOOM, "auto", "disable", "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine "
                               f"cannot serve this model: BloomForCausalLM (model_type=bloom): {ALIBI}"),
    (MPT, "auto", "disable", "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine "
                             f"cannot serve this model: MPTForCausalLM (model_type=mpt): {ALIBI}"),
    (BLOOM, "disable", "disable", "option.rolling_batch=disable: dynamic batching"),
    (GLM4, "auto", "scheduler", f"option.rolling_batch=auto: {PENDING}"),
    (GLM4, "scheduler", "scheduler", f"option.rolling_batch=scheduler: {PENDING}"),
    (None, "auto", "scheduler", "option.rolling_batch=auto: rolling engine; no config.json in the model folder "
                                "to check the architecture before loading (the engine checks it when it loads)"),
])
def test_rolling_batch_choice(tmp_path: Path, config: dict[str, object] | None, requested: str, effective: str,
                              reason: str) -> None:
    cfg = load_model_config(make_arch_model(tmp_path, config, f"option.rolling_batch={requested}\n"))
    b = cfg.batching
    assert (b.rolling_batch_requested, b.rolling_batch, b.rolling_batch_reason) == (requested, effective, reason)
    assert b.rolling is (effective == "scheduler")
    assert b.describe_rolling_batch() == {"requested": requested, "effective": effective, "reason": reason}
    assert cfg.options["rolling_batch"] == requested  # the option as configured, for the handler


def test_rolling_batch_auto_on_an_architecture_transformers_does_not_know_falls_back(tmp_path: Path) -> None:
    """Off the verified list with no causal-LM class in transformers: no self-check can run, so ``auto`` falls
    back to dynamic batching at the frontend (an unlisted transformers family goes to the engine: GLM4 above)."""
    b = load_model_config(make_arch_model(tmp_path, UNKNOWN, "option.rolling_batch=auto\n")).batching
    assert b.rolling_batch == "disable"
    assert b.rolling_batch_reason.startswith(
        "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine cannot serve this model: "
        + UNLISTED_UNKNOWN)
    assert b.rolling_batch_reason.endswith("and transformers has no AutoModelForCausalLM class for it, so the "
                                           "load-time self-check cannot run")


def test_remote_code_architecture_is_pending_the_self_check(tmp_path: Path) -> None:
    """A config whose ``auto_map`` names an AutoModelForCausalLM class loads through transformers too."""
    config = {**UNKNOWN, "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"}}
    b = load_model_config(make_arch_model(tmp_path, config, "option.rolling_batch=auto\n")).batching
    assert b.rolling_batch == "scheduler"
    assert "rolling engine, pending load-time self-check; FancyForCausalLM (model_type=fancy)" in b.rolling_batch_reason


@pytest.mark.parametrize("requested", ["scheduler", "vllm", "lmi-dist", "SCHEDULER"])
@pytest.mark.parametrize(("config", "feature"), [
    (BLOOM, f"BloomForCausalLM (model_type=bloom): {ALIBI}"),
    (MPT, f"MPTForCausalLM (model_type=mpt): {ALIBI}"),
    (UNKNOWN, UNLISTED_UNKNOWN),
])
def test_explicit_rolling_engine_on_an_unsupported_architecture_is_an_error(
        tmp_path: Path, config: dict[str, object], feature: str, requested: str) -> None:
    model_dir = make_arch_model(tmp_path, config, f"batch_size=1\noption.rolling_batch={requested}\n")
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    assert str(info.value).startswith(
        f"{model_dir / 'serving.properties'}:2: option.rolling_batch = {requested!r}: the rolling engine cannot "
        f"serve this model: {feature}")
    assert str(info.value).endswith("; set option.rolling_batch=auto (falls back to dynamic batching) or disable")


def test_rolling_entry_point_with_auto_on_an_unsupported_architecture_is_an_error(tmp_path: Path) -> None:
    """``option.entryPoint=rolling`` asks for the engine's handler itself: no fallback to dynamic batching."""
    model_dir = make_arch_model(tmp_path, BLOOM, "option.entryPoint=rolling\noption.rolling_batch=auto\n")
    with pytest.raises(ConfigError, match=r"serving.properties:2: option.rolling_batch = 'auto': the rolling "
                                          r"engine cannot serve this model: BloomForCausalLM"):
        load_model_config(model_dir)


def test_rolling_batch_from_env_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(make_arch_model(tmp_path, BLOOM, "batch_size=1\n"), env={"OPTION_ROLLING_BATCH": "vllm"})
    assert str(info.value).startswith("env OPTION_ROLLING_BATCH: option.rolling_batch = 'vllm': the rolling engine "
                                      "cannot serve this model: BloomForCausalLM (model_type=bloom)")


@pytest.mark.parametrize(("requested", "effective"), [("auto", "scheduler"), ("scheduler", "scheduler"),
                                                      ("disable", "disable")])
def test_custom_entry_point_keeps_the_requested_batching(tmp_path: Path, requested: str, effective: str) -> None:
    """A model.py handler is its own engine: the architecture is not checked, rolling stays as requested."""
    cfg = load_model_config(make_arch_model(tmp_path, BLOOM, f"option.rolling_batch={requested}\n", model_py=True))
    assert cfg.entry_point == "model.py"
    assert cfg.batching.rolling_batch == effective
    if requested != "disable":
        assert cfg.batching.rolling_batch_reason == (
            f"option.rolling_batch={requested}: rolling batching with the handler of entry point 'model.py' "
            "(not the built-in engine, so the architecture is not checked)")


def test_rolling_batch_reads_config_json_of_model_id_folder(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(BLOOM))
    model_dir = make_arch_model(tmp_path, LLAMA, "option.model_id=../weights\noption.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "disable"
    (model_dir / "serving.properties").write_text(f"option.model_id={weights}\noption.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "disable"
    (model_dir / "serving.properties").write_text("option.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "scheduler"


def test_rolling_batch_length_dependent_rope_depends_on_max_model_len(tmp_path: Path) -> None:
    model_dir = make_arch_model(tmp_path, LONGROPE, "option.rolling_batch=auto\n")
    b = load_model_config(model_dir).batching
    assert b.rolling_batch == "disable" and "RoPE scaling 'longrope'" in b.rolling_batch_reason
    (model_dir / "serving.properties").write_text("option.rolling_batch=auto\noption.max_model_len=4096\n")
    assert load_model_config(model_dir).batching.rolling_batch == "scheduler"


def test_describe_model_config_shows_the_effective_rolling_batch(tmp_path: Path) -> None:
    cfg = load_model_config(make_arch_model(tmp_path, BLOOM, "option.rolling_batch=auto\n"))
    lines = describe_model_config(cfg).splitlines()
    assert lines[-2] == "effective rolling_batch = disable  (dynamic batching; requested auto)"
    assert lines[-1] == f"  reason: {cfg.batching.rolling_batch_reason}"
    assert any(line.strip().startswith("option.rolling_batch = auto") for line in lines)
