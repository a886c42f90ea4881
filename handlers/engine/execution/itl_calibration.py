"""A few timed steps at load: what a decode step of a full batch costs here, and a first fit of the step cost.

Design note: the inter-token latency target's default (``handlers.engine.core.itl_target``, ``auto``) is a
multiple of the decode step of ``max_num_seqs`` rows, which only this machine, this model and its kernels can
tell; and until the engine has run a few steps its step fit (``step_budget.StepFit``) has nothing to price prompt
tokens with. So the engine runs, once at load, steps shaped like its own: a decode-shaped step of ``rows``
one-token sequences, one of a single row, a prompt chunk, and a mixed one, each timed ``REPEATS`` times after a
warm-up pass (once where the warm-up took ``SLOW_STEP_S``), and feeds the fastest time of each shape to the fit
twice (8 steps: the fit's minimum). The fastest,
because a busy machine only ever adds time to a step, and a noisy first fit would price prompt tokens wrongly.
The rows sit at position 0 in blocks borrowed from the allocator and given back at once (no prefix is
registered, nothing is committed), so the cache and the scheduler are as before. The real steps refit the line
online (their contexts are longer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from handlers.engine.core.kv_cache import BlockAllocator
from handlers.engine.core.schedule_plan import ScheduledChunk
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.step_budget import StepFit
from rollcore.types import SamplingParams

logger = logging.getLogger(__name__)

PROMPT_TOKENS = 64  # the timed prompt chunk: long enough that its slope shows above the step's fixed cost
REPEATS = 3
SLOW_STEP_S = 0.25  # a shape whose warm-up took this long is timed once: its noise is small beside it, and a 7B's
                    # repeats would add tens of seconds to every load


def _timed(execute: Callable[[Seq[ScheduledChunk]], torch.Tensor], chunks: Seq[ScheduledChunk]) -> float:
    t0 = time.perf_counter()
    logits = execute(chunks)
    if logits.is_cuda:  # a GPU step has ended once its logits are there
        torch.cuda.synchronize(logits.device)
    return time.perf_counter() - t0


def calibrate(execute: Callable[[Seq[ScheduledChunk]], torch.Tensor], allocator: BlockAllocator, rows: int,
              fit: StepFit, prompt_tokens: int = PROMPT_TOKENS) -> float | None:
    """Time the steps described above with ``execute`` (the runner's), record them in ``fit`` and return the
    fastest decode step of ``rows`` rows in seconds (None when the cache cannot lend the blocks)."""
    bs = allocator.block_size
    prompt_blocks = -(-prompt_tokens // bs)
    rows = min(rows, allocator.num_free_blocks - prompt_blocks)
    if rows < 1:
        return None
    params = SamplingParams(max_new_tokens=1)
    seqs = [Sequence(f"calibration-{i}", [0], params) for i in range(rows)]
    prompt = Sequence("calibration-prompt", [0] * prompt_tokens, params)
    lent: list[Sequence] = []
    try:
        for seq in seqs:
            allocator.allocate(seq.block_ids, 1)
            lent.append(seq)
        allocator.allocate(prompt.block_ids, prompt_blocks)
        lent.append(prompt)
        decode = tuple(ScheduledChunk(s, 0, 1) for s in seqs)
        half = max(1, rows // 2)
        shapes = ((decode, rows, 0), (decode[:1], 1, 0), ((ScheduledChunk(prompt, 0, prompt_tokens),), 0,
                  prompt_tokens), ((*decode[:half], ScheduledChunk(prompt, 0, prompt_tokens // 2)), half,
                                   prompt_tokens // 2))
        warm = [_timed(execute, chunks) for chunks, _, _ in shapes]  # warm-up: kernels built, buffers sized
        fastest = [min(_timed(execute, chunks) for _ in range(1 if first >= SLOW_STEP_S else REPEATS))
                   for (chunks, _, _), first in zip(shapes, warm, strict=True)]
        for _ in range(2):
            for (_, decode_rows, tokens), seconds in zip(shapes, fastest, strict=True):
                fit.record(decode_rows, tokens, seconds)
        best = fastest[0]
    finally:
        for seq in lent:
            allocator.free(seq.block_ids)
            seq.block_ids = []
    logger.info("decode step of %d rows: %.1f ms (measured at load)", rows, best * 1e3)
    return best
