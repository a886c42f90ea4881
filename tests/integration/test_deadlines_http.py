"""Deadlines through a real server, for both batchers: a request whose predicted queue wait exceeds its deadline is
refused with 503 + Retry-After, one admitted but still queued at its deadline is dropped with 504 and never reaches
the model; neither touches the request holding the model or the ones after it, and both are counted per model. The
queue is held by a request the handler never finishes on its own (a rolling stream, a dynamic batch waiting for a
file the test writes); the deadlines are set from the wait the server reports it predicts."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess
from tests.integration.hostile import error_of, lmi_body, post
from tests.integration.knob_server import metrics

ROLLING_HANDLER = '''
import time
from pathlib import Path

from handlers.base import RollingHandler
from rollcore.types import FinishReason, TokenDelta, TokenInfo

SEEN = Path(__file__).with_name("seen.txt")


class Handler(RollingHandler):
    """One token a step (a step takes 10 ms); a 'hold' prompt never finishes on its own. Every prompt it is given
    is written down."""

    def initialize(self, ctx):
        self.requests = {}

    def add(self, request):
        with SEEN.open("a") as f:
            f.write(request.prompt + "\\n")
        self.requests[request.request_id] = [request, 0]

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def has_work(self):
        return bool(self.requests)

    def stats(self):
        return {"num_running": len(self.requests), "kv_blocks_used": 0}

    def step(self):
        time.sleep(0.01)
        out = []
        for rid, entry in list(self.requests.items()):
            request, n = entry
            entry[1] = n + 1
            done = request.prompt != "hold" and entry[1] >= request.params.max_new_tokens
            out.append(TokenDelta(rid, (TokenInfo(n, f"t{n} "),), f"t{n} ", FinishReason.LENGTH if done else None,
                                  1 if n == 0 else None))
            if done:
                del self.requests[rid]
        return out
'''

DYNAMIC_HANDLER = '''
import time
from pathlib import Path

from handlers.base import Output

HERE = Path(__file__).parent


def handle(inputs):
    """Echoes each prompt after 20 ms; a batch holding 'hold' waits until the file 'release' exists. Every prompt
    it is given is written down."""
    with (HERE / "seen.txt").open("a") as f:
        f.writelines(i.prompt + "\\n" for i in inputs)
    if any(i.prompt == "hold" for i in inputs):
        while not (HERE / "release").exists():
            time.sleep(0.01)
    else:
        time.sleep(0.02)
    return [Output(request_id=i.request_id, text=i.prompt) for i in inputs]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("deadlines"), models={
        "roll": {"option.entryPoint": "model.py", "option.rolling_batch": "auto",
                 "option.max_rolling_batch_size": "1"},
        "dyn": {"option.entryPoint": "model.py", "batch_size": "1"},
    }, files={"roll": {"model.py": ROLLING_HANDLER}, "dyn": {"model.py": DYNAMIC_HANDLER}},
        config={"ping_requires": "all"})
    yield s
    s.stop()


def folder(server: ServerProcess, model: str) -> Path:
    return server.workdir / "model_store" / model


def seen(server: ServerProcess, model: str) -> list[str]:
    """The prompts the model's handler was given, in order."""
    path = folder(server, model) / "seen.txt"
    return path.read_text().split() if path.exists() else []


def predicted_ms(server: ServerProcess, model: str) -> float:
    wait = server.describe(model)["batcher"]["predicted_wait_ms"]
    assert isinstance(wait, (int, float)) and wait > 0, wait
    return float(wait)


def rejected(server: ServerProcess, model: str, reason: str) -> float:
    return sum(v for (name, labels), v in metrics(server).items()
               if name == "rollserve_requests_rejected_total" and ("model", model) in labels
               and ("reason", reason) in labels)


def with_timeout(ms: int, header: str = "X-Request-Timeout-Ms") -> dict[str, dict[str, str]]:
    return {"headers": {header: str(ms)}}


class HeldStream:
    """A 'hold' request streaming from the rolling model: it keeps the model's one slot until closed."""

    def __init__(self, server: ServerProcess) -> None:
        self.lines: list[str] = []
        self.closed = threading.Event()
        self._client = httpx.Client(timeout=120)
        self._thread = threading.Thread(target=self._read, args=(server,), daemon=True)
        self._thread.start()

    def _read(self, server: ServerProcess) -> None:
        body = {**lmi_body("hold", max_new_tokens=4096), "stream": True}
        with self._client.stream("POST", f"{server.url}/predictions/roll", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if self.closed.is_set():
                    return
                if line.strip():
                    self.lines.append(line)

    def close(self) -> None:
        """Stop reading at the next line (one comes every step): the response closes, the server aborts it."""
        self.closed.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        self._client.close()


def test_a_bad_deadline_header_is_a_400_naming_it(server: ServerProcess) -> None:
    for header, value in (("X-Request-Timeout-Ms", "soon"), ("X-Request-Timeout-Ms", "0"),
                          ("X-Envoy-Expected-Rq-Timeout-Ms", "1.5")):
        for model in ("roll", "dyn"):
            r = post(server, f"/predictions/{model}", lmi_body("bad-header", max_new_tokens=2),
                     headers={header: value})
            error_of(r, 400, f"header {header} must be a whole number of milliseconds")
    r = post(server, "/v2/models/roll/infer", {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1],
                                                           "data": ["bad-timeout"]}], "parameters": {"timeout": -1}})
    assert r.status_code == 400 and "'parameters.timeout' must be a whole number of microseconds" in r.text, r.text
    assert seen(server, "roll") == seen(server, "dyn") == []  # refused before reaching a worker


