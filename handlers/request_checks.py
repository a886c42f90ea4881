"""Per-request checks a model handler makes before a request may join a batch.

Design note: pure Python (no torch). Each check raises ``rollcore.errors.InvalidRequest`` with a message
that names the field at fault and the numbers involved, so the handler can turn it into that item's
failure Output while its batch-mates run. Frontends validate the wire format; these checks cover what
only the backend knows (token counts, the context length, the vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence

from rollcore.errors import InvalidRequest
from rollcore.types import SamplingParams


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """Reject an empty prompt or token ids outside the vocabulary. Raises ``InvalidRequest``."""
    if not prompt_ids:
        raise InvalidRequest("inputs must not be empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size}): "
                             "'prompt' / 'prompt_token_ids' must hold ids of this model's vocabulary")


def check_length(num_prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> None:
    """Reject a request whose prompt plus ``max_new_tokens`` exceeds the context. Raises ``InvalidRequest``."""
    if num_prompt_tokens + max_new_tokens > max_model_len:
        raise InvalidRequest(
            f"inputs have {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{num_prompt_tokens + max_new_tokens} exceeds max_model_len {max_model_len}"
        )


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """Reject stop token ids outside the vocabulary. Raises ``InvalidRequest``."""
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids entry {bad[0]} is outside the vocabulary (size {vocab_size})")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Reject stop token ids or logit_bias keys outside the vocabulary. Raises ``InvalidRequest``."""
    check_stop_token_ids(params.stop_token_ids, vocab_size)
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias key {bad[0]} is outside the vocabulary (size {vocab_size})")
