"""Choosing the next token of each sequence from its logits.

Design note: per-request behaviour goes through logits processors, which act on greedy rows too (logit bias,
min_tokens, presence/frequency penalties, transformers' repetition penalty), then warpers, which only shape
sampling (temperature, min_p, typical_p, top-k, top-p, in vLLM's order), and a per-request ``torch.Generator``
(seeded from the request's ``seed``, else from the engine's seed source), so a seeded request samples the same
tokens no matter what it is batched with. Plain greedy rows skip all of that: one ``argmax`` for the whole group.
On a GPU the greedy argmax runs on the device; the rows that sample or report log-probabilities are copied
to the host in one transfer and go through the same CPU code (so a seeded request draws the same tokens on
any device, from its CPU generator). The constrained rows (structured output) get their grammars' masks of
allowed tokens applied first, in one batched operation before any processor, as vLLM does; a greedy constrained
row then shares the batched argmax. Log-probabilities stay the model's own (taken before the mask).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from handlers.engine.core.schedule_plan import ScheduledChunk
from handlers.engine.execution.kernels.native import load_argmax
from rollcore.types import SamplingParams, TokenInfo


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The chosen token, with its log-probability and the top-N alternatives when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class RequestSampler:
    """Sampling state of one request: its processors and its random generator."""

    def __init__(self, params: SamplingParams, seed_source: random.Random, prompt_len: int = 0,
                 stop_ids: frozenset[int] = frozenset(), bad_words: Seq[Seq[int]] = ()) -> None:
        """``prompt_len``: where the generated tokens begin (penalties count those); ``stop_ids``: the tokens
        ``min_tokens`` holds back (EOS and stop token ids); ``bad_words``: ``bad_words_ids`` of the request's."""
        self.params = params
        self.greedy = params.greedy
        self.wants_logprobs = params.details or params.logprobs > 0
        self.processors = LogitsProcessorList()
        if params.logit_bias:
            self.processors.append(LogitBias(params.logit_bias))
        if params.min_tokens > 0 and stop_ids:
            self.processors.append(MinTokens(prompt_len, params.min_tokens, stop_ids))
        if params.presence_penalty or params.frequency_penalty:
            self.processors.append(OutputPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
        if bad_words:
            self.processors.append(BadWords(prompt_len, bad_words))
        if params.repetition_penalty != 1.0:
            self.processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        self.warpers = LogitsProcessorList()
        self.generator: torch.Generator | None = None
        if not self.greedy:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.min_p > 0:
                self.warpers.append(MinPLogitsWarper(params.min_p))
            if params.typical_p < 1.0:
                self.warpers.append(TypicalLogitsWarper(params.typical_p))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
            seed = params.seed if params.seed is not None else seed_source.getrandbits(63)
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no processor: can share one batched argmax."""
        return self.greedy and not self.processors

    def choose(self, logits: torch.Tensor, token_ids: Seq[int]) -> int:
        """Pick a token from one row of logits [V] given the sequence's tokens so far."""
        scores = logits.unsqueeze(0)
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


class LogitBias:
    """OpenAI's ``logit_bias``: a bias added to each listed token's logit (ids past the vocabulary ignored)."""

    def __init__(self, biases: Seq[tuple[int, float]]) -> None:
        self.ids = torch.tensor([t for t, _ in biases], dtype=torch.long)
        self.values = torch.tensor([b for _, b in biases])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        inside = self.ids < scores.shape[-1]
        scores[:, self.ids[inside].to(scores.device)] += self.values[inside].to(scores.device, scores.dtype)
        return scores


class MinTokens:
    """vLLM's ``min_tokens``: no EOS or stop token id until that many tokens were generated."""

    def __init__(self, prompt_len: int, min_tokens: int, stop_ids: frozenset[int]) -> None:
        self.prompt_len = prompt_len
        self.min_tokens = min_tokens
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_len < self.min_tokens:
            ids = self.stop_ids[self.stop_ids < scores.shape[-1]].to(scores.device)
            scores[:, ids] = float("-inf")
        return scores


def bad_words_ids(tokenizer: Any, words: Seq[str]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word as written (stripped on the left), and with a leading
    space when that makes a distinct word token of the same length (so a word is banned at the start of the text
    and in the middle of it)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        out.extend(ids for ids in (plain, spaced if spaced and plain and spaced[0] != plain[0]
                                   and len(spaced) == len(plain) else []) if ids)
    return out


class BadWords:
    """vLLM's ``bad_words``: a word's last token is banned when the generated tokens end with the rest of it."""

    def __init__(self, prompt_len: int, sequences: Seq[Seq[int]]) -> None:
        self.prompt_len = prompt_len
        self.sequences = [list(s) for s in sequences]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for seq in self.sequences:
                prefix = seq[:-1]
                if seq[-1] < scores.shape[-1] and (not prefix or ids[len(ids) - len(prefix):] == prefix):
                    scores[row, seq[-1]] = float("-inf")
        return scores


class OutputPenalties:
    """vLLM's presence and frequency penalties: over the generated tokens only, ``presence`` subtracted once from
    each token that occurred, ``frequency`` once per occurrence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len = prompt_len
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len:]
        if out.numel() == 0:
            return scores
        out = out.to(scores.device)
        counts = torch.zeros_like(scores).scatter_add_(-1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def greedy_tokens(rows: torch.Tensor) -> list[int]:
    """``rows.argmax(-1)`` as a list: through the C kernel on the CPU (about a third of torch's time on fp32 rows
    of a large vocabulary), else torch's."""
    kernel = load_argmax() if rows.device.type == "cpu" else None  # never built in a GPU worker's step
    tokens = kernel.rows(rows) if kernel is not None else None
    return tokens if tokens is not None else rows.argmax(-1).tolist()


def sample_batch(logits: torch.Tensor, token_ids: Seq[Seq[int]], samplers: Seq[RequestSampler],
                 allowed: dict[int, torch.Tensor] | None = None) -> list[SampledToken]:
    """Choose one token per row of ``logits`` [S, V]; row i belongs to ``samplers[i]``; ``allowed`` maps the
    constrained rows to their masks [V] (bool)."""
    raw: dict[int, torch.Tensor] = {}
    if allowed:
        rows = list(allowed)
        raw = {i: logits[i].clone() for i in rows if samplers[i].wants_logprobs}
        mask = torch.stack([allowed[i] for i in rows]).to(logits.device)
        masked = logits[rows]  # a copy, masked in place; the model's logits are inference tensors: not written
        masked.masked_fill_(~mask[:, :logits.shape[-1]], float("-inf"))
        logits = logits.index_put((torch.tensor(rows, device=logits.device),), masked)
    chosen = [0] * len(samplers)
    greedy_rows = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if greedy_rows:
        rows = logits if len(greedy_rows) == len(samplers) else logits[greedy_rows]
        for i, t in zip(greedy_rows, greedy_tokens(rows), strict=True):
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
            chosen[i] = s.choose(host[i], token_ids[i])
    return [sampled_token(raw.get(i, host[i]), chosen[i], s) if i in host else SampledToken(chosen[i])
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


def scored_tokens(logits: torch.Tensor, targets: Seq[int], texts: Seq[str], k: int) -> list[TokenInfo]:
    """Prompt log-probabilities: row j of ``logits`` [n, V] scores ``targets[j]`` (text ``texts[j]``), with the
    ``k`` most likely alternatives when k > 0. The model's raw distribution, as vLLM reports prompt tokens."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(targets), dtype=torch.long, device=scores.device)  # long even when empty
    chosen = scores.gather(1, ids[:, None])[:, 0].tolist()
    top: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if k:
        values, ids = scores.topk(k)
        top = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [TokenInfo(t, s, lp, alt) for t, s, lp, alt in zip(targets, texts, chosen, top, strict=True)]


def score_prompt_rows(chunks: Seq[ScheduledChunk], logits: torch.Tensor,
                      decode: Callable[[list[list[int]]], list[str]],
                      record: Callable[[ScheduledChunk, list[TokenInfo]], None]) -> torch.Tensor:
    """The prompt tokens' log-probabilities from the chunks' prompt rows (``prompt_logprobs``), handed to
    ``record`` chunk by chunk; returns the rows that sample."""
    sampled_rows: list[int] = []
    row = 0
    for c in chunks:
        n = c.num_prompt_rows
        if n:
            targets = c.seq.token_ids[c.start + 1:c.start + 1 + n]
            record(c, scored_tokens(logits[row:row + n], targets, decode([[t] for t in targets]),
                                    c.seq.params.prompt_logprobs or 0))
            row += n
        if c.samples:
            sampled_rows.extend(range(row, row + 1 + len(c.draft)))
            row += 1 + len(c.draft)
    return logits[sampled_rows]
