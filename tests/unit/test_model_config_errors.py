"""Model configuration refused: every bad value names its file and line (or env variable, or override), key,
value and reason; unknown keys, invalid model names and a missing folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config.model_config import load_model_config, validate_model_name
from tests.unit.config_cases import make_model


@pytest.mark.parametrize(
    ("text", "line", "key", "value", "reason"),
    [
        ("batch_size=abc\n", 1, "batch_size", "abc", "expected an integer >= 1"),
        ("batch_size=-1\n", 1, "batch_size", "-1", "expected an integer >= 1"),
        ("batch_size=0\n", 1, "batch_size", "0", "expected an integer >= 1"),
        ("batch_size=1.5\n", 1, "batch_size", "1.5", "expected an integer >= 1"),
        ("max_batch_delay=-5\n", 1, "max_batch_delay", "-5", "expected an integer >= 0"),
        ("job_queue_size=0\n", 1, "job_queue_size", "0", "expected an integer >= 1"),
        ("maxWorkers=1\n\nminWorkers=3\n", 3, "minWorkers", "3", "must be <= maxWorkers (1, from serving"),
        ("# c\noption.trust_remote_code=maybe\n", 2, "option.trust_remote_code", "maybe",
         "expected true or false"),
        ("option.rolling_batch=bogus\n", 1, "option.rolling_batch", "bogus",
         "expected one of disable, auto, scheduler, lmi-dist, vllm"),
        ("option.rolling_batch=trtllm\n", 1, "option.rolling_batch", "trtllm",
         "TensorRT-LLM is not part of rollserve; use auto or scheduler"),
        ("option.rolling_batch=tnx\n", 1, "option.rolling_batch", "tnx", "transformers-neuronx is not part of"),
        ("option.dtype=int3\n", 1, "option.dtype", "int3", "expected one of fp32, fp16, bf16, auto"),
        ("option.predict_timeout=0\n", 1, "option.predict_timeout", "0", "expected a number > 0"),
        ("option.model_loading_timeout=soon\n", 1, "option.model_loading_timeout", "soon", "expected a number"),
        ("option.tensor_parallel_degree=0\n", 1, "option.tensor_parallel_degree", "0", "or 'max'"),
        ("option.max_rolling_batch_size=0\n", 1, "option.max_rolling_batch_size", "0", ">= 1"),
        ("option.max_rolling_batch_prefill_tokens=x\n", 1, "option.max_rolling_batch_prefill_tokens", "x", ">= 1"),
        ("load_on_devices=gpu0\n", 1, "load_on_devices", "gpu0", "device ids"),
        ("engine=DeepSpeed\n", 1, "engine", "DeepSpeed", "expected one of Python, MPI"),
        ("a=1\noption.entryPoint=\n", 2, "option.entryPoint", "", "non-empty"),
        ("max_idle_time=-1\n", 1, "max_idle_time", "-1", ">= 0"),
        ("required_memory_mb=lots\n", 1, "required_memory_mb", "lots", ">= 0"),
    ],
)
def test_bad_file_value_names_file_line_key_value(
        tmp_path: Path, text: str, line: int, key: str, value: str, reason: str) -> None:
    model_dir = make_model(tmp_path, text.replace("a=1\n", "batch_size=1\n"))
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    message = str(info.value)
    assert f"serving.properties:{line}: {key} = {value!r}: " in message
    assert str(model_dir / "serving.properties") in message
    assert reason in message


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(make_model(tmp_path, "batch_size=2\n"), env={"SERVING_BATCH_SIZE": "abc"})
    assert str(info.value) == "env SERVING_BATCH_SIZE: batch_size = 'abc': expected an integer >= 1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OPTION_DTYPE": "int3"}, "env OPTION_DTYPE: option.dtype = 'int3'"),
        ({"OPTION_TRUST_REMOTE_CODE": "maybe"},
         "env OPTION_TRUST_REMOTE_CODE: option.trust_remote_code = 'maybe'"),
        ({"SAGEMAKER_NUM_MODEL_WORKERS": "x"}, "env SAGEMAKER_NUM_MODEL_WORKERS: minWorkers = 'x'"),
    ],
)
def test_bad_env_values(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError, match="^" + expected.replace(".", r"\.")):
        load_model_config(make_model(tmp_path), env=env)


def test_bad_override_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^override: batch_size = '0': expected an integer >= 1"):
        load_model_config(make_model(tmp_path), overrides={"batch_size": "0"})


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [("bogus_key=1\n", 1, "bogus_key"), ("batch_size=1\nbatchsize2=4\n", 2, "batchsize2"),
     ("model_id=x\n", 1, "model_id")],
)
def test_unknown_model_key_is_an_error(tmp_path: Path, text: str, line: int, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"serving\.properties:{line}: {key} = .*unknown key"):
        load_model_config(make_model(tmp_path, text))


def test_unknown_override_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="override: nope = '1': unknown key"):
        load_model_config(make_model(tmp_path), overrides={"nope": "1"})


@pytest.mark.parametrize("name", ["", "-x", ".hidden", "a b", "a/b", "é"])
def test_invalid_model_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid model name"):
        validate_model_name(name)
    with pytest.raises(ConfigError, match="invalid model name"):
        load_model_config(make_model(tmp_path), name=name)


@pytest.mark.parametrize("name", ["m", "Llama-3.1_8B", "0model"])
def test_valid_model_names(name: str) -> None:
    assert validate_model_name(name) == name


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model folder not found"):
        load_model_config(tmp_path / "absent")

