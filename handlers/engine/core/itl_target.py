"""An inter-token latency target the scheduler keeps: how much prompt a step may carry beside its streams.

Design note: every running stream waits for the whole step that carries its next token, so a step's length is
its streams' inter-token gap. ``ItlTarget`` holds the target (``option.max_itl_ms``, changeable at run time)
and prices the prompt work a step may add beside ``d`` decode rows with the engine's fitted step cost
(``step_budget.StepFit``: seconds = fixed + per_row x d + per_token x p, refitted online from the steps run):
``p = (target / margin - fixed - per_row x d) / per_token``, never below ``floor`` while a prompt waits (a first
token is never starved: a step may then run over the target, and is counted). With no streams in the step nothing bounds
it (a burst at start-up pays nothing), and until the cost is known the scheduler's other bounds apply.
The ``margin`` is what a stream's gap runs over the fit's prediction of its step (the 98th percentile of the
last steps' ratios, at least 1): the fit is a mean, and a gap also holds the time between two steps (sending
the step's tokens, taking in new requests), so a step priced to the target alone ends past it half the time.

The default target (``auto``) is derived at load from a measured decode step of a full batch
(``handlers.engine.execution.itl_calibration``): ``AUTO_DECODE_STEPS`` such steps, so that a step of a full batch may
carry about as much prompt work as decode work. ``record_step`` counts the steps whose gap (from the end of the
previous step that sampled tokens to the end of this one, for a step with decode rows) ran over the target,
and by how much. ``tokens_left_guess`` is the only estimate of a stream's remaining length: what it wrote so
far, capped by its stop conditions (``max_tokens`` only caps, clients set it far above what models write).
"""

from __future__ import annotations

import collections

from handlers.engine.core.sequence import Sequence
from handlers.engine.core.step_budget import StepFit

AUTO_DECODE_STEPS = 2.0  # the auto target: this many decode steps of a full batch, as measured at load
OFF = 0  # option.max_itl_ms = 0: no target (the token cap, the time ratio and burst pauses decide)
MARGIN_STEPS = 128  # the recent gaps whose ratio to their step's prediction set the margin
MARGIN_QUANTILE = 0.98
MAX_MARGIN = 1.5  # a burst of slow steps (another process took the core) shrinks prompt work by a third at most


def tokens_left_guess(seq: Sequence, max_model_len: int) -> int:
    """How many more tokens ``seq`` will likely write: as many as it wrote so far (a stream half-way through is
    as likely to be anywhere in its answer), at least one, capped by the length it may still reach."""
    hard = min(seq.params.max_new_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
    return max(0, min(hard, max(1, seq.num_output_tokens)))


class ItlTarget:
    """The target in force (seconds; None: off), its load-time default, and the steps that ran over it."""

    def __init__(self, fit: StepFit, floor: int, target_ms: int | None = None, full_batch: int = 32) -> None:
        """``target_ms``: the option's value (None: auto, set by ``derive``, or from the fit's decode step of
        ``full_batch`` rows once there is one, where nothing was measured at load; 0: off)."""
        self.fit = fit
        self.floor = max(1, floor)
        self.full_batch = full_batch
        self.derived_ms: float | None = None  # the auto default, once measured
        self.decode_step_ms: float | None = None  # the full batch's decode step it came from
        self.option_ms = target_ms
        self.source = "auto" if target_ms is None else "option"
        self.target_s: float | None = None if not target_ms else target_ms / 1e3
        self.steps_over = 0
        self.seconds_over = 0.0
        self.max_gap_s = 0.0
        self._last_sampled_end: float | None = None
        self._last_sampled = False
        self._ratios: collections.deque[float] = collections.deque(maxlen=MARGIN_STEPS)
        self._margin = 1.0  # from the ratios, once per step that adds one (the scheduler asks several times a step)

    def derive(self, decode_step_s: float) -> None:
        """The auto default from a measured decode step of a full batch (applies unless a value was set)."""
        self.decode_step_ms = round(decode_step_s * 1e3, 3)
        self.derived_ms = round(AUTO_DECODE_STEPS * decode_step_s * 1e3, 1)
        if self.option_ms is None and self.source == "auto":
            self.target_s = self.derived_ms / 1e3

    def set(self, target_ms: int, source: str = "API") -> None:
        """A new target from the next step on (0: off)."""
        if isinstance(target_ms, bool) or not isinstance(target_ms, int) or target_ms < 0:
            raise ValueError(f"max_itl_ms must be an integer >= 0, got {target_ms!r}")
        self.option_ms, self.source = target_ms, source
        self.target_s = target_ms / 1e3 if target_ms else None

    def prefill_tokens(self, decode_rows: int) -> int | None:
        """Prompt tokens the next step may carry beside ``decode_rows`` decode rows (guesses included) so that it
        lasts at most the target (at least ``floor``); None when no target is in force, no row decodes, or the
        step cost is not fitted yet."""
        m = self.fit.model
        if m is not None and self.source == "auto" and self.derived_ms is None:  # not measured at load
            self.derive(m.decode_seconds(self.full_batch))
        if self.target_s is None or m is None or decode_rows <= 0:
            return None
        spare = self.target_s / self.margin() - m.decode_seconds(decode_rows)
        return max(self.floor, int(spare / m.per_token)) if spare > 0 else self.floor

    def margin(self) -> float:
        """How much longer than their step's prediction the recent gaps ran (1.0 until there are a few)."""
        return self._margin

    def record_step(self, end_s: float, decode_rows: int, sampled: bool, predicted_s: float | None = None) -> None:
        """A step ended at ``end_s``: with decode rows, its streams' gap is measured against the target and, when
        the gap spans this step alone, against ``predicted_s`` (what the fit said the step would take)."""
        if decode_rows and self._last_sampled_end is not None:
            gap = end_s - self._last_sampled_end
            self.max_gap_s = max(self.max_gap_s, gap)
            if self.target_s is not None and gap > self.target_s:
                self.steps_over += 1
                self.seconds_over += gap - self.target_s
            if predicted_s and self._last_sampled:
                self._ratios.append(gap / predicted_s)
                if len(self._ratios) >= MARGIN_STEPS // 8:
                    ratios = sorted(self._ratios)
                    self._margin = min(MAX_MARGIN, max(1.0, ratios[int(MARGIN_QUANTILE * (len(ratios) - 1))]))
        if sampled:  # a stream's next gap starts here (a step that samples nothing, paused or idle, does not)
            self._last_sampled_end = end_s
        self._last_sampled = sampled

    def as_dict(self) -> dict[str, float | int | str | None]:
        """What the engine reports (``GET /models/{name}``): the target in force (ms, 0 = off), where it came
        from, the auto default measured at load, and the steps over it."""
        return {"max_itl_ms": round(self.target_s * 1e3, 1) if self.target_s is not None else OFF,
                "source": self.source, "derived_ms": self.derived_ms, "decode_step_ms": self.decode_step_ms,
                "steps_over_total": self.steps_over,
                "seconds_over_total": round(self.seconds_over, 6), "max_gap_ms": round(self.max_gap_s * 1e3, 1),
                "margin": round(self.margin(), 3)}