def test_rolling_refuses_with_503_and_drops_a_queued_request_at_its_deadline_with_504(server: ServerProcess) -> None:
    assert post(server, "/predictions/roll", lmi_body("warm", max_new_tokens=3)).status_code == 200  # a measured wait
    held = HeldStream(server)
    try:
        wait_for(lambda: server.describe("roll")["batcher"]["running"] == 1 and len(held.lines) >= 2,
                 "the held stream running")
        wait_ms = predicted_ms(server, "roll")
        refused = post(server, "/predictions/roll", lmi_body("refused", max_new_tokens=2),
                       **with_timeout(max(1, math.floor(wait_ms / 2)), "X-Envoy-Expected-Rq-Timeout-Ms"))
        error_of(refused, 503, "cannot start this request before its deadline")
        assert int(refused.headers["Retry-After"]) >= 1
        expired = post(server, "/predictions/roll", lmi_body("expired", max_new_tokens=2),
                       **with_timeout(math.ceil(wait_ms * 2) + 200))
        error_of(expired, 504, "deadline passed while it waited in the queue")
        tokens_then = len(held.lines)
        triton = post(server, "/v2/models/roll/infer", {
            "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["triton-late"]}],
            "parameters": {"timeout": (math.ceil(wait_ms * 2) + 200) * 1000, "max_new_tokens": 2}})
        assert triton.status_code == 504 and "never reached a worker" in triton.json()["error"], triton.text
        wait_for(lambda: len(held.lines) > tokens_then, "the held stream still streaming")
        assert server.describe("roll")["batcher"]["waiting"] == 0
    finally:
        held.close()
    after = post(server, "/predictions/roll", lmi_body("after", max_new_tokens=2))
    assert after.status_code == 200 and after.json()["generated_text"] == "t0 t1 ", after.text
    assert seen(server, "roll") == ["warm", "hold", "after"]  # neither the refused nor the expired one ran
    assert rejected(server, "roll", "deadline_refused") == 1
    assert rejected(server, "roll", "deadline_expired") == 2
    assert rejected(server, "roll", "timeout") == 0


def test_dynamic_refuses_with_503_and_drops_a_queued_request_at_its_deadline_with_504(server: ServerProcess) -> None:
    assert post(server, "/predictions/dyn", {"inputs": "warm"}).status_code == 200  # a measured batch time
    release = folder(server, "dyn") / "release"
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, server, "/predictions/dyn", {"inputs": "hold"})
        try:
            wait_for(lambda: server.describe("dyn")["batcher"]["in_flight_batches"] == 1, "the held batch running")
            wait_ms = predicted_ms(server, "dyn")
            refused = post(server, "/predictions/dyn", {"inputs": "refused"},
                           **with_timeout(max(1, math.floor(wait_ms / 2))))
            error_of(refused, 503, "cannot start this request before its deadline")
            assert int(refused.headers["Retry-After"]) >= 1
            expired = post(server, "/predictions/dyn", {"inputs": "expired"},
                           **with_timeout(math.ceil(wait_ms * 2) + 200, "X-Envoy-Expected-Rq-Timeout-Ms"))
            error_of(expired, 504, "deadline passed while it waited in the queue")
            assert not held.done()
        finally:
            release.write_text("go")
        answer = held.result()
    assert answer.status_code == 200 and _text(answer.json()) == "hold", answer.text
    after = post(server, "/predictions/dyn", {"inputs": "after"})
    assert after.status_code == 200 and _text(after.json()) == "after", after.text
    assert seen(server, "dyn") == ["warm", "hold", "after"]
    assert rejected(server, "dyn", "deadline_refused") == 1
    assert rejected(server, "dyn", "deadline_expired") == 1


def _text(body: Any) -> str:
    """The generated text of a dynamic model's LMI answer (an object, or a list of one)."""
    one = body[0] if isinstance(body, list) else body
    return str(one.get("generated_text", json.dumps(one)))
