"""How many guesses each decoding sequence may carry in a step: what a guess costs against what it buys. Pure Python.

A guess is one more row of the step's matrix products and attention. Where the step's time goes to reading the
weights (one sequence, or a few, on a CPU core) a row is nearly free and every guess the model confirms is a token
for nothing; where it goes to arithmetic (many sequences) a row costs as much as a decode row and a guess pays only
if it is almost sure to stand. A fixed batch limit cannot say where that turns: it moves with the core, the model
and how often the text repeats itself (a summary quotes its prompt; fresh prose does not).

So the engine prices both. Its step fit (``step_budget.StepFit``: seconds = fixed + per_row x rows) says what a
row costs; ``DraftOdds`` says how often the model confirmed a guess at each position of a draft, given that the
guesses before it stood. Beside ``d`` decode rows, each sequence carrying ``k`` guesses makes on average
``1 + p_1 + .. + p_k`` tokens (``p_i``: the chance that the first ``i`` guesses all stand) in a step of
``fixed + per_row x d x (1 + k)`` seconds. ``DraftGate`` picks the ``k`` that makes the most tokens per second:
none where rows are dear, the whole draft where the weights' reading dominates. A sequence still gets fewer when
its drafter finds less, and one whose guesses keep missing pauses (``speculative.NgramDrafter``).
"""

from __future__ import annotations

from handlers.engine.core.step_budget import StepFit


class DraftOdds:
    """The share of guesses confirmed at each draft position, given that the ones before it stood. Starts from
    ``prior`` (a half, worth two guesses) and fades like the step fit, so it follows the text being written."""

    def __init__(self, max_tokens: int, window: int = 1024, prior: tuple[float, float] = (1.0, 2.0)) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.window = window
        self.confirmed = [prior[0]] * max_tokens
        self.checked = [prior[1]] * max_tokens

    def record(self, drafted: int, accepted: int) -> None:
        """One checked draft: its first ``accepted`` guesses stood, the next (if any) fell, the rest were never
        reached (a guess after a wrong one says nothing)."""
        if self.checked[0] >= self.window:
            self.confirmed = [c / 2 for c in self.confirmed]
            self.checked = [c / 2 for c in self.checked]
        for i in range(min(drafted, accepted + 1, len(self.checked))):
            self.checked[i] += 1
            self.confirmed[i] += i < accepted

    def standing(self) -> list[float]:
        """``p_i`` for i = 1 .. max_tokens: the chance that a draft's first i guesses all stand."""
        out, p = [], 1.0
        for c, n in zip(self.confirmed, self.checked, strict=True):
            p *= c / n
            out.append(p)
        return out


class DraftGate:
    """Guesses per sequence beside ``d`` decode rows: the count with the most expected tokens per second of step
    (0 until the step fit exists: nothing says yet what a row costs)."""

    def __init__(self, fit: StepFit, odds: DraftOdds) -> None:
        self.fit = fit
        self.odds = odds

    def __call__(self, decode_rows: int) -> int:
        m = self.fit.model
        if m is None or m.per_row <= 0 or decode_rows < 1:
            return 0
        fixed, row = max(m.fixed, 0.0), m.per_row * decode_rows
        best_k, best, tokens = 0, 1.0 / (fixed + row), 1.0
        for k, p in enumerate(self.odds.standing(), start=1):
            tokens += p
            rate = tokens / (fixed + row * (1 + k))
            if rate > best:
                best_k, best = k, rate
        return best_k

    def as_dict(self) -> dict[str, object]:
        """What the engine reports in its stats: each position's chance to stand and the guesses the gate gives at
        a few batch sizes (string keys: the stats cross the worker channel as msgpack, which takes no int keys)."""
        return {"standing": [round(p, 4) for p in self.odds.standing()],
                "guesses_at_batch": {str(d): self(d) for d in (1, 2, 4, 8, 16, 32)}}
