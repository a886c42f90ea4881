"""The speculative guesses' cost gate (``handlers.engine.core.draft_gate``) and the scheduler's use of it."""

from __future__ import annotations

import pytest

from handlers.engine.core.draft_gate import DraftGate, DraftOdds
from handlers.engine.core.scheduler import Scheduler, SchedulerConfig
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.step_budget import StepFit
from rollcore.types import SamplingParams


def fitted(fixed: float, per_row: float) -> StepFit:
    """A fit made from steps of ``fixed + per_row x rows`` seconds (decode rows 1..32, a prefill now and then)."""
    fit = StepFit()
    for d in range(1, 33):
        p = 64 if d % 4 == 0 else 0
        fit.record(d, p, fixed + per_row * (d + p))
    assert fit.model is not None
    return fit


def odds_with(conditional: list[float], n: int = 1000) -> DraftOdds:
    """Odds that saw ``n`` drafts whose guess i stood with probability ``conditional[i]`` given the ones before."""
    odds = DraftOdds(len(conditional), window=10**9, prior=(0.0, 1e-9))
    reach = float(n)
    for i, c in enumerate(conditional):
        odds.checked[i], odds.confirmed[i] = reach, reach * c
        reach *= c
    return odds


def test_odds_count_the_guesses_checked_and_those_that_stood() -> None:
    odds = DraftOdds(4, prior=(0.0, 0.0))
    odds.record(drafted=4, accepted=2)  # guesses 1, 2 stood, 3 fell, 4 never reached
    odds.record(drafted=1, accepted=1)
    odds.record(drafted=3, accepted=0)
    assert odds.checked == [3, 1, 1, 0] and odds.confirmed == [2, 1, 0, 0]
    odds.checked[3] = 1.0  # (a position never reached has no share of its own)
    assert odds.standing() == pytest.approx([2 / 3, 2 / 3, 0.0, 0.0])


def test_odds_start_from_the_prior_and_fade() -> None:
    odds = DraftOdds(2, window=8)
    assert odds.standing() == [0.5, 0.25]
    for _ in range(100):
        odds.record(2, 2)
    assert odds.standing()[0] > 0.9 and odds.checked[0] <= 9  # halved each time it reached the window
    for _ in range(40):
        odds.record(2, 0)
    assert odds.standing()[0] < 0.1  # the text changed: the misses dominate soon


def test_guesses_shrink_as_rows_grow_dear() -> None:
    """Guess i pays while its chance to stand beats a row's share of the step's time per token: the whole draft
    where the weights' reading dominates, fewer as the batch's rows take over, none where rows are everything."""
    odds = odds_with([0.6, 0.8, 0.8, 0.8])  # standing: 0.6, 0.48, 0.384, 0.307
    batches = (1, 2, 4, 8, 16, 32)
    cheap = DraftGate(fitted(fixed=0.050, per_row=0.001), odds)  # reading the weights is most of a step
    assert [cheap(d) for d in batches] == [4, 4, 4, 4, 3, 2]
    slower = DraftGate(fitted(fixed=0.050, per_row=0.004), odds)  # a 135M model on one slow core
    assert [slower(d) for d in batches] == [4, 4, 3, 2, 1, 0]
    dear = DraftGate(fitted(fixed=0.002, per_row=0.004), odds)  # rows are the whole step
    assert [dear(d) for d in batches] == [0] * 6


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 32])
def test_the_gate_picks_the_most_tokens_per_second(d: int) -> None:
    """Against every draft length: the gate's choice makes at least as many expected tokens a second."""
    odds = odds_with([0.7, 0.6, 0.9, 0.5])
    fit = fitted(fixed=0.030, per_row=0.003)
    m = fit.model
    assert m is not None
    p = odds.standing()

    def rate(k: int) -> float:
        return d * (1 + sum(p[:k])) / (m.fixed + m.per_row * d * (1 + k))

    k = DraftGate(fit, odds)(d)
    assert rate(k) == max(rate(j) for j in range(5))


def test_no_guesses_until_the_step_cost_is_known() -> None:
    gate = DraftGate(StepFit(), DraftOdds(4))
    assert gate(1) == 0
    assert gate.as_dict()["guesses_at_batch"] == {"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0}


def three_decoding(config: SchedulerConfig) -> Scheduler:
    """A scheduler whose three sequences have prefilled and each holds one token to decode."""
    sched = Scheduler(config)
    seqs = [Sequence(f"s{i}", [1, 2, 1], SamplingParams(max_new_tokens=20)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    sched.commit(sched.schedule())
    for seq in seqs:
        seq.append_token(2)
    return sched


def test_the_scheduler_cuts_each_draft_to_the_gates_length() -> None:
    sched = three_decoding(SchedulerConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64))
    asked: list[int] = []
    sched.drafter = lambda s: [1, 2, 1, 2]
    sched.draft_length = lambda d: asked.append(d) or 2
    plan = sched.schedule()
    assert asked == [3] and [len(c.draft) for c in plan.chunks] == [2, 2, 2]

    called: list[Sequence] = []
    sched2 = Scheduler(SchedulerConfig(block_size=4, num_blocks=64))
    sched2.add(Sequence("x", [1, 2, 1], SamplingParams(max_new_tokens=20)))
    sched2.commit(sched2.schedule())
    sched2.running[0].append_token(2)
    sched2.drafter = lambda s: called.append(s) or [1, 2]
    sched2.draft_length = lambda d: 0
    (chunk,) = sched2.schedule().chunks
    assert chunk.draft == () and called == []  # no guesses asked for: a paused drafter keeps its count


def test_the_prefill_bound_sees_streams_not_guess_rows() -> None:
    """Three decoding sequences with two guesses each beside five waiting prompts: the prefill bound is told 9 rows
    and 3 streams (rows as streams made a burst's waiting requests look outnumbered by the guesses)."""
    sched = three_decoding(SchedulerConfig(block_size=4, num_blocks=256, max_num_batched_tokens=256,
                                           max_prefill_tokens_while_decoding=64))
    for i in range(5):
        sched.add(Sequence(f"w{i}", [3] * 10, SamplingParams(max_new_tokens=4)))
    asked: list[tuple[int, int, int, int]] = []
    sched.drafter = lambda s: [1, 2, 1, 2]
    sched.draft_length = lambda d: 2
    sched.prefill_limit = lambda rows, cap, waiting, decoding: asked.append((rows, cap, waiting, decoding)) or 20
    plan = sched.schedule()
    assert asked == [(9, 64, 5, 3)]
    assert sorted(c.num_tokens for c in plan.chunks if c.seq.request_id.startswith("w")) == [10, 10]
