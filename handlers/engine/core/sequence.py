"""Per-request state of the rolling-batch engine.

Design note: a ``Sequence`` is mutable engine-internal state owned by the scheduler (status, block table,
how many tokens have KV computed) and the engine (generated tokens, finish reason). ``token_ids`` holds
prompt + output so that a preempted sequence can be recomputed from it. No torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollcore.types import FinishReason, SamplingParams

FREED_BLOCK = -1  # block-table entry of a block freed because it fell out of the sliding window


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts the leading ``token_ids`` whose KV is in the cache; the tokens after it
    are fed to the model at coming steps. ``block_ids`` is the block table (logical block i -> physical
    block). ``block_hashes`` are the prefix-cache keys of the full blocks registered so far.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # SHA-256 digests (kv_cache.block_key)
    num_freed_blocks: int = 0  # leading block-table entries freed (sliding window): FREED_BLOCK
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # an embedding request: how its prompt's hidden states are pooled (last, mean, cls); None: it generates
    pooling: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_live_blocks(self) -> int:
        """Blocks this sequence holds (its table minus the entries freed out of the sliding window)."""
        return len(self.block_ids) - self.num_freed_blocks

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens this request may generate."""
        return len(self.prompt_token_ids) + self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
