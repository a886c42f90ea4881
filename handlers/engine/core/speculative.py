"""Prompt-lookup (n-gram) speculative decoding: guesses of the next tokens, checked by the model in one step.

Design note: a sequence's next tokens often repeat a stretch of its own text (code, quotes of the prompt,
lists, a loop a small model falls into). ``NgramDrafter`` finds the longest suffix of the sequence (between
``min_n`` and ``max_n`` tokens) that occurred earlier and proposes the tokens that followed its first
occurrence (as vLLM's ``ngram`` method). The engine feeds ``[last token, d1 .. dk]`` as one chunk; the model's
logits at those k + 1 positions say, for each, the token greedy decoding would choose there: the guesses are
accepted while they agree, and the first disagreement (or, when all agree, the position after the last
guess) gives one more token from the model itself. Every emitted token is therefore the model's own greedy
choice: the output is the one plain decoding gives (up to the matmul blocking a different batch shape
brings, as with any batch), in fewer steps whenever a guess is right. The KV written for rejected guesses
lies past the sequence's computed tokens and is overwritten by later steps. Only plain greedy requests
speculate (with log-probabilities when asked: each emitted token's come from the row that chose it); the others
decode one token per step in the same batch.

The index is built incrementally: each position is added once (a dict from n-gram to the position after its
first occurrence), so a proposal costs ``max_n - min_n + 1`` lookups, not a scan of the sequence.

A rejected guess costs its rows of the step's matmuls and attention. Text that does not repeat itself would pay
that every step for nothing, so a sequence whose whole draft was rejected pauses: it proposes nothing for 1, then
2, 4 .. up to ``MAX_PAUSE`` steps after each further miss, and guesses every step again once one is confirmed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

MAX_SPECULATIVE_TOKENS = 16  # option.num_speculative_tokens' maximum (rollcore.options)
MAX_PAUSE = 16  # steps without guesses after repeated misses (see the note)


class NgramDrafter:
    """Proposals for one sequence from its own tokens (prompt and output). Pure Python, no torch."""

    __slots__ = ("min_n", "max_n", "_index", "_indexed", "_pause", "_skip")

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self._pause = 0  # steps to skip after the next miss / 2
        self._skip = 0  # steps left to skip

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of the last proposal: after a miss (nothing confirmed) pause, doubling each time."""
        if proposed and not accepted:
            self._pause = min(max(1, 2 * self._pause), MAX_PAUSE)
            self._skip = self._pause
        elif accepted:
            self._pause = self._skip = 0

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to ``k`` guesses of the tokens after ``tokens`` (empty when no suffix occurred before)."""
        length = len(tokens)
        if self._skip:
            self._skip -= 1
            return []
        if k <= 0 or length < self.min_n + 1:
            return []
        index = self._index
        # Index every n-gram that has a follower, i.e. ends at position <= length - 2 (the suffix itself never
        # matches its own occurrence). The first occurrence is kept: after it lies the longest continuation.
        for end in range(self._indexed, length - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index.setdefault(tuple(tokens[end - n + 1:end + 1]), end + 1)
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            follower = index.get(tuple(tokens[length - n:]))
            if follower is not None:
                return list(tokens[follower:follower + k])
        return []


def accepted_prefix(draft: Seq[int], chosen: Seq[int]) -> int:
    """How many guesses the model confirmed: ``chosen[i]`` is its choice after the chunk's i-th token (the
    last real token, then each guess), so guess ``draft[i]`` stands while it equals ``chosen[i]``."""
    m = 0
    while m < len(draft) and draft[m] == chosen[m]:
        m += 1
    return m
