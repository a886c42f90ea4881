"""CUDA graphs of the engine's decode steps: one captured forward per batch size, replayed with new inputs.

Design note (why: a decode step of a small batch is launch-bound on a GPU; an 8B model runs ~400 kernels a step,
each a few microseconds of Python and driver work, against a few milliseconds of memory traffic): at load the
runner captures the lean forward (``handlers.engine.execution.forward.lean``) for a ladder of batch sizes, on static
input buffers. A step whose every sequence decodes one token, and whose size fits the ladder, is padded to the next
captured size and replayed: one copy of the step's integers to the device, one graph launch. Padding rows
write their KV into a scratch block the scheduler never hands out, and read only it. Everything else (prefill
chunks, speculative guesses, families the lean forward does not cover) runs the eager forward.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from handlers.engine.execution.forward.paged_attention import DecodePlan, StepContext, StepMetadata

logger = logging.getLogger(__name__)

# Batch sizes captured (those up to max_num_seqs, plus max_num_seqs itself): every size pads by at most 1/4.
LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in LADDER if b < max_num_seqs]
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Captured decode steps of ``forward(ids [B], positions [B], keep [B]) -> logits [B, vocab]``.

    ``scratch_block`` is a KV block outside the scheduler's pool; ``max_blocks`` the longest block table."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 context: StepContext, pool: Any, kernels: Any, block_size: int, max_blocks: int,
                 scratch_block: int, sizes: Sequence[int]) -> None:
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        device = pool.device
        cap = self.sizes[-1]
        self.cap = cap
        # One int64 buffer holds ids, positions, slots and the decode plan ([cap, 4]), so a step is one copy.
        self._ints = torch.zeros(7 * cap, dtype=torch.int64, device=device)
        self._tables = torch.full((cap * max_blocks,), scratch_block, dtype=torch.int32, device=device)
        self._host_ints = torch.zeros(7 * cap, dtype=torch.int64).pin_memory()
        self._host_tables = torch.full((cap * max_blocks,), scratch_block, dtype=torch.int32).pin_memory()
        ids, positions, slots = self._ints[:cap], self._ints[cap:2 * cap], self._ints[2 * cap:3 * cap]
        plan = self._ints[3 * cap:].view(cap, 4)
        keep = self._keep = torch.arange(cap, device=device)  # held: the graphs read it at every replay
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        self._fill_padding(0)
        torch.cuda.synchronize(device)
        memory_pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
                meta = StepMetadata(pool, slots[:b], (), block_size, kernels)
                meta._plans[0] = DecodePlan(plan[:b], self._tables, ())
                context.meta = meta
                try:
                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):  # warm-up outside the graph (kernels built, workspaces set)
                        forward(ids[:b], positions[:b], keep[:b])
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=memory_pool):
                        self._outputs[b] = forward(ids[:b], positions[:b], keep[:b])
                    self._graphs[b] = graph
                finally:
                    context.meta = None
        torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
                    ",".join(map(str, self.sizes)), time.perf_counter() - started)

    def _fill_padding(self, start: int) -> None:
        """Rows from ``start`` on read and write the scratch block only (position 0)."""
        cap, h = self.cap, self._host_ints
        scratch_slot = self.scratch_block * self.block_size
        for r in range(start, cap):
            h[r] = 0
            h[cap + r] = 0
            h[2 * cap + r] = scratch_slot
            h[3 * cap + 4 * r:3 * cap + 4 * r + 4] = torch.tensor([r, 0, 1, r * self.max_blocks])
        self._ints.copy_(h)

    def fits(self, seqs: Sequence[tuple[int, int, int, list[int]]], keep: Sequence[int]) -> bool:
        """A step the graphs can run: every sequence decodes one token and samples it, rows in order."""
        return (0 < len(seqs) <= self.cap and len(keep) == len(seqs)
                and all(num_new == 1 and q0 == i and len(table) <= self.max_blocks
                        for i, (q0, _, num_new, table) in enumerate(seqs)))

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            seqs: Sequence[tuple[int, int, int, list[int]]]) -> torch.Tensor:
        """Replay the smallest graph that holds the step; returns logits [n, vocab] (valid until the next run)."""
        n = len(seqs)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        cap, mb = self.cap, self.max_blocks
        rows: list[int] = []
        tables = self._host_tables
        for i, (_, start, _, table) in enumerate(seqs):
            rows += [i, 0, start + 1, i * mb]
            tables[i * mb:i * mb + len(table)] = torch.tensor(table, dtype=torch.int32)
        # The host buffers are rewritten only here: the previous step's copy is done, since its sampled tokens were
        # read back before this step was scheduled. Padding rows may keep a previous step's ids, positions and
        # plan rows (row i stays row i; what they read is discarded), but never its slots: they write KV, so
        # they write it into the scratch block.
        h = self._host_ints
        h[2 * cap + n:3 * cap] = self.scratch_block * self.block_size
        h[:n] = torch.tensor(input_ids)
        h[cap:cap + n] = torch.tensor(positions)
        h[2 * cap:2 * cap + n] = torch.tensor(slots)
        h[3 * cap:3 * cap + 4 * n] = torch.tensor(rows)
        self._ints.copy_(h, non_blocking=True)
        self._tables[:b * mb].copy_(tables[:b * mb], non_blocking=True)
        self._graphs[b].replay()
        return self._outputs[b][:n]
