"""ResultStream: the per-request channel from a batcher back to a frontend.

Design note: a batcher pushes ``TokenDelta``s (rolling) or one whole output (dynamic) into the stream; a
frontend either iterates the deltas (streaming) or awaits ``collect()`` (whole answer). The stream also
records the request's timings on the frontend's monotonic clock. Runs on the event loop only.

A batcher may ``restart`` a stream whose worker died while nothing of it reached the client (``delivered`` is
False: no delta was handed to a streaming consumer; a whole answer is only assembled at the end): what the dead
worker produced is dropped and the retry's deltas replace it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollcore.errors import Cancelled, ServingError
from rollcore.types import FinishReason, GenerationResult, RequestTimings, TokenDelta, TokenInfo

log = logging.getLogger(__name__)

_END = object()
_RESTART = object()  # a whole answer being collected starts over (the dead worker's deltas are dropped)


class ResultStream:
    """Deltas of one request, in order; ends after the delta carrying ``finish_reason`` or an error."""

    def __init__(self, request_id: str, clock: Callable[[], float] = time.monotonic,
                 on_cancel: Callable[[str], object] | None = None,
                 on_finish: Callable[[ResultStream], None] | None = None) -> None:
        """``on_finish`` is called once when the stream ends (success, error or cancel): metrics."""
        self.request_id = request_id
        self._clock = clock
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._on_cancel = on_cancel
        self._on_finish = on_finish
        self.arrival = clock()
        self.dispatched: float | None = None
        self.first_token: float | None = None
        self.finished: float | None = None
        self.last_token: float | None = None
        self.token_gaps_s: list[float] = []  # gap before each token-bearing delta after the first (ITL)
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of prompt_tokens, those the engine's prefix cache served
        self.prompt_logprobs: tuple[TokenInfo, ...] | None = None
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.error: ServingError | None = None
        self.payload: Any = None
        self.embedding: tuple[float, ...] | None = None  # an embedding request's vector (its one delta carries it)
        self._done = False
        self._finish_callbacks: list[Callable[[ResultStream], None]] = []
        self.num_retries = 0
        self._handed = 0  # deltas handed to a streaming consumer: their bytes may have reached the client
        self.worker_id: int | None = None  # the worker serving it (set by the batcher; a retry moves it)

    # --- producer side (batchers) ---
    @property
    def done(self) -> bool:
        return self._done

    @property
    def delivered(self) -> bool:
        """True once a delta went to a streaming consumer (what the client may have seen cannot be taken back)."""
        return self._handed > 0

    def restart(self) -> None:
        """Forget the deltas produced so far (the request runs again elsewhere); only while not ``delivered``."""
        if self._done or self.delivered:
            raise RuntimeError(f"request {self.request_id}: a stream that ended or reached its client cannot restart")
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_RESTART)  # for a collect() that already took some deltas
        self.first_token = self.last_token = None
        self.token_gaps_s = []
        self.num_tokens = self.prompt_tokens = self.cached_tokens = 0
        self.prompt_logprobs = None
        self.embedding = None

    def add_finish_callback(self, callback: Callable[[ResultStream], None]) -> None:
        """Call ``callback(self)`` once when the stream ends (at once if it already has)."""
        if self._done:
            callback(self)
        else:
            self._finish_callbacks.append(callback)

    def mark_dispatched(self) -> None:
        if self.dispatched is None:
            self.dispatched = self._clock()

    def push(self, delta: TokenDelta) -> None:
        if self._done:
            return
        now = self._clock()
        self.mark_dispatched()
        if delta.prompt_tokens is not None:
            self.prompt_tokens = delta.prompt_tokens
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.tokens:
            if self.first_token is None:
                self.first_token = now
            if self.last_token is not None:
                self.token_gaps_s.append(now - self.last_token)
            self.last_token = now
        self.num_tokens += len(delta.tokens)
        self._queue.put_nowait(delta)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self._finish(now)

    def set_payload(self, payload: Any) -> None:
        self.payload = payload

    def fail(self, error: ServingError) -> None:
        if self._done:
            return
        self.error = error
        self._queue.put_nowait(error)
        self._finish(self._clock())

    def _finish(self, now: float) -> None:
        self._done = True
        self.finished = now
        if self.first_token is None:
            self.first_token = now
        self._queue.put_nowait(_END)
        callbacks, self._finish_callbacks = self._finish_callbacks, []
        if self._on_finish is not None:
            callbacks.insert(0, self._on_finish)
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # an observer bug must never break the request
                log.exception("request %s: finish observer failed", self.request_id)

    # --- consumer side (frontends) ---
    def cancel(self) -> None:
        """The client went away: tell the batcher (abort/dequeue) and end the stream."""
        if self._done:
            return
        self.fail(Cancelled("request cancelled by the client"))
        if self._on_cancel is not None:
            self._on_cancel(self.request_id)

    async def _items(self) -> AsyncIterator[Any]:
        """Deltas and ``_RESTART`` markers until the end; raises the request's ServingError."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, ServingError):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        async for item in self._items():
            if item is not _RESTART:  # nothing was handed out before a restart (see ``restart``)
                self._handed += 1
                yield item

    async def collect(self) -> GenerationResult:
        """Wait for the end and assemble the whole answer; raises the request's ServingError."""
        tokens: list[TokenInfo] = []
        parts: list[str] = []
        async for delta in self._items():
            if delta is _RESTART:
                tokens.clear()
                parts.clear()
                continue
            tokens.extend(delta.tokens)
            parts.append(delta.text)
        return GenerationResult(request_id=self.request_id, text="".join(parts),
                                finish_reason=self.finish_reason or FinishReason.LENGTH, tokens=tuple(tokens),
                                prompt_tokens=self.prompt_tokens, timings=self.timings(), payload=self.payload,
                                prompt_logprobs=self.prompt_logprobs, cached_tokens=self.cached_tokens)

    def timings(self) -> RequestTimings:
        end = self.finished if self.finished is not None else self._clock()
        dispatched = self.dispatched if self.dispatched is not None else end
        first = self.first_token if self.first_token is not None else end
        return RequestTimings(queue_s=dispatched - self.arrival, ttft_s=first - self.arrival,
                              prefill_s=first - dispatched, decode_s=end - first, e2e_s=end - self.arrival,
                              prompt_tokens=self.prompt_tokens, generated_tokens=self.num_tokens,
                              worker_id=self.worker_id, max_itl_s=max(self.token_gaps_s, default=0.0))
