"""The built-in rolling-batch handler: serves any transformers decoder-only model with ``LLMEngine``.

Design note: a thin adapter from the ``RollingHandler`` API (``Input`` in, ``TokenDelta`` out) to the
engine; tokenization of text prompts happens here, everything else in ``handlers.engine``. Runs in the
backend worker process, on its engine thread.
"""

from __future__ import annotations

from typing import Any

from handlers.base import Context, Input, RollingHandler
from handlers.engine.engine import LLMEngine
from serving.errors import InvalidRequest
from serving.types import TokenDelta


class HuggingFaceRollingHandler(RollingHandler):
    """Continuous batching over a Hugging Face model directory (``ctx.model_dir``)."""

    def __init__(self) -> None:
        self._engine: LLMEngine | None = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("initialize() has not been called")
        return self._engine

    def initialize(self, ctx: Context) -> None:
        """Load model and tokenizer and preallocate the KV cache; ``ctx.properties`` are the options."""
        self._engine = LLMEngine.from_options(ctx.model_dir, ctx.properties)

    def add(self, request: Input) -> None:
        """Tokenize (unless token ids were given) and queue. Raises ``InvalidRequest`` for an empty prompt
        or one that can never fit."""
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        else:
            ids = list(self.engine.tokenizer(request.prompt)["input_ids"]) if request.prompt else []
        if not ids:
            raise InvalidRequest("the prompt is empty")
        self.engine.add(request.request_id, ids, request.params)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self._engine is not None and self._engine.has_work()

    def step(self) -> list[TokenDelta]:
        return self.engine.step()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        tok = engine.tokenizer
        eos = sorted(engine.eos_token_ids)
        return {
            "max_model_len": engine.max_model_len,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "chat_template": getattr(tok, "chat_template", None) if isinstance(
                getattr(tok, "chat_template", None), str) else None,
            "vocab_size": int(getattr(engine.model.config, "vocab_size", len(tok))),
            "block_size": engine.config.block_size,
            "num_blocks": engine.scheduler.allocator.num_blocks,
        }
