"""The time bound on a mixed step's prefill (``handlers.engine.core.step_budget``) and the scheduler's use of it."""

from __future__ import annotations

import random

import pytest

from handlers.engine.core.scheduler import Scheduler, SchedulerConfig
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.step_budget import PrefillBudget, StepFit
from rollcore.types import SamplingParams

FIXED, PER_ROW, PER_TOKEN = 0.050, 0.004, 0.0035  # seconds: a 135M-class model on one CPU core


def cost(d: int, p: int) -> float:
    return FIXED + PER_ROW * d + PER_TOKEN * p


def test_fit_recovers_the_three_costs_from_mixed_steps() -> None:
    """Steps that mix decode rows and prompt tokens in varying amounts give back the model's three costs."""
    budget = PrefillBudget(ratio=2.0, floor=16)
    rng = random.Random(0)
    for _ in range(40):
        d, p = rng.randint(1, 32), rng.choice([0, 16, 64, 256])
        budget.fit.record(d, p, cost(d, p))
    m = budget.model
    assert m is not None
    assert (m.fixed, m.per_row, m.per_token) == pytest.approx((FIXED, PER_ROW, PER_TOKEN), rel=1e-6)


def test_limit_makes_a_mixed_step_last_ratio_decode_steps() -> None:
    budget = PrefillBudget(ratio=2.0, floor=1)
    rng = random.Random(1)
    for _ in range(40):
        d, p = rng.randint(1, 32), rng.choice([0, 32, 128])
        budget.fit.record(d, p, cost(d, p))
    for d in (1, 8, 32):
        tokens = budget.limit(d, cap=0)
        assert tokens == int((cost(d, 0)) / PER_TOKEN)  # ratio 2: the prefill costs one more decode step
        assert cost(d, tokens) <= 2 * cost(d, 0) < cost(d, tokens + 1)
    assert budget.limit(8, cap=20) == 20  # never above the token cap
    three = PrefillBudget(ratio=3.0, floor=1)
    for _ in range(40):
        d, p = rng.randint(1, 32), rng.choice([0, 32, 128])
        three.fit.record(d, p, cost(d, p))
    assert three.limit(8, cap=0) == int(2 * cost(8, 0) / PER_TOKEN)


def test_more_waiting_than_decoding_grows_the_allowance() -> None:
    """A burst: 24 requests wait for their first token beside 8 decoding streams, so the prefill may take three
    times the time it would with none waiting; with fewer waiting than decoding, the ratio alone."""
    budget = PrefillBudget(ratio=4.0, floor=1)
    rng = random.Random(3)
    for _ in range(40):
        d, p = rng.randint(1, 32), rng.choice([0, 32, 128])
        budget.fit.record(d, p, cost(d, p))
    alone = budget.limit(8, cap=0)
    assert alone == int(3 * cost(8, 0) / PER_TOKEN)
    assert budget.limit(8, cap=0, waiting=4) == alone
    assert budget.limit(8, cap=0, waiting=24) == int(3 * 3 * cost(8, 0) / PER_TOKEN)
    assert budget.limit(8, cap=100, waiting=24) == 100


def test_guess_rows_do_not_count_as_streams() -> None:
    """Four sequences carrying seven guesses each are 32 rows but four streams: beside 28 waiting requests the
    allowance grows sevenfold over the rows' decode time (counting rows as streams gave no growth at all)."""
    budget = PrefillBudget(ratio=4.0, floor=1)
    rng = random.Random(4)
    for _ in range(40):
        d, p = rng.randint(1, 32), rng.choice([0, 32, 128])
        budget.fit.record(d, p, cost(d, p))
    seven = 3 * 7 * cost(32, 0) / PER_TOKEN  # the fit is exact to ~1e-9, so a token either side of the floor
    assert budget.limit(32, cap=0, waiting=28, decoding=4) in (int(seven) - 1, int(seven))
    assert budget.limit(32, cap=0, waiting=28) in (int(seven / 7) - 1, int(seven / 7))


