"""Start real rollserve server processes on 127.0.0.1 with ephemeral ports, for integration tests.

``ServerProcess.start(tmp_path, models={...}, config={...})`` writes a model store and a
config.properties, runs ``python -m serving`` in its own process group, waits until the bound ports are
known and ``/ping`` answers 200 (or until ``wait_ready=False``), and ``stop()`` SIGTERMs it and checks that
the whole process tree is gone. The server's tokens are read from the key file it writes in its working
directory: ``mgmt_headers`` / ``inference_headers`` carry them (``Authorization: Bearer ...``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from serving.bench.launch import ServerAddresses, http_client, read_tokens
from serving.frontends.http.djl import model_entry

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "examples" / "models" / "tiny-llama"


def with_lazy_kv(props: dict[str, str]) -> dict[str, str]:
    """A rolling-batch model's properties with its KV cache mapped lazily unless the test chose: a test touches a
    few of the thousands of blocks the default plan holds, and faulting in all of them (the default, eager) cost
    about half a CPU-second a worker start. Eager pages are tested where they are the subject
    (tests/engine/test_kernels.py), and a model that loads on demand keeps the default: the memory its workers hold
    is what the residency tests measure."""
    if props.get("option.rolling_batch", "disable") == "disable" or "option.kv_cache_populate" in props \
            or props.get("load_on_demand") == "true":
        return props
    return {**props, "option.kv_cache_populate": "lazy"}


def write_model(store: Path, name: str, properties: dict[str, str], source: Path | None = None,
                files: dict[str, str] | None = None) -> Path:
    """A model folder in ``store``: weights (and folders such as ``adapters/``) linked from ``source`` (if any), a
    serving.properties, files."""
    d = store / name
    d.mkdir(parents=True, exist_ok=True)
    if source is not None:
        for f in source.iterdir():
            if f.name != "serving.properties" and (f.is_file() or f.is_dir()):
                target = d / f.name
                if not target.exists():
                    os.symlink(f, target)
    (d / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in with_lazy_kv(properties).items()))
    for fname, text in (files or {}).items():
        (d / fname).write_text(text)
    return d


@dataclass
class ServerProcess(ServerAddresses):
    proc: subprocess.Popen[bytes]
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    log_path: Path | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def inference_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens['inference']}"} if "inference" in self.tokens else {}

    @property
    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC ``authorization`` metadata with the management token (it opens management RPCs)."""
        return (("authorization", f"Bearer {self.tokens['management']}"),) if "management" in self.tokens else ()

    @property
    def grpc_inference_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens['inference']}"),) if "inference" in self.tokens else ()

    @classmethod
    def start(cls, workdir: Path, models: dict[str, dict[str, str]] | None = None,
              config: dict[str, str] | None = None, env: dict[str, str] | None = None,
              sources: dict[str, Path] | None = None, files: dict[str, dict[str, str]] | None = None,
              wait_ready: bool = True, timeout_s: float = 120.0, extra_args: list[str] | None = None,
              prefix: list[str] | None = None, host: str = "127.0.0.1") -> ServerProcess:
        """``models``: name -> serving.properties dict (weights from ``sources[name]`` or the default
        model for huggingface/rolling entry points). ``prefix`` runs the server under another command (e.g.
        ``ip netns exec NS``); ``host`` is the address its ports are reached at."""
        workdir.mkdir(parents=True, exist_ok=True)
        store = workdir / "model_store"
        store.mkdir(exist_ok=True)
        for name, props in (models or {}).items():
            src = (sources or {}).get(name)
            if src is None and props.get("option.entryPoint", "huggingface") in ("huggingface", "rolling"):
                src = DEFAULT_MODEL
            write_model(store, name, props, src, (files or {}).get(name))
        cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
               "grpc_address": "127.0.0.1:0", "model_store": str(store), "drain_timeout": "30"}
        cfg.update(config or {})
        (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
        ports_file = workdir / "ports.json"
        if ports_file.exists():
            ports_file.unlink()
        log_path = workdir / "server.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "serving", "--config", str(workdir / "config.properties"),
             "--ports-file", str(ports_file), *(extra_args or [])],
            cwd=workdir, env=full_env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        server = cls(proc, workdir, log_path=log_path, host=host)
        deadline = time.monotonic() + timeout_s
        while not ports_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"server did not start:\n{server.log()}")
            time.sleep(0.05)
        server.ports = json.loads(ports_file.read_text())
        key_file = Path(cfg.get("key_file") or "key_file.json")
        server.tokens = read_tokens(key_file if key_file.is_absolute() else workdir / key_file)
        if wait_ready:
            try:
                server.wait_ready(deadline - time.monotonic())
            except BaseException:
                server.kill()
                raise
        return server

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log()}")
            try:
                ping = http_client().get(self.url + "/ping", timeout=2)
                if ping.status_code == 200:
                    return
                failed = [m for m, state in ping.json().get("models", {}).items() if state == "FAILED"]
                if failed:  # it will never be ready: say so now instead of at the timeout
                    raise RuntimeError(f"models {failed} FAILED:\n{self.log()}")
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready in time:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def worker_pids(self) -> list[int]:
        """The server's worker processes: its children, and the fork server's (which is not a worker)."""
        pids = []
        for pid in _children(self.proc.pid):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except FileNotFoundError:  # it exited since the listing: it is not a worker any more
                continue
            if name == "rollserve-fork":
                pids += _children(int(pid))
            else:
                pids.append(pid)
        return [int(p) for p in pids]

    def describe(self, model: str) -> dict[str, Any]:
        """The model object of ``GET /models/{model}`` (DJL's shape; rollserve's state is ``state``)."""
        resp = http_client().get(f"{self.mgmt}/models/{model}", headers=self.mgmt_headers, timeout=10)
        return model_entry(resp.json())

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait, and assert no process of the group survives. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        deadline = time.monotonic() + 5.0  # a process killed at the end (e.g. a tensor-parallel rank killed with
        leftover = _group_members(self.proc.pid)  # its worker) may take a moment to be reaped by init
        while leftover and time.monotonic() < deadline:
            time.sleep(0.1)
            leftover = _group_members(self.proc.pid)
        if leftover:
            self.kill()
            raise AssertionError(f"processes left after shutdown: {leftover}")
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _children(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return out.stdout.split()


def rank_processes(worker: int) -> dict[int, str]:
    """The tensor-parallel ranks a worker started, pid -> name: its descendants named ``tp-rankN`` (they are forked
    from a zygote the worker started, not from the worker)."""
    found: dict[int, str] = {}
    todo = [worker]
    while todo:
        for child in map(int, _children(todo.pop())):
            todo.append(child)
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:  # it exited meanwhile
                continue
            if name.startswith("tp-rank"):
                found[child] = name
    return found


def _group_members(pgid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return out.stdout.split()


def greedy_references(prompts: list[str] | tuple[str, ...], max_new_tokens: int, *, ignore_eos: bool = False,
                      model_dir: Path = DEFAULT_MODEL) -> dict[str, list[int]]:
    """Greedy token ids of each prompt from transformers' own ``generate``, one prompt at a time, fp32 (what a
    server's greedy answer must equal); ``ignore_eos`` as requests that ignore EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # a GGUF model folder (config, tokenizer, model.gguf): transformers' own dequantization of the file
    gguf = {"gguf_file": "model.gguf"} if (Path(model_dir) / "model.gguf").exists() else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **gguf).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    out: dict[str, list[int]] = {}
    with torch.no_grad():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            out[p] = gen[0, enc["input_ids"].shape[1]:].tolist()
    return out


def copy_default_model(dest: Path) -> Path:
    shutil.copytree(DEFAULT_MODEL, dest, dirs_exist_ok=True)
    return dest
