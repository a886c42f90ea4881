"""Prompt work off the event loop: long prompts are parsed and tokenized on the tokenize pool.

Design note: a model's tokenizer and chat template live with its endpoint (``serving.models.model_text``);
this module only decides where the work runs, so that ``/ping`` and every stream keep flowing while a long
prompt is tokenized.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

INLINE_WORK_BYTES = 4096  # bodies up to this size are tokenized on the event loop (cheaper than a thread hop)
T = TypeVar("T")


async def off_loop(pool: Executor | None, size_bytes: int, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (prompt parsing and tokenization) on ``pool`` unless the body is small, so that long
    prompts never stall the event loop (``/ping`` and every stream keep flowing). The composition root's
    pool has one thread fewer than the CPUs, so tokenization cannot take every core from the loop."""
    if size_bytes <= INLINE_WORK_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
