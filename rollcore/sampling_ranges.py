"""The allowed range of every numeric sampling parameter, stated once for the frontend and the handlers.

Design note: the frontend's request models (``serving.requests.params``) take their bounds from ``RANGES``, so a value
out of range is a 400 naming the client's field before any work, and ``check_sampling`` checks a built
``SamplingParams`` against the same table (the frontend once per request, after its parameters are combined, for
what no single field can say, such as ``min_tokens`` <= ``max_new_tokens``; a handler for requests that did not
come through a frontend: in-process engines, custom callers). Pure Python, no torch.

The ranges: ``temperature`` 0..2 (OpenAI's; 0 = greedy); ``top_p`` and ``typical_p`` in (0, 1]; ``top_k`` 0 (off)
and up; ``repetition_penalty`` 0.01..100; ``presence_penalty`` and ``frequency_penalty`` -2..2 (vLLM's); ``min_p``
0..1; ``logprobs``, ``min_tokens`` 0 and up; ``max_new_tokens`` 1 and up; beam search's ``num_beams`` 1..16 and
``length_penalty`` -10..10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollcore.errors import InvalidRequest
from rollcore.types import SamplingParams

MAX_TOKEN_ID = 2**31 - 1  # token ids and top_k: what every tokenizer and the wire can carry


@dataclass(frozen=True, slots=True)
class Range:
    """``lo`` <= value <= ``hi`` (``lo`` excluded when ``lo_open``); None: unbounded on that side."""

    lo: float | None
    hi: float | None
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        if math.isnan(value):
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        return above and (self.hi is None or value <= self.hi)

    def words(self) -> str:
        """The range as the frontend's messages say it (``must be >= 0 and <= 2``)."""
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
        if self.hi is not None:
            parts.append(f"<= {_num(self.hi)}")
        return " and ".join(parts)


RANGES: dict[str, Range] = {
    "max_new_tokens": Range(1, None),
    "temperature": Range(0, 2.0),
    "top_k": Range(0, MAX_TOKEN_ID),
    "top_p": Range(0, 1, lo_open=True),
    "repetition_penalty": Range(0.01, 100),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "min_p": Range(0, 1),
    "typical_p": Range(0, 1, lo_open=True),
    "logprobs": Range(0, None),
    "min_tokens": Range(0, None),
    "num_beams": Range(1, 16),
    "length_penalty": Range(-10, 10),
}


def check_sampling(params: SamplingParams) -> None:
    """Refuse a value no generation can honour, naming the parameter. Raises ``InvalidRequest``."""
    for name, bounds in RANGES.items():
        value = getattr(params, name)
        if not bounds.holds(value):
            raise InvalidRequest(f"parameter {name!r} must be {bounds.words()}, got {value!r}")
    if params.min_tokens > params.max_new_tokens:
        raise InvalidRequest(f"min_tokens must be in [0, max_new_tokens={params.max_new_tokens}], got "
                             f"{params.min_tokens}")
    if any(not s for s in params.stop):
        raise InvalidRequest("stop sequences must be non-empty strings")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
