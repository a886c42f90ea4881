"""Sampling ranges are stated once (``rollcore.sampling_ranges.RANGES``): the frontend's parameter model and the
handlers' ``check_sampling`` refuse and accept exactly the same values, and what no single field can say
(``min_tokens`` > ``max_new_tokens``) is refused by the frontend before any work."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rollcore.errors import InvalidRequest
from rollcore.sampling_ranges import RANGES, check_sampling
from rollcore.types import SamplingParams
from serving.requests.params import Limits, parse_lmi_parameters

LIMITS = Limits()
INTEGERS = {"max_new_tokens", "top_k", "logprobs", "min_tokens", "num_beams"}
WIRE_BELOW = {"top_k": -2}  # -1 is vLLM's spelling of "off" on the wire (it becomes 0)


def _edges(name: str) -> tuple[list[float], list[float]]:
    """(values inside the range, at its bounds; values just outside it)."""
    r = RANGES[name]
    step = 1 if name in INTEGERS else 0.001
    inside, outside = [], []
    if r.lo is not None:
        inside.append(r.lo + step if r.lo_open else r.lo)
        outside.append(r.lo if r.lo_open else r.lo - step)
    if r.hi is not None:
        inside.append(r.hi)
        outside.append(r.hi + step)
    cast = int if name in INTEGERS else float
    return [cast(v) for v in inside], [cast(v) for v in outside]


def _given(name: str, value: float) -> SamplingParams:
    """``value`` for ``name`` on otherwise default parameters that let it be (min_tokens needs room)."""
    params = SamplingParams(max_new_tokens=max(30, int(value)) if name == "min_tokens" else 30)
    return replace(params, **{name: value})


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_frontend_and_the_handlers_share_every_range(name: str) -> None:
    inside, outside = _edges(name)
    wide = Limits(max_new_tokens=1 << 40, max_logprobs=1 << 40)  # the caps are another rule
    for value in inside:
        check_sampling(_given(name, value))
        extra = {"max_new_tokens": max(30, int(value))} if name == "min_tokens" else {}
        assert getattr(parse_lmi_parameters({name: value, **extra}, wide), name) == value
    for value in outside:
        with pytest.raises(InvalidRequest, match=f"'{name}' must be"):
            check_sampling(_given(name, value))
        below = RANGES[name].lo is not None and value < RANGES[name].lo
        wire = WIRE_BELOW.get(name, value) if below else value
        with pytest.raises(InvalidRequest, match=f"parameter '{name}' must be"):
            parse_lmi_parameters({name: wire}, wide)


def test_min_tokens_beyond_max_new_tokens_is_refused_by_the_frontend() -> None:
    with pytest.raises(InvalidRequest, match=r"min_tokens must be in \[0, max_new_tokens=4\], got 9"):
        parse_lmi_parameters({"max_new_tokens": 4, "min_tokens": 9}, LIMITS)
    assert parse_lmi_parameters({"max_new_tokens": 9, "min_tokens": 9}, LIMITS).min_tokens == 9


def test_defaults_are_inside_every_range() -> None:
    check_sampling(SamplingParams())
