"""The server test_knobs.py changes knobs on (a rolling model, a dynamic echo, a pool of echo workers, a torch-free
rolling handler) and how its tests drive it: background load, knob changes, errors, metrics, engine stats."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ServerProcess

HANG_S = 300  # wait_for's hang guard here (a knob change under load), not a performance bound

PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5", "Once upon a time there was",
           "a", "Why is the sky blue?", "def main():", "The quick brown fox"]
LONG = 142  # the longest answer of the rolling load
ROLL = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "32", "option.max_model_len": "256",
        # no prefill cap while decodes run (by tokens, time ratio or latency target): a raised batch size admits
        # every waiting prompt at one step
        "option.max_prefill_tokens_while_decoding": "0", "option.max_mixed_step_ratio": "0", "option.max_itl_ms": "0",
        "option.predict_timeout": "900", "max_queue_time": "900"}
DYN = {"option.entryPoint": "echo", "option.echo_delay_ms": "300", "batch_size": "8",
       "max_batch_delay": "600000",  # ten minutes: a batch goes out when full, never because of the delay
       "max_queue_time": "900"}
POOL = {"option.entryPoint": "echo", "option.echo_delay_ms": "1500", "batch_size": "1", "max_batch_delay": "1"}
STEPS_HANDLER = '''
import time

from handlers.base import RollingHandler
from rollcore.types import FinishReason, TokenDelta, TokenInfo


class Handler(RollingHandler):
    """A torch-free rolling handler: one word per step, a step takes 20 ms."""

    def initialize(self, ctx):
        self.requests = {}

    def add(self, request):
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def has_work(self):
        return bool(self.requests)

    def stats(self):
        return {"num_running": len(self.requests)}

    def step(self):
        time.sleep(0.02)
        out = []
        for rid, entry in list(self.requests.items()):
            request, n = entry
            entry[1] = n + 1
            done = entry[1] >= request.params.max_new_tokens
            word = f"{request.prompt}{n} "
            out.append(TokenDelta(rid, (TokenInfo(n, word),), word, FinishReason.LENGTH if done else None,
                                  1 if n == 0 else None))
            if done:
                del self.requests[rid]
        return out
'''


def start_server(folder: Path) -> ServerProcess:
    return ServerProcess.start(folder,
                               models={"roll": ROLL, "dyn": DYN, "pool": POOL,
                                       "steps": {"option.entryPoint": "model.py", "option.rolling_batch": "auto"}},
                               files={"steps": {"model.py": STEPS_HANDLER}},
                               config={"enable_model_api": "true", "max_workers_per_model": "3",
                                       "job_queue_size": "500"},
                               env={"OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "2048"}, timeout_s=240)


class Load:
    """Requests posted concurrently from a thread of their own; ``wait()`` returns every response."""

    def __init__(self, url: str, bodies: list[dict[str, Any]]) -> None:
        self.responses: list[httpx.Response] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(url, bodies)), daemon=True)
        self._thread.start()

    async def _run(self, url: str, bodies: list[dict[str, Any]]) -> None:
        async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=200)) as client:
            self.responses = list(await asyncio.gather(*(client.post(url, json=b) for b in bodies)))

    def wait(self, timeout_s: float = 900) -> list[httpx.Response]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the load did not finish"
        return self.responses


def put(server: ServerProcess, model: str, headers: dict[str, str] | None = None, **knobs: Any) -> httpx.Response:
    return httpx.put(f"{server.mgmt}/models/{model}", params={k: str(v) for k, v in knobs.items()},
                     headers=server.mgmt_headers if headers is None else headers, timeout=120)


def error(r: httpx.Response, status: int, *named: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type", "request_id"}, body
    for text in named:
        assert text in body["error"], (text, body["error"])
    return str(body["error"])


def metrics(server: ServerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{server.mgmt}/metrics", headers=server.mgmt_headers, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def gauge(server: ServerProcess, name: str, model: str) -> float:
    """A per-model gauge, summed over the model's versions (its only other label)."""
    return sum(v for (n, labels), v in metrics(server).items()
               if n == name and ("model", model) in labels and {k for k, _ in labels} <= {"model", "version"})


def batch_buckets(server: ServerProcess, model: str) -> dict[str, float]:
    """The ``rollserve_batch_size`` histogram of ``model``: cumulative buckets by ``le``, plus count and sum."""
    out: dict[str, float] = {}
    for (name, labels), v in metrics(server).items():
        d = dict(labels)
        if d.get("model") != model:
            continue
        if name == "rollserve_batch_size_bucket":
            out[d["le"]] = v
        elif name in ("rollserve_batch_size_count", "rollserve_batch_size_sum"):
            out[name.rsplit("_", 1)[1]] = v
    return out


def running(server: ServerProcess) -> tuple[int, int]:
    """Requests running on the rolling model: (the frontend's count, the engine's)."""
    batcher, engine = roll_state(server)
    return int(batcher["running"]), int(engine.get("num_running", 0))


def roll_state(server: ServerProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the frontend's rolling batcher, the engine's stats of its one worker)."""
    batcher = server.describe("roll")["batcher"]
    engines = list(batcher["engines"].values())
    return batcher, (engines[0] if engines else {})


def greedy(prompt: str, n: int) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": n, "do_sample": False, "ignore_eos": True,
                                             "details": True}}


def check_answers(responses: list[httpx.Response], bodies: list[dict[str, Any]],
                  reference: dict[str, list[int]]) -> None:
    assert len(responses) == len(bodies)
    for r, body in zip(responses, bodies, strict=True):
        assert r.status_code == 200, r.text
        n = body["parameters"]["max_new_tokens"]
        assert [t["id"] for t in r.json()["details"]["tokens"]] == reference[body["inputs"]][:n], body


def workers(server: ServerProcess, model: str) -> list[dict[str, Any]]:
    return list(server.describe(model)["workers"])


def job(model: str, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A request that keeps a worker busy for a while (1.5 s of echo; 100 steps of 20 ms) and its answer."""
    if model == "pool":
        return {"inputs": name}, {"generated_text": name}
    return {"inputs": name, "parameters": {"max_new_tokens": 100}}, \
        {"generated_text": "".join(f"{name}{i} " for i in range(100))}
