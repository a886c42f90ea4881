"""Choosing the next token of each sequence from its logits.

Design note: per-request behaviour goes through transformers' logits processors and warpers
(repetition penalty, temperature, top-k, top-p) and a per-request ``torch.Generator`` (seeded from the
request's ``seed``, else from the engine's seed source), so a seeded request samples the same tokens no
matter what it is batched with. Plain greedy rows skip all of that: one ``argmax`` for the whole group.
On a GPU the greedy argmax runs on the device; the rows that sample or report log-probabilities are copied
to the host in one transfer and go through the same CPU code (so a seeded request draws the same tokens on
any device, from its CPU generator). A constrained row (structured output) gets its grammar's mask of allowed
tokens applied first, before any processor, as vLLM does; its log-probabilities stay the model's own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from serving.types import SamplingParams


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The chosen token, with its log-probability and the top-N alternatives when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class RequestSampler:
    """Sampling state of one request: its processors and its random generator."""

    def __init__(self, params: SamplingParams, seed_source: random.Random) -> None:
        self.params = params
        self.constrained = params.grammar is not None
        self.greedy = params.greedy
        self.wants_logprobs = params.details or params.logprobs > 0
        self.processors = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            self.processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        self.warpers = LogitsProcessorList()
        self.generator: torch.Generator | None = None
        if not self.greedy:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
            seed = params.seed if params.seed is not None else seed_source.getrandbits(63)
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no processor nor constraint: can share one batched argmax."""
        return self.greedy and not self.processors and not self.constrained

    def choose(self, logits: torch.Tensor, token_ids: Seq[int], allowed: torch.Tensor | None = None) -> int:
        """Pick a token from one row of logits [V] given the sequence's tokens so far; ``allowed`` [V] (bool) is
        the constraint's mask."""
        scores = logits.unsqueeze(0)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:scores.shape[-1]], float("-inf"))
        if self.processors:
            ids = torch.tensor([token_ids], dtype=torch.long, device=logits.device)
            scores = self.processors(ids, scores.clone())  # type: ignore[arg-type]
        if self.greedy:
            return int(scores.argmax(-1))
        warped = self.warpers(None, scores)  # type: ignore[arg-type]
        probs = torch.softmax(warped, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            # Extreme values (a temperature near 0, a tiny repetition penalty) overflow the scores to inf and
            # the softmax to NaN: take their limit, the greedy choice, instead of failing the whole step.
            return int(torch.nan_to_num(scores, nan=float("-inf")).argmax(-1))
        return int(torch.multinomial(probs, 1, generator=self.generator))


def sample_batch(logits: torch.Tensor, token_ids: Seq[Seq[int]], samplers: Seq[RequestSampler],
                 allowed: dict[int, torch.Tensor] | None = None) -> list[SampledToken]:
    """Choose one token per row of ``logits`` [S, V]; row i belongs to ``samplers[i]``; ``allowed`` maps the
    constrained rows to their masks."""
    chosen = [0] * len(samplers)
    greedy_rows = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(samplers) else logits[greedy_rows]
        for i, t in zip(greedy_rows, rows.argmax(-1).tolist(), strict=True):
            chosen[i] = t
    host_rows = [i for i, s in enumerate(samplers) if not s.plain_greedy or s.wants_logprobs]
    if not host_rows:
        return [SampledToken(t) for t in chosen]
    if logits.device.type == "cpu":
        host = {i: logits[i] for i in host_rows}
    else:
        host = dict(zip(host_rows, logits[host_rows].cpu(), strict=True))
    for i, s in enumerate(samplers):
        if not s.plain_greedy:
            chosen[i] = s.choose(host[i], token_ids[i], allowed.get(i) if allowed else None)
    return [sampled_token(host[i], chosen[i], s) if i in host else SampledToken(chosen[i])
            for i, s in enumerate(samplers)]


def sampled_token(logits: torch.Tensor, token: int, sampler: RequestSampler) -> SampledToken:
    """``token`` chosen from one row of ``logits`` [V], with the log-probabilities its request asked for."""
    if not sampler.wants_logprobs:
        return SampledToken(token)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if sampler.params.logprobs > 0:
        values, ids = logprobs.topk(sampler.params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[token]), top)
