"""What a step's schedule is made of: the scheduler's limits, the chunks it plans, the plan, and what the steps
since a change of limits did. Pure Python, no torch.

Design note: these are values the scheduler (``handlers.engine.core.scheduler``) hands out and the execution side
reads (the runner, sampling, pooling and the draft check take ``ScheduledChunk``s), so they stand apart from the
policy that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.engine.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step and of the cache. ``max_model_len`` caps prompt + generated tokens."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    sliding_window: int = 0  # every layer attends to at most this many keys (0: some layer sees all)
    max_prefill_tokens_while_decoding: int = 0  # prefill tokens per step while decodes run (0: no cap)
    max_speculative_batch: int = 1 << 30  # guesses only while at most this many sequences decode
    burst_prefill_first: bool = False  # a burst's first tokens before the running streams' next ones


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Feed ``seq.token_ids[start:start + num_tokens]`` to the model this step, then the guessed tokens
    ``draft`` (speculative decoding: their KV is written at the positions after, and the model's logits at
    every position of the chunk are sampled)."""

    seq: Sequence
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens, so its last logits are sampled (never
        for an embedding request, which is answered with its pooled hidden state instead)."""
        return self.seq.pooling is None and self.start + self.num_tokens == self.seq.num_tokens

    @property
    def ends_prompt(self) -> bool:
        """True when this chunk computes the last token it was given (an embedding request is then complete)."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def pooled_rows(self) -> range:
        """Embedding requests: the rows of this chunk (from 0) whose final hidden states the pooling reads: the
        prompt's last row (last), its first (cls) or all of them (mean)."""
        pooling = self.seq.pooling
        if pooling == "mean":
            return range(self.num_tokens)
        if pooling == "cls":
            return range(1) if self.start == 0 else range(0)
        if pooling == "last" and self.ends_prompt:
            return range(self.num_tokens - 1, self.num_tokens)
        return range(0)

    @property
    def num_prompt_rows(self) -> int:
        """Rows of this chunk whose logits score a prompt token (``prompt_logprobs``): positions before the
        prompt's last, each predicting the token after it. They come first in the chunk."""
        if self.seq.params.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + self.num_tokens, self.seq.num_prompt_tokens - 1) - self.start)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan of one step: chunks in batch order and the requests preempted to make room."""

    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens + len(c.draft) for c in self.chunks)


@dataclass(slots=True)
class LimitsRecord:
    """What the scheduler did since its limits last changed (``set_limits``); all zero before any change.

    ``first_step_admitted`` is how many sequences the first ``schedule`` after the change admitted (None
    until it ran); ``peak_running_admitting`` the largest running batch that a step which admitted anything
    left since the change (a lowered ``max_num_seqs`` bounds it once fewer sequences run)."""

    changes: int = 0
    changed_at_schedule: int = 0  # the scheduler's schedule() count when the change was applied
    running_at_change: int = 0
    waiting_at_change: int = 0
    first_step_admitted: int | None = None
    admitted_since_change: int = 0
    peak_running_admitting: int = 0

    def as_dict(self) -> dict[str, int | None]:
        return {"changes": self.changes, "changed_at_schedule": self.changed_at_schedule,
                "running_at_change": self.running_at_change, "waiting_at_change": self.waiting_at_change,
                "first_step_admitted": self.first_step_admitted,
                "admitted_since_change": self.admitted_since_change,
                "peak_running_admitting": self.peak_running_admitting}
