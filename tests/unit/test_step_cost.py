"""``rollcore.step_cost.StepCost``: the sums an engine reports, merged, differenced and fitted to a line."""

from __future__ import annotations

import pytest

from rollcore.step_cost import StepCost


def line(steps: list[int], fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    for tokens in steps:
        cost.add(tokens, fixed + per_token * tokens)
    return cost


def test_fit_recovers_the_line_and_the_tokens_within_a_time() -> None:
    cost = line([10, 40, 10, 256, 33, 180, 10, 12], fixed=0.040, per_token=0.0018)
    fixed, slope = cost.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.040) and slope == pytest.approx(0.0018)
    assert cost.max_tokens == 256 and cost.steps == 8
    assert cost.tokens_within(0.4) == 200  # (0.4 - 0.04) / 0.0018
    assert cost.tokens_within(0.01) == 0  # not even an empty step fits
    assert cost.as_dict() == {"steps": 8, "tokens": 551, "seconds": pytest.approx(8 * 0.04 + 0.0018 * 551),
                              "tokens_sq": sum(t * t for t in [10, 40, 10, 256, 33, 180, 10, 12]),
                              "tokens_seconds": pytest.approx(sum(t * (0.04 + 0.0018 * t)
                                                                  for t in [10, 40, 10, 256, 33, 180, 10, 12])),
                              "max_tokens": 256}


def test_no_line_from_too_few_steps_equal_steps_or_a_falling_slope() -> None:
    assert line([10, 200, 30], 0.04, 0.002).fit() is None  # 3 steps < 8
    assert line([32] * 20, 0.04, 0.002).fit() is None  # every step the same size: no slope to see
    assert line([10, 200, 30, 50, 60, 70, 80, 90], 0.5, -0.001).fit() is None
    assert StepCost().tokens_within(1.0) is None
    assert line([10, 200, 30], 0.04, 0.002).fit(min_steps=3) is not None


def test_sums_merge_workers_and_difference_snapshots() -> None:
    a = line([10, 200, 30, 50], 0.04, 0.002)
    b = line([20, 100, 60, 70], 0.04, 0.002)
    both = a + b
    assert both.steps == 8 and both.tokens == 540 and both.max_tokens == 200
    assert both.fit() == pytest.approx((0.04, 0.002))
    later = StepCost(**a.as_dict())  # type: ignore[arg-type]
    for t in (100, 300, 20):
        later.add(t, 0.04 + 0.002 * t)
    since = later - a
    assert (since.steps, since.tokens, since.max_tokens) == (3, 420, 300)
    assert since.fit(min_steps=3) == pytest.approx((0.04, 0.002))


@pytest.mark.parametrize("data", [None, {}, {"steps": 1}, {"steps": "x", "tokens": 1, "seconds": 1, "tokens_sq": 1,
                                                            "tokens_seconds": 1, "max_tokens": 1}, [1, 2]])
def test_malformed_sums_read_as_none(data: object) -> None:
    assert StepCost.from_dict(data) == StepCost()  # type: ignore[arg-type]


def test_round_trip() -> None:
    cost = line([10, 200, 30], 0.04, 0.002)
    assert StepCost.from_dict(cost.as_dict()) == cost
