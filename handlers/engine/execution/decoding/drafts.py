"""Checking a step's guessed tokens (speculative decoding): which guesses the model confirms, and its next token.

Design note: a chunk with a draft of k guesses ran 1 + k logits rows (its last token, then each guess). Rows
are verified greedily (speculation runs for plain greedy requests only: ``handlers.engine.core.speculative``):
the model's choice after each confirmed prefix is the argmax of its row, so the tokens emitted are exactly
greedy decoding's. Chunks without a draft in the same step are sampled as usual, with their grammar masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from handlers.engine.core.schedule_plan import ScheduledChunk
from handlers.engine.core.speculative import accepted_prefix
from handlers.engine.execution.decoding.sampling import (
    RequestSampler,
    SampledToken,
    greedy_tokens,
    sample_batch,
    sampled_token,
)


@dataclass(frozen=True, slots=True)
class Checked:
    """One chunk's outcome: the tokens to emit in order, how many guesses it made and how many held."""

    tokens: list[SampledToken]
    drafted: int
    accepted: int


def check_drafts(sampled: Sequence[ScheduledChunk], samplers: Sequence[RequestSampler], logits: torch.Tensor,
                 allowed: dict[int, torch.Tensor] | None) -> list[Checked]:
    """Each sampled chunk's tokens for a step in which some chunks carried guesses; ``allowed``: the grammar
    masks of the chunks without a draft, by their index among those."""
    first: list[int] = []  # each chunk's first logits row
    row = 0
    for c in sampled:
        first.append(row)
        row += 1 + len(c.draft)
    plain = [i for i, c in enumerate(sampled) if not c.draft]
    plain_tokens = iter(sample_batch(logits[[first[i] for i in plain]], [sampled[i].seq.token_ids for i in plain],
                                     [samplers[i] for i in plain], allowed) if plain else ())
    # every row's greedy token at once (the C kernel reads the rows in place; copying out the verified rows first
    # cost more than the argmax of the few rows that do not need it)
    greedy = greedy_tokens(logits)
    chosen = [greedy[first[i] + j] for i, c in enumerate(sampled) if c.draft for j in range(1 + len(c.draft))]
    out = []
    at = 0
    for i, c in enumerate(sampled):
        if not c.draft:
            out.append(Checked([next(plain_tokens)], 0, 0))
            continue
        picks = chosen[at:at + 1 + len(c.draft)]
        at += 1 + len(c.draft)
        accepted = accepted_prefix(c.draft, picks)
        tokens = [sampled_token(logits[first[i] + j], t, samplers[i]) for j, t in enumerate(picks[:accepted + 1])]
        out.append(Checked(tokens, len(c.draft), accepted))
    return out