def test_cap_until_fitted_and_floor_after() -> None:
    budget = PrefillBudget(ratio=1.5, floor=16)
    assert budget.limit(4, cap=256) == 256 and budget.limit(4, cap=0) == 0  # nothing measured: the cap alone
    for d in range(1, 9):  # prompt tokens cost far more than a decode step: the bound would be 0 tokens
        budget.fit.record(d, 0, 0.001 * d)
        budget.fit.record(d, 64, 0.001 * d + 64 * 1.0)
    assert budget.limit(4, cap=256) == 16  # a prompt still moves


def test_collinear_steps_fall_back_to_one_line() -> None:
    """A burst where every step carried rows and prompt tokens in the same proportion: one line over all rows."""
    budget = PrefillBudget(ratio=2.0, floor=1)
    for d in range(1, 12):
        budget.fit.record(d, 10 * d, 0.01 + 0.001 * 11 * d)
    m = budget.model
    assert m is not None and m.per_row == m.per_token == pytest.approx(0.001)
    assert m.fixed == pytest.approx(0.01)


def test_old_steps_fade() -> None:
    """After the machine slows down threefold, the fit follows within a couple of windows."""
    budget = PrefillBudget(ratio=2.0, floor=1, fit=StepFit(window=32))
    rng = random.Random(2)
    for slow in (1.0, 3.0):
        for _ in range(200):
            d, p = rng.randint(1, 32), rng.choice([0, 32, 128])
            budget.fit.record(d, p, slow * cost(d, p))
    m = budget.model
    assert m is not None and m.per_token == pytest.approx(3 * PER_TOKEN, rel=1e-3)


def test_ratio_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="ratio must be > 1"):
        PrefillBudget(ratio=1.0, floor=16)


def test_scheduler_chunks_a_prompt_by_the_limit_while_decodes_run() -> None:
    """The scheduler asks the limit with the decode rows it planned; alone, a prompt takes the whole budget."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, block_size=16, num_blocks=512,
                                      max_prefill_tokens_while_decoding=256))
    asked: list[tuple[int, int, int, int]] = []

    def limit(decode_rows: int, cap: int, waiting: int, decoding: int) -> int:
        asked.append((decode_rows, cap, waiting, decoding))
        return 40 * decode_rows

    sched.prefill_limit = limit
    decoding = [Sequence(f"d{i}", list(range(10 * i, 10 * i + 20)), SamplingParams(max_new_tokens=100))
                for i in range(2)]
    for s in decoding:
        sched.add(s)
    out = sched.schedule()
    assert sorted(c.num_tokens for c in out.chunks) == [20, 20] and asked == []  # nothing decoded: no limit
    sched.commit(out)
    for s in decoding:
        s.append_token(1)
    sched.add(Sequence("long", list(range(1000, 1500)), SamplingParams(max_new_tokens=5)))
    sizes = []
    while True:
        out = sched.schedule()
        chunks = {c.seq.request_id: c.num_tokens for c in out.chunks}
        sched.commit(out)
        for s in decoding:
            s.append_token(1)
        if "long" not in chunks:
            break
        sizes.append(chunks["long"])
        if sum(sizes) == 500:
            break
    assert sizes == [80] * 6 + [20]
    assert asked[0] == (2, 256, 1, 2) and asked[-1] == (2, 256, 1, 2)  # "long" waits for its first token throughout


@pytest.mark.parametrize("value", ["0.5", "1"])
def test_a_ratio_of_one_or_less_is_refused_by_name(value: str) -> None:
    from handlers.engine.planning.engine_config import EngineConfig
    from rollcore.errors import ConfigError

    with pytest.raises(ConfigError, match=f"option.max_mixed_step_ratio = {value}"):
        EngineConfig.from_options({"max_mixed_step_ratio": value})
    assert EngineConfig.from_options({"max_mixed_step_ratio": "0"}).max_mixed_step_ratio == 0


def test_a_step_that_breaks_the_fit_keeps_the_last_good_one() -> None:
    """On a busy machine one slow step can make the least-squares slope negative; the bound stays on with the
    last fit instead of switching off."""
    b = PrefillBudget(4.0, floor=16, fit=StepFit(min_steps=4))
    for d in range(1, 9):
        b.fit.record(decode_rows=d, prompt_tokens=0, seconds=0.01 + 0.001 * d)
    good = b.model
    assert good is not None
    b.fit.record(decode_rows=40, prompt_tokens=0, seconds=0.0)  # a step "faster" than nothing: the slope turns negative
    assert b.model == good
