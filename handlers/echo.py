"""EchoHandler: a model-free dynamic-batching handler for tests and smoke checks.

Design note: it imports no torch, so batching, IPC and frontend tests can run a real worker in a fraction
of a second. Whitespace words stand in for tokens. ``echo_delay_ms`` makes each batch take a known time
(for batching-timing tests); ``echo_fail_on`` makes chosen items fail while their batch-mates succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from handlers.base import Context, Handler, Input, Output
from rollcore.options import option_value
from rollcore.types import FinishReason, TokenInfo

log = logging.getLogger(__name__)


class EchoHandler(Handler):
    """Answers each input with its own prompt (or its raw ``payload`` when the prompt is empty).

    Runs in the worker process. Options: ``echo_delay_ms`` (sleep once per batch, default 0) and
    ``echo_fail_on`` (an item whose prompt contains this string fails with a handler error).
    """

    def __init__(self) -> None:
        self.delay_ms = 0.0
        self.fail_on: str | None = None

    def initialize(self, ctx: Context) -> None:
        self.delay_ms = option_value(ctx.properties, "echo_delay_ms")  # a number >= 0 (rollcore.options)
        self.fail_on = option_value(ctx.properties, "echo_fail_on") or None

    def handle(self, inputs: Sequence[Input]) -> list[Output]:
        if self.delay_ms > 0:
            time.sleep(self.delay_ms / 1000.0)
        return [self._echo(item) for item in inputs]

    def _echo(self, item: Input) -> Output:
        if self.fail_on is not None and self.fail_on in item.prompt:
            return Output.failure(item.request_id, f"echo_fail_on matched {self.fail_on!r}")
        if not item.prompt:
            return Output(request_id=item.request_id, payload=item.payload)
        words = item.prompt.split()
        tokens = tuple(TokenInfo(id=i, text=w) for i, w in enumerate(words))
        return Output(request_id=item.request_id, text=item.prompt, finish_reason=FinishReason.LENGTH,
                      tokens=tokens, prompt_tokens=len(words))

    def describe(self) -> dict[str, Any]:
        return {"max_model_len": 100000}
