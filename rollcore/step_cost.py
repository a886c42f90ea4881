"""A rolling engine's step cost, as a line: seconds = fixed + per_token x tokens computed in the step.

The engine adds every step it runs (``StepCost.add``: the tokens it fed the model, prompt chunks, decodes and
guessed tokens together, and the step's wall time from scheduling to sampled tokens) and reports the running
sums in its stats (``GET /models/{name}`` -> ``batcher.engines.<worker>.step_cost``). Sums, not a fitted line,
so that a reader can merge workers (``+``), take the steps between two snapshots (``-``) and fit the line over
what it wants (``fit``: least squares).

Why a line: on a CPU a step's matmuls read every weight once (the fixed part, what a step of one decode
costs) and do arithmetic in proportion to the rows fed (the slope); attention adds a part that grows with the
context, which the line averages over the workload that produced the steps. ``serving tune`` uses it to jump to
the prefill budget whose longest step fits an inter-token-latency bound (``serving.tune``), instead of
halving the budget one measured run at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class StepCost:
    """Running sums over steps of x = tokens computed and y = seconds."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    tokens_sq: int = 0
    tokens_seconds: float = 0.0
    max_tokens: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.tokens_sq += tokens * tokens
        self.tokens_seconds += tokens * seconds
        self.max_tokens = max(self.max_tokens, tokens)

    def as_dict(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StepCost:
        """The sums an engine reported (missing or malformed: empty)."""
        if not isinstance(data, dict):
            return cls()
        try:
            return cls(steps=int(data["steps"]), tokens=int(data["tokens"]), seconds=float(data["seconds"]),
                       tokens_sq=int(data["tokens_sq"]), tokens_seconds=float(data["tokens_seconds"]),
                       max_tokens=int(data["max_tokens"]))
        except (KeyError, TypeError, ValueError):
            return cls()

    def __add__(self, other: StepCost) -> StepCost:
        """Both sets of steps (e.g. two workers of one model)."""
        return StepCost(self.steps + other.steps, self.tokens + other.tokens, self.seconds + other.seconds,
                        self.tokens_sq + other.tokens_sq, self.tokens_seconds + other.tokens_seconds,
                        max(self.max_tokens, other.max_tokens))

    def __sub__(self, earlier: StepCost) -> StepCost:
        """The steps since ``earlier`` (a snapshot of the same sums); ``max_tokens`` stays the later one's."""
        return StepCost(self.steps - earlier.steps, self.tokens - earlier.tokens, self.seconds - earlier.seconds,
                        self.tokens_sq - earlier.tokens_sq, self.tokens_seconds - earlier.tokens_seconds,
                        self.max_tokens)

    def fit(self, min_steps: int = 8) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) by least squares; None with fewer than ``min_steps`` steps, when
        every step had the same number of tokens (no slope to see) or the slope is not positive."""
        n = self.steps
        if n < min_steps:
            return None
        var = n * self.tokens_sq - self.tokens * self.tokens
        if var <= 0:
            return None
        slope = (n * self.tokens_seconds - self.tokens * self.seconds) / var
        if slope <= 0:
            return None
        fixed = max(0.0, (self.seconds - slope * self.tokens) / n)
        return fixed, slope

    def tokens_within(self, seconds: float, min_steps: int = 8) -> int | None:
        """The most tokens a step may compute and still take at most ``seconds`` by the fitted line (None:
        no line; 0: not even an empty step fits)."""
        line = self.fit(min_steps)
        if line is None:
            return None
        fixed, slope = line
        return max(0, int((seconds - fixed) / slope + 1e-9))  # 1e-9: a whole number of tokens stays whole
