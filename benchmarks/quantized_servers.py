"""quantized_speed.py's servers, each started fresh under ``taskset -c LIST``: rollserve with ``option.quantize``
over a one-model store, and llama-cpp-python's OpenAI server on the GGUF file."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_servers import free_port
from benchmarks.cpu_accounting import cpulist
from serving.bench.launch import LocalServer, Subprocess, read_tokens, wait_http

REPO = Path(__file__).resolve().parents[1]
SERVING = REPO / ".venv" / "bin" / "serving"
# beside the checkout, as quantized_speed.py's docstring builds it
LLAMA_PYTHON = REPO.parent / "llama-venv" / "bin" / "python"
MODEL = "smollm2"  # the model's name on both servers (rollserve: its folder; llama.cpp: --model_alias)
MAX_SEQS = 32
MAX_MODEL_LEN = 2048
N_BATCH = 512  # llama.cpp's prompt batch: more than any prompt here, so a prompt is one forward pass


def start_rollserve(quantize: str, args: argparse.Namespace, cores: list[int], workdir: Path,
                    rec: dict[str, Any]) -> tuple[Subprocess, str]:
    """``serving --model-store`` over a one-model store on 127.0.0.1 ephemeral ports, pinned; waits for /ping."""
    n = len(cores)
    store = workdir / "model_store"
    (store / MODEL).mkdir(parents=True, exist_ok=True)
    # rollserve-gguf: the GGUF file llama.cpp serves, as it is (option.quantize=auto, quantized_activations=auto:
    # int8x2, int8 for a model of 1e9+ weights; -int8: one int8 part per input, llama.cpp's precision, at any
    # size); the others: the fp32 folder
    activations = "int8" if quantize == "gguf-int8" else "auto"
    model_id = str(args.gguf) if quantize.startswith("gguf") else str(args.model_dir)
    quantize = "auto" if quantize.startswith("gguf") else quantize
    props = {"option.model_id": model_id, "option.rolling_batch": "auto",
             "option.max_rolling_batch_size": str(MAX_SEQS), "option.max_model_len": str(MAX_MODEL_LEN),
             "option.num_threads": str(n), "option.quantize": quantize, "option.quantized_activations": activations,
             "minWorkers": "1", "maxWorkers": "1"}
    props.update(dict(kv.split("=", 1) for kv in getattr(args, "rollserve_option", None) or []))
    rec["serving_properties"] = "".join(f"{k}={v}\n" for k, v in props.items())
    (store / MODEL / "serving.properties").write_text(rec["serving_properties"])
    cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
           "grpc_address": "127.0.0.1:0", "key_file": str(workdir / "key_file.json")}
    (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
    ports_file = workdir / "ports.json"
    ports_file.unlink(missing_ok=True)  # a work folder used before: its old ports are not this server's
    cmd = ["taskset", "-c", cpulist(cores), str(SERVING), "--model-store", str(store),
           "--config", str(workdir / "config.properties"), "--ports-file", str(ports_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(n)}
    rec["command"] = shlex.join(cmd)
    proc = Subprocess(cmd, env, workdir / "server.log", workdir)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not ports_file.exists():
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rollserve did not start:\n{proc.tail()}")
            time.sleep(0.1)
        server = LocalServer(proc, workdir, MODEL, json.loads(ports_file.read_text()),
                             read_tokens(workdir / "key_file.json"))
        server.wait_ready(deadline)
    except BaseException:
        proc.stop()
        raise
    return proc, server.url


def start_llama(args: argparse.Namespace, cores: list[int], workdir: Path,
                rec: dict[str, Any]) -> tuple[Subprocess, str]:
    """llama-cpp-python's OpenAI server on the GGUF file, pinned; waits until ``/v1/models`` answers."""
    if not args.llama_python.exists():
        raise RuntimeError(f"{args.llama_python} not found: make llama.cpp's virtualenv first (module docstring)")
    n, port = len(cores), free_port()
    cmd = ["taskset", "-c", cpulist(cores), str(args.llama_python), "-m", "llama_cpp.server",
           "--model", str(args.gguf), "--model_alias", MODEL, "--n_threads", str(n), "--n_threads_batch", str(n),
           "--n_ctx", str(MAX_MODEL_LEN), "--n_batch", str(N_BATCH), "--interrupt_requests", "False",
           "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(n)})
    rec["command"] = shlex.join(cmd)
    proc = Subprocess(cmd, env, workdir / "server.log", workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/models", proc, args.start_timeout)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def start(server: str, args: argparse.Namespace, cores: list[int], workdir: Path,
          rec: dict[str, Any]) -> tuple[Subprocess, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    if server == "llama.cpp":
        return start_llama(args, cores, workdir, rec)
    return start_rollserve(server.removeprefix("rollserve-"), args, cores, workdir, rec)
