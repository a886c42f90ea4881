"""How many prompt tokens a step may prefill while sequences decode, bounded by time. Pure Python, no torch.

Every decoding stream waits for the whole step that carries its next token, so a prefill chunk stalls them all
for as long as it computes. A token cap alone (``max_prefill_tokens_while_decoding``) cannot say how long that
is: 256 prompt tokens are a few milliseconds on a GPU and about a second on one CPU core with a 135M model.

``StepFit`` fits every step the engine runs to ``seconds = fixed + per_row x decode_rows + per_token x
prompt_tokens`` (least squares over recent steps: the weights are read once per step, a decode row also pays the
output projection, a prompt row does not); ``PrefillBudget`` turns a time bound into tokens with it: a step beside
``d`` decode rows may prefill ``(ratio - 1) x (fixed + per_row x d) / per_token`` tokens, so that it lasts about
``ratio`` decode-only steps. While more requests wait for their first token than sequences decode (a burst), the
allowance grows by that proportion: a second of prefill delays ``d`` streams by a second, while a second given to
the decodes delays every waiting request's first token by as much, so the time goes to the side where more requests
wait (the fixed ratio alone cost a burst its TTFT and some throughput: benchmarks/HISTORY.md, "Smooth streams").
Mixed steps inform the fit as much as pure ones, which matters under a burst, where every step prefills something
for a long time. When the two kinds of rows never varied apart (collinear), one line over all rows is used; until a
fit exists the token cap alone applies. The result is within ``[floor, cap]``: a prompt always moves.

The sums fade (halved each time ``window`` steps accumulate) so the fit follows contexts that grow and a machine
whose load changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepModel:
    """seconds = fixed + per_row x decode rows + per_token x prompt tokens."""

    fixed: float
    per_row: float
    per_token: float

    def decode_seconds(self, decode_rows: int) -> float:
        return self.fixed + self.per_row * decode_rows

    def seconds(self, decode_rows: int, prompt_tokens: int) -> float:
        return self.decode_seconds(decode_rows) + self.per_token * prompt_tokens


class StepFit:
    """Least squares of the steps the engine ran: ``seconds = fixed + per_row x decode rows + per_token x prompt
    tokens``, over sums that fade (halved each time ``window`` steps accumulate). Read by the prefill bound below
    and by the speculative guesses' gate (``handlers.engine.core.draft_gate``)."""

    _KEYS = ("n", "d", "p", "y", "dd", "dp", "pp", "dy", "py")

    def __init__(self, window: int = 128, min_steps: int = 8) -> None:
        self.window = window
        self.min_steps = min_steps
        self._sums = dict.fromkeys(self._KEYS, 0.0)
        self._model: StepModel | None = None

    def record(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step the engine ran: its decode rows (guessed tokens included), the prompt tokens it prefilled
        and its wall time."""
        s = self._sums
        if s["n"] >= self.window:  # older steps fade; recent ones dominate
            for k in self._KEYS:
                s[k] /= 2
        d, p, y = float(decode_rows), float(prompt_tokens), seconds
        for k, v in (("n", 1.0), ("d", d), ("p", p), ("y", y), ("dd", d * d), ("dp", d * p), ("pp", p * p),
                     ("dy", d * y), ("py", p * y)):
            s[k] += v
        # a fit the noise of one step breaks (a negative slope) keeps the last good one: the bound must not
        # switch off on a busy machine
        self._model = self._fit() or self._model

    def _fit(self) -> StepModel | None:
        s = self._sums
        n = s["n"]
        if n < self.min_steps:
            return None
        md, mp, my = s["d"] / n, s["p"] / n, s["y"] / n
        sdd, spp, sdp = s["dd"] - n * md * md, s["pp"] - n * mp * mp, s["dp"] - n * md * mp
        sdy, spy = s["dy"] - n * md * my, s["py"] - n * mp * my
        det = sdd * spp - sdp * sdp
        if sdd > 0 and spp > 0 and det > 1e-6 * sdd * spp:
            per_row, per_token = (sdy * spp - spy * sdp) / det, (spy * sdd - sdy * sdp) / det
            if per_row > 0 and per_token > 0:
                return StepModel(my - per_row * md - per_token * mp, per_row, per_token)
        stt, sty = sdd + 2 * sdp + spp, sdy + spy  # one line over all rows: t = d + p
        if stt <= 0 or sty <= 0:
            return None
        slope = sty / stt
        return StepModel(my - slope * (md + mp), slope, slope)

    @property
    def model(self) -> StepModel | None:
        return self._model


class PrefillBudget:
    """The prefill tokens a step may add to ``d`` decode rows so that it lasts at most ``ratio`` decode steps."""

    def __init__(self, ratio: float, floor: int, fit: StepFit | None = None) -> None:
        if ratio <= 1.0:
            raise ValueError(f"ratio must be > 1, got {ratio!r}")
        self.ratio = ratio
        self.floor = max(1, floor)
        self.fit = fit if fit is not None else StepFit()

    @property
    def model(self) -> StepModel | None:
        return self.fit.model

    def limit(self, decode_rows: int, cap: int, waiting: int = 0, decoding: int | None = None) -> int:
        """Prompt tokens the next step may prefill beside ``decode_rows`` decode rows (guesses included) of
        ``decoding`` sequences (default: one per row) while ``waiting`` requests wait for their first token:
        ``cap`` (0: no cap) until the costs are known, then the time bound (grown by ``waiting / decoding`` when
        that exceeds 1), within [floor, cap]."""
        m = self.fit.model
        decode = m.decode_seconds(decode_rows) if m is not None else 0.0
        if m is None or decode <= 0:
            return cap
        # streams, not rows: a sequence carrying seven guesses is still one stream the prefill delays
        pressure = max(1.0, waiting / max(1, decode_rows if decoding is None else decoding))
        tokens = max(self.floor, int((self.ratio - 1.0) * pressure * decode / m.per_token))
        return min(tokens, cap) if cap else tokens

    def as_dict(self) -> dict[str, float | None]:
        """What the engine reports in its stats (seconds; None until fitted)."""
        m = self.fit.model
        return {"ratio": self.ratio, "fixed_s": m.fixed if m else None, "per_decode_row_s": m.per_row if m else None,
                "per_prompt_token_s": m.per_token if m else None}
