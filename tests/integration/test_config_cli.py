"""Configuration errors as a running server reports them (per-model FAILED with file, line, key and value,
while good models keep serving) and the ``serving config`` command."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import REPO, ServerProcess, write_model

ECHO = {"option.entryPoint": "echo"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("config"), models={
        "good": {**ECHO, "option.echo_delay_mss": "0"},  # a typo: a warning at load, never an error
        "bad-batch": {**ECHO, "max_batch_delay": "10", "batch_size": "abc"},
        "bad-queue": {**ECHO, "job_queue_size": "0"},
    }, wait_ready=False)  # /ping stays 503 with failed models: wait for the good one instead
    deadline = time.monotonic() + 60
    while s.describe("good").get("state") != "READY":
        assert time.monotonic() < deadline, s.log()
        time.sleep(0.1)
    yield s
    s.stop()


@pytest.mark.parametrize("model,line,key,value", [
    ("bad-batch", 3, "batch_size", "'abc'"),
    ("bad-queue", 2, "job_queue_size", "'0'"),
])
def test_bad_model_config_is_failed_with_where_and_what(server: ServerProcess, model: str, line: int, key: str,
                                                        value: str) -> None:
    info = server.describe(model)
    assert info["state"] == "FAILED"
    reason = info["reason"]
    assert f"serving.properties:{line}" in reason and key in reason and value in reason, reason
    assert "expected an integer >= 1" in reason
    r = httpx.post(f"{server.url}/predictions/{model}", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error_type"] == "unavailable"


def test_ping_reports_each_model_and_good_model_serves(server: ServerProcess) -> None:
    ping = httpx.get(f"{server.url}/ping", timeout=10)
    assert ping.status_code == 503
    assert ping.json()["models"] == {"good": "READY", "bad-batch": "FAILED", "bad-queue": "FAILED"}
    r = httpx.post(f"{server.url}/predictions/good", json={"inputs": "fine"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"generated_text": "fine"}
    models = httpx.get(f"{server.mgmt}/models", headers=server.mgmt_headers, timeout=10).json()["models"]
    assert {m["modelName"]: m["status"] for m in models} == {"good": "READY", "bad-batch": "FAILED",
                                                              "bad-queue": "FAILED"}


def test_a_typod_option_is_logged_at_load_and_the_model_serves(server: ServerProcess) -> None:
    assert "model good: unknown option.echo_delay_mss: did you mean option.echo_delay_ms? " \
           "(serving.properties:2)" in server.log()
    assert server.describe("good")["config"]["echo_delay_mss"] == "0"  # passed on as set


def serving_config(model_dir: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SAGEMAKER_", "HF_"))}
    return subprocess.run([sys.executable, "-m", "serving", "config", str(model_dir)], cwd=REPO,
                          env={**clean, **(env or {})}, capture_output=True, text=True, timeout=60)


def setting_line(out: str, key: str) -> str:
    (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(f"{key} =")]
    return line


def test_config_command_prints_each_key_with_its_source(tmp_path: Path) -> None:
    d = write_model(tmp_path, "m", {"option.entryPoint": "echo", "batch_size": "4", "option.custom": "x"})
    proc = serving_config(d)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "batch_size = 4" in setting_line(out, "batch_size")
    assert "(serving.properties:2)" in setting_line(out, "batch_size")
    assert "(serving.properties:1)" in setting_line(out, "option.entryPoint")
    assert "(serving.properties:3)" in setting_line(out, "option.custom")
    assert "max_batch_delay = 100" in setting_line(out, "max_batch_delay")
    assert "(default)" in setting_line(out, "max_batch_delay")


def test_config_command_shows_env_precedence(tmp_path: Path) -> None:
    d = write_model(tmp_path, "m", {"option.entryPoint": "echo", "batch_size": "4",
                                    "option.max_rolling_batch_size": "16"})
    proc = serving_config(d, {"SERVING_BATCH_SIZE": "6", "OPTION_MAX_ROLLING_BATCH_SIZE": "7"})
    assert proc.returncode == 0, proc.stderr
    line = setting_line(proc.stdout, "batch_size")
    assert "batch_size = 6" in line and "(env SERVING_BATCH_SIZE)" in line
    line = setting_line(proc.stdout, "option.max_rolling_batch_size")
    assert "= 7" in line and "(env OPTION_MAX_ROLLING_BATCH_SIZE)" in line


def test_config_command_shows_the_engine_options_and_warns_about_a_typo(tmp_path: Path) -> None:
    d = write_model(tmp_path, "m", {"option.entryPoint": "huggingface", "option.rolling_batch": "auto",
                                    "option.max_rolling_bach_size": "8", "option.my_handler_thing": "1"})
    proc = serving_config(d, {"OPTION_BLOCK_SIZE": "8", "OPTION_ENABLE_PREFIX_CACHING": "off"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "options of the rolling engine" in out
    for key, value, source in [("option.block_size", "8", "env OPTION_BLOCK_SIZE"),
                               ("option.enable_prefix_caching", "false", "env OPTION_ENABLE_PREFIX_CACHING"),
                               ("option.kv_cache_memory_mb", "auto", "default"),
                               ("option.max_prefill_tokens_while_decoding", "256", "default"),
                               ("option.my_handler_thing", "1", "serving.properties:4")]:
        line = setting_line(out, key)
        assert f"{key} = {value} " in line and line.endswith(f"({source})"), line
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning:")]
    assert warnings == ["warning: unknown option.max_rolling_bach_size: did you mean option.max_rolling_batch_size? "
                        "(serving.properties:3)"]


@pytest.mark.parametrize("props,env,expect", [
    ({"batch_size": "abc"}, {}, ["serving.properties:2", "batch_size", "'abc'"]),
    ({"job_queue_size": "0"}, {}, ["serving.properties:2", "job_queue_size", "'0'"]),
    ({"no_such_key": "1"}, {}, ["serving.properties:2", "no_such_key", "unknown key"]),
    ({"option.echo_delay_ms": "soon"}, {}, ["serving.properties:2", "option.echo_delay_ms = 'soon'",
                                            "expected a number >= 0"]),
    ({}, {"SERVING_BATCH_SIZE": "-3"}, ["env SERVING_BATCH_SIZE", "batch_size", "'-3'"]),
])
def test_config_command_fails_on_a_bad_value(tmp_path: Path, props: dict[str, str], env: dict[str, str],
                                              expect: list[str]) -> None:
    d = write_model(tmp_path, "m", {"option.entryPoint": "echo", **props})
    proc = serving_config(d, env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    for part in expect:
        assert part in proc.stderr, proc.stderr


def test_env_overrides_reach_a_running_server(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"echo": {**ECHO, "batch_size": "2"}},
                            env={"SERVING_BATCH_SIZE": "5", "OPTION_ECHO_DELAY_MS": "1"})
    try:
        info = s.describe("echo")
        assert info["batch_size"] == 5
        assert info["config"]["echo_delay_ms"] == "1"
    finally:
        s.stop()


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
         "max_position_embeddings": 2048, "tie_word_embeddings": False, "dtype": "float32"}


def header_only_checkpoint(d: Path, down_proj: list[int]) -> None:
    """A config.json and a model.safetensors whose header declares an embedding and one projection (no data:
    the memory plan reads headers only)."""
    end = 131072 + 4 * down_proj[0] * down_proj[1]
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [512, 64], "data_offsets": [0, 131072]},
              "model.layers.0.mlp.down_proj.weight": {"dtype": "F32", "shape": down_proj,
                                                      "data_offsets": [131072, end]}}
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (d / "config.json").write_text(json.dumps(LLAMA))


ROLLING = {"option.entryPoint": "huggingface", "option.rolling_batch": "auto", "option.max_rolling_batch_size": "4",
           "option.max_rolling_batch_prefill_tokens": "64", "option.prepack_weights": "hybrid"}


def test_config_command_prints_the_memory_plan(tmp_path: Path) -> None:
    d = write_model(tmp_path, "m", ROLLING)
    header_only_checkpoint(d, [64, 128])
    proc = serving_config(d)
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout[proc.stdout.index("memory plan"):]
    # weights: embedding 131072 B + down_proj 32768 B; the projection is the only linear weight
    for line in ["memory plan (rolling engine, dtype fp32, tensor_parallel_degree 1)",
                 "  weights          160.0 KiB  (safetensors headers, at fp32)",
                 "  prepacked         32.0 KiB  (prepack_weights=hybrid: a packed copy of every linear weight)",
                 "  activations      256.0 KiB  = 64 batched tokens x 64 hidden x 64 B",
                 "  max_model_len         2048  tokens (max_position_embeddings)",
                 "  KV per token         512 B  = 2 x 2 layers x 2 KV heads x 16 head_dim x 4 B",
                 "    need             4.0 MiB  = 4 sequences x 2048 tokens x 512 B",
                 "  KV blocks              512  hold 4 sequences of 2048 tokens at once"]:
        assert line in plan.splitlines(), plan
    # A dynamic-batching model does not use the engine's KV cache: no plan.
    d = write_model(tmp_path, "dyn", {**ROLLING, "option.rolling_batch": "disable"})
    header_only_checkpoint(d, [64, 128])
    proc = serving_config(d)
    assert proc.returncode == 0 and "memory plan" not in proc.stdout, proc.stdout


def test_config_command_refuses_a_model_that_cannot_fit(tmp_path: Path) -> None:
    d = write_model(tmp_path, "huge", ROLLING)
    header_only_checkpoint(d, [1 << 20, 1 << 20])  # 4 TiB of fp32, and as much again prepacked
    proc = serving_config(d)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: the model does not fit this worker's memory: weights 4096.00 GiB + "
                                  "prepacked copies 4096.00 GiB + activations 256.0 KiB exceed the budget of "), \
        proc.stderr
    for knob in ("option.prepack_weights=false", "option.dtype=bf16", "a bigger memory limit"):
        assert knob in proc.stderr


def test_a_model_that_cannot_fit_is_failed_with_the_figures(tmp_path: Path) -> None:
    source = tmp_path / "huge-weights"
    source.mkdir()
    header_only_checkpoint(source, [1 << 20, 1 << 20])
    s = ServerProcess.start(tmp_path / "server", models={"good": ECHO, "huge": ROLLING}, sources={"huge": source},
                            wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while (info := s.describe("huge"))["state"] != "FAILED":
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.1)
        reason = info["reason"]
        assert reason.startswith("InsufficientMemory: the model does not fit this worker's memory: weights "
                                 "4096.00 GiB + prepacked copies 4096.00 GiB + activations 256.0 KiB"), reason
        assert "option.prepack_weights=false" in reason
    finally:
        s.stop()


def test_config_command_lays_out_workers_from_the_cores_it_may_use() -> None:
    """The shipped tiny model says ``auto``: a worker per core of the process's affinity mask, as ``taskset`` sets
    it (the server's workers inherit the same mask)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SAGEMAKER_", "HF_"))}
    model = REPO / "examples" / "models" / "tiny-llama"
    cores = sorted(os.sched_getaffinity(0))
    for allowed in ([cores[0]], cores):
        proc = subprocess.run(["taskset", "-c", ",".join(map(str, allowed)), sys.executable, "-m", "serving",
                               "config", str(model)], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("effective workers")]
        n = len(allowed)
        assert line.startswith(f"effective workers = {n}-{n}  (workers auto: "), line
        assert ("one core: one worker" in line) == (n == 1), line
