"""Open-loop load: every request is sent at its scheduled arrival time, whatever the others are doing.

APIs: ``lmi`` (``POST /predictions/{model}``, text prompt; streamed as jsonlines, one line per token),
``openai`` (``POST /v1/completions``, token-id prompt, SSE), ``grpc`` (``rollserve.v1.Generation``:
``GenerateStream``, one message per token, or ``Generate``; token-id prompt). Every request asks for exactly
``max_new_tokens`` with ``ignore_eos``. A whole (non-streamed) answer records its tokens at the moment it
arrived. Errors are recorded on the request, never raised: a benchmark reports failures.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.bench.run_metrics import Rec
from serving.bench.workload import BenchRequest


@dataclass(frozen=True)
class Target:
    """Where the load goes: HTTP base URL, model name, gRPC address (``grpc`` API), the inference token."""

    url: str
    model: str
    grpc: str | None = None
    token: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


async def sleep_until(t: float) -> None:
    d = t - time.perf_counter()
    if d > 0:
        await asyncio.sleep(d)


def _lmi_line(line: str, rec: Rec, t: float) -> bool:
    """One jsonlines object of an LMI stream: a token, or the last object (finish reason). True: stream over."""
    if not line.strip():
        return False
    obj = json.loads(line)
    tok = obj.get("token")
    if tok is not None and tok.get("id", -1) >= 0:
        rec.token_times.append(t)
    elif tok is None and not rec.token_times and "generated_tokens" in (obj.get("details") or {}):
        # a whole answer to a streamed request (a dynamic-batching model has no tokens to stream): all at once
        rec.n_out = int(obj["details"]["generated_tokens"])
        rec.token_times.append(t)
    if obj.get("generated_text") is not None and (obj.get("details") or {}).get("finish_reason") == "error":
        rec.error = "stream ended with error"
    return False


def _openai_line(line: str, rec: Rec, t: float) -> bool:
    """One SSE line of an OpenAI completion stream: a chunk (a token), the usage chunk, or ``[DONE]``."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    obj = json.loads(data)
    if obj.get("choices"):
        rec.token_times.append(t)
    if obj.get("usage"):
        rec.n_out = obj["usage"]["completion_tokens"]
    return False


async def _http(client: Any, url: str, body: dict[str, Any], headers: dict[str, str], rec: Rec, stream: bool,
                count: Callable[[Any], int], line: Callable[[str, Rec, float], bool]) -> None:
    """POST ``body`` at ``rec.send``: a whole answer (``count`` reads its output tokens from the JSON) or a
    stream read line by line (``line`` records each and says when it is over)."""
    await sleep_until(rec.send)
    try:
        if not stream:
            resp = await client.post(url, json=body, headers=headers)
            t = time.perf_counter()
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.text[:200]!r}"
                return
            rec.n_out = count(resp.json())
            rec.token_times.append(t)
            rec.end = t
            return
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for text in resp.aiter_lines():
                if line(text, rec, time.perf_counter()):
                    break
            rec.end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        rec.error = f"{type(exc).__name__}: {exc}"


async def lmi(client: Any, target: Target, req: BenchRequest, rec: Rec, stream: bool) -> None:
    body = {"inputs": req.prompt, "stream": stream,
            "parameters": {"max_new_tokens": req.max_new_tokens, "ignore_eos": True, "details": True}}
    await _http(client, f"{target.url}/predictions/{target.model}", body, target.headers, rec, stream,
                lambda obj: int(obj["details"]["generated_tokens"]), _lmi_line)


async def openai(client: Any, target: Target, req: BenchRequest, rec: Rec, stream: bool) -> None:
    body: dict[str, Any] = {"model": target.model, "prompt": list(req.prompt_token_ids),
                            "max_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    await _http(client, f"{target.url}/v1/completions", body, target.headers, rec, stream,
                lambda obj: int(obj["usage"]["completion_tokens"]), _openai_line)


async def grpc_typed(stub: Any, target: Target, req: BenchRequest, rec: Rec, stream: bool) -> None:
    import grpc

    from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb

    msg = pb.GenerateRequest(model=target.model, prompt_token_ids=list(req.prompt_token_ids),
                             parameters=pb.SamplingParameters(max_new_tokens=req.max_new_tokens, ignore_eos=True))
    metadata = (("authorization", f"Bearer {target.token}"),) if target.token else ()
    await sleep_until(rec.send)
    try:
        if not stream:
            answer = await stub.Generate(msg, metadata=metadata)
            t = time.perf_counter()
            rec.n_out = len(answer.tokens)
            rec.token_times.append(t)
            rec.end = t
            if answer.finish_reason == pb.FINISH_REASON_ERROR:
                rec.error = "answer finished with error"
            return
        async for part in stub.GenerateStream(msg, metadata=metadata):
            t = time.perf_counter()
            if part.HasField("token"):
                rec.token_times.append(t)
            if part.finish_reason == pb.FINISH_REASON_ERROR:
                rec.error = "stream ended with error"
        rec.end = time.perf_counter()
    except grpc.aio.AioRpcError as exc:
        rec.error = f"gRPC {exc.code().name}: {exc.details()}"
    except Exception as exc:  # noqa: BLE001
        rec.error = f"{type(exc).__name__}: {exc}"


ABORTED = "aborted: the run stopped early"


def run_requests(api: str, target: Target, requests: list[BenchRequest] | tuple[BenchRequest, ...],
                 arrivals: list[float], stream: bool, on_done: Callable[[Rec], None] | None = None,
                 timeout_s: float = 1800.0, should_abort: Callable[[list[Rec], float], bool] | None = None
                 ) -> list[Rec]:
    """Send ``requests`` at ``arrivals`` (offsets in seconds from now) over ``api``; one ``Rec`` each.

    ``should_abort(recs, now)`` (polled every 0.1 s) ends the run early: requests still open are cancelled
    (their connections close, so the server aborts them) and get the error ``ABORTED``."""
    import httpx

    async def one(fn: Any, conn: Any, req: BenchRequest, rec: Rec) -> None:
        await fn(conn, target, req, rec, stream)
        if on_done is not None:
            on_done(rec)

    async def watch(recs: list[Rec], tasks: list[asyncio.Task[None]]) -> None:
        assert should_abort is not None
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.1)
            if should_abort(recs, time.perf_counter()):
                for t in tasks:
                    t.cancel()
                return

    async def gather(fn: Any, conn: Any, recs: list[Rec]) -> None:
        tasks = [asyncio.create_task(one(fn, conn, r, rec)) for r, rec in zip(requests, recs, strict=True)]
        watcher = asyncio.create_task(watch(recs, tasks)) if should_abort is not None else None
        await asyncio.gather(*tasks, return_exceptions=True)
        if watcher is not None:
            watcher.cancel()
        for t, rec in zip(tasks, recs, strict=True):
            if t.cancelled():
                rec.error = rec.error or ABORTED

    async def main() -> list[Rec]:
        t0 = time.perf_counter() + 0.05
        recs = [Rec(t0 + a) for a in arrivals]
        if api == "grpc":
            import grpc

            from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc

            if not target.grpc:
                raise ValueError("the grpc API needs the server's gRPC address")
            async with grpc.aio.insecure_channel(target.grpc) as channel:
                await gather(grpc_typed, generate_pb2_grpc.GenerationStub(channel), recs)
            return recs
        limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            await gather(lmi if api == "lmi" else openai, client, recs)
        return recs

    return asyncio.run(main())
