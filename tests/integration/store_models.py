"""Helpers of the model-store tests (watched store, reload, versions): two tiny random models that answer
differently, folder copies, weight swaps, a load generator of whole and streamed LMI requests, and the server's
reported state of a model."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from serving.bench.launch import http_client
from tests.integration.harness import ServerProcess

# a small rolling-engine model that loads fast: no prepacked weights, short sequences, one thread
TINY = {"option.rolling_batch": "auto", "option.dtype": "fp32", "option.num_threads": "1", "minWorkers": "1",
        "maxWorkers": "1", "option.prepack_weights": "false", "option.max_model_len": "2048",
        "option.max_rolling_batch_prefill_tokens": "256", "option.max_rolling_batch_size": "16"}
ECHO = {"option.entryPoint": "echo"}
PROMPT = "The quick brown fox"
NEW_TOKENS = 8
STREAM_TOKENS = 24  # streams run longer than whole answers: most requests in flight at any moment are streams


def build_pair(root: Path) -> tuple[Path, Path]:
    """Two tiny Llamas of one shape and tokenizer, different weights (seeds 0 and 1)."""
    from handlers.synthetic_model import build_model

    a = build_model(root / "a", size="tiny", seed=0)
    b = build_model(root / "b", size="tiny", seed=1)
    shutil.copy(a / "tokenizer.json", b / "tokenizer.json")  # one tokenizer: only the weights differ
    return a, b


def copy_model(src: Path, dest: Path, properties: dict[str, str]) -> Path:
    """A real copy of ``src``'s files (no links) into ``dest`` with a ``serving.properties``."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "serving.properties":
            shutil.copyfile(f, dest / f.name)
    (dest / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    return dest


def swap_weights(folder: Path, src: Path) -> None:
    """Replace ``folder``'s weights by ``src``'s in one rename (workers that mapped the old file keep it)."""
    tmp = folder / ".model.safetensors.partial"
    shutil.copyfile(src / "model.safetensors", tmp)
    os.replace(tmp, folder / "model.safetensors")


def state(server: ServerProcess, model: str) -> str | None:
    """The model's state as the server reports it (``GET /models/{model}``), None while it is not registered."""
    r = http_client().get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=10)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return str(r.json()[0]["models"][0]["state"])


def greedy(server: ServerProcess, route: str, prompt: str = PROMPT) -> list[int]:
    """Greedy token ids of ``prompt`` from ``POST {route}`` (LMI with details)."""
    r = httpx.post(server.url + route, json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS,
                                                                              "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


@dataclass
class Outcome:
    ok: bool
    stream: bool
    started: float
    ended: float
    tokens: list[int]
    error: str = ""


async def _one(client: httpx.AsyncClient, url: str, stream: bool) -> Outcome:
    """A whole answer of ``NEW_TOKENS`` tokens, or a stream of ``STREAM_TOKENS``."""
    n = STREAM_TOKENS if stream else NEW_TOKENS
    body: dict[str, Any] = {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True}}
    started = time.monotonic()
    try:
        if not stream:
            r = await client.post(url, json=body)
            ok = r.status_code == 200
            tokens = [t["id"] for t in r.json()["details"]["tokens"]] if ok else []
            return Outcome(ok, False, started, time.monotonic(), tokens, "" if ok else r.text)
        lines: list[dict[str, Any]] = []
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return Outcome(False, True, started, time.monotonic(), [], (await r.aread()).decode())
            async for line in r.aiter_lines():
                if line.strip():
                    lines.append(json.loads(line))
        ok = bool(lines) and all("error" not in x for x in lines) and lines[-1].get("generated_text") is not None
        tokens = [x["token"]["id"] for x in lines if x.get("token")]
        return Outcome(ok, True, started, time.monotonic(), tokens, "" if ok else json.dumps(lines[-1:]))
    except httpx.HTTPError as exc:
        return Outcome(False, stream, started, time.monotonic(), [], repr(exc))


class Load(threading.Thread):
    """Requests to ``url`` (every other one a stream), ``concurrency`` at a time, until ``finish()`` was called
    and at least ``minimum`` ended; ``outcomes`` grows as they end."""

    def __init__(self, url: str, minimum: int, concurrency: int) -> None:
        super().__init__(daemon=True)
        self.url, self.minimum, self.concurrency = url, minimum, concurrency
        self.outcomes: list[Outcome] = []
        self._stop_at: int | None = None
        self._sent = 0

    def finish(self) -> None:
        """Send two more rounds (and reach ``minimum``), then stop."""
        self._stop_at = max(self.minimum, self._sent + 2 * self.concurrency)

    def run(self) -> None:
        async def lane(client: httpx.AsyncClient) -> None:
            while self._stop_at is None or self._sent < self._stop_at:
                self._sent += 1
                self.outcomes.append(await _one(client, self.url, self._sent % 2 == 0))

        async def main() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                await asyncio.gather(*(lane(client) for _ in range(self.concurrency)))

        asyncio.run(main())
