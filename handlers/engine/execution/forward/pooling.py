"""Embedding requests in the rolling engine: the prompt's forward pass, its final hidden states pooled.

Design note: an embedding request is a ``Sequence`` with ``pooling`` set; the scheduler plans its prompt like any
other prefill (chunked, beside decodes, within the step's token budget) and never samples it. The runner keeps
the chunk's pooled rows (``ScheduledChunk.pooled_rows``) among the step's kept rows and ``HeadTap`` takes their
final-norm hidden states aside right before the LM head, which then runs on the sampled rows only: the logits the
engine samples from are exactly those of a step without the embedding rows, so generation beside embeddings is
unchanged. A step with pooled rows never replays a CUDA graph (the tap is Python). ``EmbeddingPool`` folds each
request's rows (last row, first row, or the mean over every chunk; a chunk restarting at position 0 after a
preemption starts the sum again) and answers the finished ones with their vector, L2-normalised (vLLM's embed
default) unless a sentence-transformers folder says otherwise. Mean and cls pooling compute the whole prompt: a
prefix-cached block holds KV, not hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from handlers.engine.core.schedule_plan import ScheduledChunk
from rollcore.types import FinishReason, TokenDelta

POOLINGS = ("last", "mean", "cls")


class HeadTap:
    """Hooks on the LM head: while ``pooled`` (indices into the head's input rows) is set, those rows are taken
    aside (``taken``, fp32) and the head computes the others only."""

    def __init__(self, head: nn.Module | None) -> None:
        self.pooled: list[int] = []
        self.taken: torch.Tensor | None = None
        self._others: torch.Tensor | None = None
        self.available = isinstance(head, nn.Module)  # a model without an LM head module cannot embed here
        if isinstance(head, nn.Module):
            head.register_forward_pre_hook(self._before)
            head.register_forward_hook(self._after)

    def arm(self, pooled: Sequence[int]) -> None:
        self.pooled = list(pooled)
        self.taken = None

    def disarm(self) -> None:
        self.pooled = []
        self._others = None

    def take(self) -> torch.Tensor:
        """The pooled rows' hidden states [len(pooled), hidden] of the last step, in ``pooled``'s order."""
        assert self.taken is not None, "no pooled rows were taken"
        taken, self.taken = self.taken, None
        return taken

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.pooled:
            return None
        x = args[0]  # [K, hidden] (lean forward) or [1, K, hidden] (transformers' forward)
        rows = x.shape[-2]
        pooled = torch.tensor(self.pooled, dtype=torch.long, device=x.device)
        self.taken = x.index_select(-2, pooled).reshape(len(self.pooled), -1).float()
        mask = torch.ones(rows, dtype=torch.bool, device=x.device)
        mask[pooled] = False
        others = mask.nonzero().flatten()
        self._others = others
        # a head given no row at all may fail on packed kernels built for row counts >= 1: one row, dropped after
        keep = others if others.numel() else pooled[:1]
        return (x.index_select(-2, keep), *args[1:])

    def _after(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        if not self.pooled or self._others is None or self._others.numel():
            return None
        return out[..., :0, :]


@dataclass(slots=True)
class _Pooling:
    """One embedding request's fold so far."""

    num_prompt_tokens: int
    normalize: bool
    total: torch.Tensor | None = None  # mean: the sum of the rows seen; last / cls: the row


class EmbeddingPool:
    """The engine's embedding requests: their pooled rows folded step by step into vectors."""

    def __init__(self) -> None:
        self._live: dict[str, _Pooling] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, num_prompt_tokens: int, normalize: bool = True) -> None:
        self._live[request_id] = _Pooling(num_prompt_tokens, normalize)

    def discard(self, request_id: str) -> bool:
        return self._live.pop(request_id, None) is not None

    def fold(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor | None
             ) -> list[tuple[ScheduledChunk, TokenDelta]]:
        """Fold one step's pooled rows (``hidden``: the chunks' ``pooled_rows`` in chunk order; None when the step
        has none) into their requests; returns (chunk, answer) for every request whose prompt this step completed
        (forgotten here)."""
        done = []
        row = 0
        for chunk in chunks:
            rows = chunk.pooled_rows
            state = self._live.get(chunk.seq.request_id) if chunk.seq.pooling is not None else None
            if state is None:
                row += len(rows)
                continue
            part = hidden[row:row + len(rows)] if hidden is not None else None
            row += len(rows)
            if part is None or not len(rows):
                pass
            elif chunk.seq.pooling == "mean":
                total = part.sum(0)
                # a chunk from position 0 is the prompt's first (again, after a preemption): the sum restarts
                state.total = total if chunk.start == 0 or state.total is None else state.total + total
            else:
                state.total = part[0]
            if chunk.ends_prompt:
                done.append((chunk, self._answer(chunk, state)))
        return done

    def _answer(self, chunk: ScheduledChunk, state: _Pooling) -> TokenDelta:
        seq = chunk.seq
        del self._live[seq.request_id]
        assert state.total is not None
        vector = state.total / state.num_prompt_tokens if seq.pooling == "mean" else state.total
        if state.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return TokenDelta(seq.request_id, finish_reason=FinishReason.LENGTH, prompt_tokens=state.num_prompt_tokens,
                          embedding=tuple(vector.cpu().tolist()))
