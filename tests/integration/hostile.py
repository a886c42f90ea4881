"""Helpers for the "one request must never break a model" tests: a neighbour request that runs while the
hostile one arrives, twelve requests afterwards, and the slot/KV-block accounting from engine stats.

The server (``hostile_server`` in conftest) serves ``dyn`` (the default model, dynamic batching),
``roll`` (the same weights, rolling batching), ``custom`` (a custom dynamic handler that echoes its raw
payload), ``poison`` (a custom rolling handler whose step raises for a ``boom`` prompt and for ever after a
``wedge`` prompt), ``slowecho`` (echo, 150 ms a batch of one) and ``broken`` (fails to load, naming its
own absolute path); readiness is ``ping_requires=any``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.integration.harness import ServerProcess

PROMPT = "Once upon a time"

POISON_HANDLER = '''
import time

from handlers.base import RollingHandler
from rollcore.types import FinishReason, TokenDelta, TokenInfo


class Handler(RollingHandler):
    """One token per step; a 'boom' prompt makes the steps it joins raise; 'wedge' breaks every later step."""

    def initialize(self, ctx):
        self.requests = {}
        self.wedged = False

    def add(self, request):
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def has_work(self):
        return bool(self.requests)

    def stats(self):
        return {"num_running": len(self.requests), "kv_blocks_used": 0}

    def step(self):
        time.sleep(0.01)
        prompts = [r.prompt for r, _ in self.requests.values()]
        if self.wedged or "wedge" in prompts:
            self.wedged = True
            raise RuntimeError("engine wedged in /opt/secret/site-packages/engine.py")
        if "boom" in prompts:
            raise ValueError("kernel failed in /opt/secret/site-packages/kernels.py")
        out = []
        for rid, entry in list(self.requests.items()):
            request, n = entry
            entry[1] = n + 1
            done = entry[1] >= request.params.max_new_tokens
            out.append(TokenDelta(rid, (TokenInfo(n, f"t{n} "),), f"t{n} ", FinishReason.LENGTH if done else None,
                                  1 if n == 0 else None))
            if done:
                del self.requests[rid]
        return out
'''

CUSTOM_HANDLER = '''
from handlers.base import Output
from rollcore.types import TokenInfo


def handle(inputs):
    out = []
    for i in inputs:
        if i.prompt == "malformed":  # a handler bug: a token id that is not an integer
            out.append(Output(request_id=i.request_id, text="x", tokens=(TokenInfo("not-an-id", "x"),)))
        elif i.prompt == "raise":
            raise OSError("cannot open /opt/secret/weights/shard-3.bin")
        else:
            out.append(Output(request_id=i.request_id, payload={"echo": i.payload}))
    return out
'''

BROKEN_HANDLER = '''
from pathlib import Path


def initialize(ctx):
    raise FileNotFoundError(f"missing {Path(__file__).resolve().parent / 'weights' / 'model.bin'}")


def handle(inputs):
    return []
'''


def post(server: ServerProcess, path: str, body: Any, timeout: float = 120.0, **kw: Any) -> httpx.Response:
    """POST ``body`` as ASCII JSON (lone surrogates travel as ``\\ud800`` escapes, as a hostile client sends)."""
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=timeout, **kw)


def lmi_body(prompt: str = PROMPT, max_new_tokens: int = 8, **params: Any) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **params}}


class Neighbour:
    """A well-formed request on ``model`` running while the hostile one arrives: a token stream for a rolling
    model (``running`` is set at its first token), a whole answer for a dynamic one."""

    def __init__(self, server: ServerProcess, model: str, stream: bool, max_new_tokens: int = 48) -> None:
        self.server, self.model, self.stream = server, model, stream
        self.max_new_tokens = max_new_tokens
        self.running = threading.Event()
        self.tokens: list[Any] = []
        self.final: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Neighbour:
        self.thread.start()
        if self.stream:
            assert self.running.wait(120), f"the neighbour stream never started: {self.error!r}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.thread.join(180)

    def _run(self) -> None:
        body = {**lmi_body(max_new_tokens=self.max_new_tokens), "stream": self.stream}
        try:
            if not self.stream:
                self.running.set()
                r = post(self.server, f"/predictions/{self.model}", body)
                assert r.status_code == 200, r.text
                self.final = r.json()
                return
            with httpx.stream("POST", f"{self.server.url}/predictions/{self.model}", json=body, timeout=180) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.strip():
                        obj = json.loads(line)
                        self.tokens.append(obj)
                        self.running.set()
                        if obj.get("generated_text") is not None or obj.get("error"):
                            self.final = obj
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc
            self.running.set()

    def check(self) -> None:
        """The neighbour finished normally: every token, a length finish, no error."""
        assert not self.thread.is_alive(), "the neighbour request never finished"
        assert self.error is None, repr(self.error)
        if self.stream:
            assert "error" not in self.final, self.final
            assert self.final["details"]["finish_reason"] == "length", self.final
            assert len(self.tokens) == self.max_new_tokens
        else:
            assert self.final and "error" not in self.final, self.final
            if self.model != "custom":
                assert self.final.get("generated_text") is not None, self.final


def twelve_afterwards(server: ServerProcess, model: str, check: Callable[[httpx.Response], None] | None = None
                      ) -> None:
    """Twelve well-formed requests (four at a time) all succeed."""
    def one(i: int) -> httpx.Response:
        return post(server, f"/predictions/{model}", lmi_body(f"{PROMPT} {i}", max_new_tokens=4), timeout=120)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, range(12)))
    for r in responses:
        assert r.status_code == 200, r.text
        if check is not None:
            check(r)


def assert_no_leaks(server: ServerProcess, model: str, timeout_s: float = 30.0) -> None:
    """Nothing queued or running, every engine's slots and KV blocks free (rolling) or no batch in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        batcher = server.describe(model)["batcher"]
        if batcher["mode"] == "rolling":
            engines = batcher["engines"].values()
            idle = batcher["running"] == 0 and batcher["waiting"] == 0 and all(
                e.get("num_running", 0) == 0 and e.get("num_waiting", 0) == 0 and e.get("kv_blocks_used", 0) == 0
                for e in engines)
        else:
            idle = batcher["queued"] == 0 and batcher["in_flight_batches"] == 0
        if idle:
            return
        assert time.monotonic() < deadline, f"leaked slots or blocks on {model}: {batcher}"
        time.sleep(0.1)


def error_of(r: httpx.Response, status: int, *names: str) -> str:
    """The response is ``status`` with the uniform error body naming every one of ``names``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type", "request_id"}, body
    for name in names:
        assert name in body["error"], (name, body["error"])
    return str(body["error"])
