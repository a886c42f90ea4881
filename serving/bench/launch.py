"""Start a model folder on a private rollserve server (``python -m serving``), for ``serving bench``/``tune``.

The server runs in its own process group on 127.0.0.1 ephemeral ports, from a work folder holding a model
store with one model: the folder's files linked, its ``serving.properties`` rewritten with the given
overrides. Its tokens come from the key file it writes there. ``stop()`` ends the whole group.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from serving.config.model_config import MODEL_PROPERTIES
from serving.config.properties import parse_properties

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")


@functools.cache
def http_client() -> httpx.Client:
    """The one HTTP client of this process's polls and management calls: making a client loads the CA bundle
    (~40 ms of CPU), which a poll every few milliseconds would spend on the cores the polled server needs."""
    import httpx

    return httpx.Client(timeout=30, limits=httpx.Limits(max_connections=None, max_keepalive_connections=8))


def wait_for(cond: Callable[[], T], what: str = "the condition", timeout_s: float = 60.0, step_s: float = 0.01) -> T:
    """Poll ``cond`` until it returns something true, and return that: the one way tests, benchmarks and the
    bench client wait on state a server reports. Raises ``TimeoutError`` naming ``what`` (a hang guard, not a
    performance bound)."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(step_s)
    return value


class Subprocess:
    """A child in its own session (so the whole tree can be signalled), output to ``log``."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def wait_http(url: str, proc: Subprocess, timeout_s: float) -> None:
    """Until ``url`` answers 200; raises ``RuntimeError`` (with the log's tail) if the process exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.proc.returncode}):\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if http_client().get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout_s:.0f}s:\n{proc.tail()}")


def read_properties(model_dir: Path) -> dict[str, str]:
    """The ``serving.properties`` entries of a model folder, in file order ({} when it has none)."""
    path = Path(model_dir) / MODEL_PROPERTIES
    if not path.is_file():
        return {}
    return {e.key: e.value for e in parse_properties(path.read_text(encoding="utf-8"), str(path))}


class ServerAddresses:
    """A local server's addresses (from its ports file) and management header (from its key file)."""

    ports: dict[str, int]
    tokens: dict[str, str]
    host = "127.0.0.1"  # where the ports listen (a test may run a server in a network namespace of its own)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.ports['inference']}"

    @property
    def mgmt(self) -> str:
        return f"http://{self.host}:{self.ports['management']}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def mgmt_headers(self) -> dict[str, str]:
        """``Authorization`` for the management API (empty when the server wrote no key file)."""
        return {"Authorization": f"Bearer {self.tokens['management']}"} if "management" in self.tokens else {}


class LocalServer(ServerAddresses):
    """One model folder served by a private rollserve process (``start``); ``stop`` ends it."""

    def __init__(self, proc: Subprocess, workdir: Path, name: str, ports: dict[str, int],
                 tokens: dict[str, str]) -> None:
        self.proc = proc
        self.workdir = workdir
        self.name = name
        self.ports = ports
        self.tokens = tokens

    @classmethod
    def start(cls, model_dir: Path, workdir: Path, *, name: str | None = None,
              properties: Mapping[str, str | None] | None = None, folder_properties: bool = True,
              env: dict[str, str] | None = None, server_config: dict[str, str] | None = None,
              timeout_s: float = 600.0, spawn: Callable[..., Subprocess] = Subprocess) -> LocalServer:
        """Serve ``model_dir`` as ``name`` with its serving.properties updated by ``properties`` (a value of
        None removes a key; ``folder_properties=False``: only ``properties``). ``spawn(args, env, log, cwd)``
        starts the process. Waits until the model is READY; raises ``RuntimeError`` with the log's tail."""
        model_dir = Path(model_dir).resolve()
        name = name or model_dir.name
        workdir = Path(workdir)
        store = workdir / "model_store"
        mdir = store / name
        mdir.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            link = mdir / f.name
            if f.name != MODEL_PROPERTIES and not link.exists():
                os.symlink(f, link)
        props = read_properties(model_dir) if folder_properties else {}
        for k, v in (properties or {}).items():
            if v is None:
                props.pop(k, None)
            else:
                props[k] = v
        (mdir / MODEL_PROPERTIES).write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
               "grpc_address": "127.0.0.1:0", "model_store": str(store), "drain_timeout": "10",
               "key_file": str(workdir / "key_file.json"), **(server_config or {})}
        (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
        ports_file = workdir / "ports.json"
        ports_file.unlink(missing_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = spawn([sys.executable, "-m", "serving", "--config", str(workdir / "config.properties"),
                           "--ports-file", str(ports_file)], full_env, workdir / "server.log", workdir)
        try:
            deadline = time.monotonic() + timeout_s
            while not ports_file.exists():
                if proc.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"rollserve did not start:\n{proc.tail()}")
                time.sleep(0.1)
            ports = json.loads(ports_file.read_text())
            tokens = read_tokens(Path(cfg["key_file"]))
            server = cls(proc, workdir, name, ports, tokens)
            server.wait_ready(deadline)
        except BaseException:
            proc.stop()
            raise
        return server

    def wait_ready(self, deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            if self.proc.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.proc.returncode}):\n{self.proc.tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ping = http_client().get(self.url + "/ping", timeout=5)
                if ping.status_code == 200:
                    return
                if ping.json().get("models", {}).get(self.name) == "FAILED":
                    raise RuntimeError(f"model {self.name} FAILED:\n{self.proc.tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"model {self.name} not ready in time:\n{self.proc.tail()}")

    def describe(self) -> dict[str, Any]:
        """The model object of ``GET /models/{name}`` on the management API (``serving.frontends.http.djl``)."""
        from serving.frontends.http.djl import model_entry

        resp = http_client().get(f"{self.mgmt}/models/{self.name}", headers=self.mgmt_headers, timeout=30)
        resp.raise_for_status()
        return model_entry(resp.json())

    def put(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """``PUT /models/{name}?knob=value...``: changes the live model. Raises ``RuntimeError`` with the
        server's answer when it refuses."""
        resp = http_client().put(f"{self.mgmt}/models/{self.name}", params={k: str(v) for k, v in knobs.items()},
                         headers=self.mgmt_headers, timeout=120)
        if resp.status_code != 200:
            raise RuntimeError(f"PUT /models/{self.name} {knobs} -> HTTP {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json())

    def stop(self) -> None:
        self.proc.stop()


def read_tokens(key_file: Path) -> dict[str, str]:
    """``{"management": ..., "inference": ...}`` from a server's key file ({} when there is none)."""
    if not key_file.exists():
        return {}
    data = json.loads(key_file.read_text())
    return {scope: data[scope]["key"] for scope in ("management", "inference") if scope in data}
