"""``serving bench`` end to end: on the default model folder (it starts its own server) and against a running
server (``--url``) over gRPC (typed, streamed) and OpenAI (a dynamic-batching model: whole answers)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from serving.bench.passes import workload_of
from serving.bench.scenario import load_scenario
from serving.bench.workload import load_tokenizer
from tests.integration.harness import DEFAULT_MODEL, REPO, ServerProcess

SCENARIO = """
api: lmi
num_requests: 6
seed: 3
warmup: 1
prompt_len: {dist: uniform, min: 8, max: 40}
output_len: {dist: uniform, min: 4, max: 12}
arrival:
  - {process: burst}
  - {process: poisson, rate: 0.5x}
slo: "ttft_p99=30s,itl_p99=10s"
"""


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def bench(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", "bench", *args, "--no-progress"], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def check_pass(p: dict[str, Any], expected: list[tuple[int, int]], streamed: bool) -> None:
    m = p["metrics"]
    assert (m["completed"], m["failed"], m["wrong_lengths"]) == (len(expected), 0, 0), m
    assert m["output_tokens"] == sum(n for _, n in expected)
    assert [(r["prompt_tokens"], r["max_new_tokens"]) for r in p["requests"]] == expected
    assert [r["output_tokens"] for r in p["requests"]] == [n for _, n in expected]
    for r in p["requests"]:
        assert len(r["itl_ms"]) == (r["output_tokens"] - 1 if streamed else 0)
        if not streamed:
            assert r["ttft_ms"] == r["e2e_ms"]
    assert m["request_s"] == pytest.approx(len(expected) / m["wall_s"])


def test_bench_on_the_default_model_folder(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    out = tmp_path / "out"
    proc = bench([str(DEFAULT_MODEL), "--scenario", str(tmp_path / "s.yaml"), "--out", str(out)], REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    w = workload_of(load_scenario(tmp_path / "s.yaml"), load_tokenizer(DEFAULT_MODEL))
    expected = [(r.prompt_len, r.max_new_tokens) for r in w.requests]
    assert result["model"] == "tiny-llama" and result["api"] == "lmi" and result["stream"] is True
    assert result["slo"] == "ttft_p99=30s,itl_p99=10s"
    assert result["server"]["model"]["batching"] == "rolling"
    burst, poisson = result["passes"]
    assert (burst["label"], burst["rate_req_s"]) == ("burst", None)
    assert poisson["rate_req_s"] == 0.5 * burst["metrics"]["request_s"]
    for p in (burst, poisson):
        check_pass(p, expected, streamed=True)
        m = p["metrics"]
        assert m["slo"]["met"] is True and m["slo"]["good_requests"] == 6  # bounds no run can miss here
        assert m["goodput_req_s"] == pytest.approx(6 / m["wall_s"])
    # the burst sends everything at t=0; the Poisson pass spreads the sends
    assert {r["send_s"] for r in burst["requests"]} == {0.0}
    assert max(r["send_s"] for r in poisson["requests"]) > 0
    assert png_size(out / "latency_throughput.png") == (1320, 528)
    assert png_size(out / "ttft_distribution.png") == (825, 528)
    assert png_size(out / "itl_distribution.png") == (825, 528)
    assert "| burst |" in proc.stdout and "| poisson " in proc.stdout
    assert proc.stderr.startswith(f"starting {DEFAULT_MODEL}")  # it started the folder itself...
    assert json.loads((out / "server" / "ports.json").read_text())["inference"] > 0  # ...on ports of its own


@pytest.mark.parametrize("api,model,streamed", [("grpc", "tiny-rb", True), ("openai", "tiny", False)])
def test_bench_against_a_running_server(api_server: ServerProcess, tmp_path: Path, api: str, model: str,
                                        streamed: bool) -> None:
    # one burst pass of 4 requests (the pass logic is the test above's)
    (tmp_path / "s.yaml").write_text(SCENARIO.replace("api: lmi", f"api: {api}").replace("num_requests: 6",
        "num_requests: 4").replace("  - {process: poisson, rate: 0.5x}\n", ""))
    out = tmp_path / "out"
    args = ["--url", api_server.url, "--model", model, "--tokenizer", str(DEFAULT_MODEL), "--scenario",
            str(tmp_path / "s.yaml"), "--out", str(out), "--grpc", api_server.grpc_target]
    if "inference" in api_server.tokens:
        args += [f"--token={api_server.tokens['inference']}"]
    proc = bench(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert (result["api"], result["stream"], result["server"]) == (api, streamed, {"url": api_server.url})
    w = workload_of(load_scenario(tmp_path / "s.yaml"), load_tokenizer(DEFAULT_MODEL))
    assert [p["label"] for p in result["passes"]] == ["burst"]
    for p in result["passes"]:
        check_pass(p, [(r.prompt_len, r.max_new_tokens) for r in w.requests], streamed)
    assert png_size(out / "ttft_distribution.png") == (825, 528)


@pytest.mark.parametrize("args,message", [
    ([], "error: give a model folder to start, or --url of a running server"),
    (["--url", "http://127.0.0.1:9"], "error: --url needs --model"),
    (["--url", "http://127.0.0.1:9", "--model", "m"], "error: prompts are generated from the model's tokenizer"),
    ([str(DEFAULT_MODEL), "--scenario", "nope"], "error: 'nope' is neither a scenario file nor a preset"),
    ([str(DEFAULT_MODEL), "--slo", "ttft=2s"], "error: SLO term 'ttft': the metric must be one of"),
    ([str(DEFAULT_MODEL), "--set", "batch_size"], "error: --set 'batch_size': expected KEY=VALUE"),
    (["/nonexistent-folder"], "error: /nonexistent-folder: model folder not found"),
])
def test_bench_refuses_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    proc = bench(args, tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(message), proc.stderr


def test_bench_passes_are_not_answered_from_the_prefix_cache(api_server: ServerProcess, tmp_path: Path) -> None:
    """Each pass sends prompts of new text with the same lengths: the second pass used to repeat the first
    one's prompts and be answered from the prefix cache the first filled (110M model: TTFT p50 571 -> 114 ms)."""
    (tmp_path / "s.yaml").write_text(SCENARIO.replace("num_requests: 6", "num_requests: 4").replace(
        "min: 8, max: 40", "min: 40, max: 60").replace("rate: 0.5x", "rate: 2x").replace(
        "warmup: 1", "warmup: 0\nstream: true").replace("seed: 3", "seed: 11"))
    # no warm-up or probe request: the passes are all it sends; a seed no other test sends (the same seed
    # draws the same words, so an earlier bench's prompts would share a first block with these)
    args = ["--url", api_server.url, "--model", "tiny-rb", "--tokenizer", str(DEFAULT_MODEL), "--scenario",
            str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out")]
    if "inference" in api_server.tokens:
        args += [f"--token={api_server.tokens['inference']}"]

    def totals() -> tuple[int, int]:
        engines = api_server.describe("tiny-rb")["batcher"]["engines"].values()
        return (sum(int(e["prefix_cache_hits_total"]) for e in engines),
                sum(int(e["num_requests_finished_total"]) for e in engines))

    hits, finished = totals()
    proc = bench(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    w = workload_of(load_scenario(tmp_path / "s.yaml"), load_tokenizer(DEFAULT_MODEL))
    for p in result["passes"]:  # same lengths every pass
        check_pass(p, [(r.prompt_len, r.max_new_tokens) for r in w.requests], streamed=True)
    sent = 2 * 4
    for _ in range(100):  # engine stats reach the frontend with the worker's next messages
        if totals()[1] >= finished + sent:
            break
        time.sleep(0.1)
    assert totals() == (hits, finished + sent)
