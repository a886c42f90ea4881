"""``serving bench`` metrics against hand-computed values: vLLM's TTFT/TPOT/ITL/E2E, throughput, SLO and
goodput rules, the tuner's early-stop test, the Pareto front and the budget syntax."""

from __future__ import annotations

import pytest

from serving.bench.plots import pareto_front
from serving.bench.run_metrics import Rec, RunResult, metrics, parse_duration, parse_slo
from serving.tune.costs import parse_budget
from serving.tune.runs import certainly_violated


def recs() -> list[Rec]:
    # r1: sent at 0, tokens at 0.1, 0.2, 0.4 -> TTFT 0.1, E2E 0.4, TPOT (0.4 - 0.1) / 2 = 0.15, gaps 0.1, 0.2
    # r2: sent at 0.5, tokens at 0.8, 0.9, done 1.0 -> TTFT 0.3, E2E 0.5, TPOT (1.0 - 0.8) / 1 = 0.2, gap 0.1
    # r3: failed
    return [Rec(0.0, [0.1, 0.2, 0.4], end=0.4), Rec(0.5, [0.8, 0.9], end=1.0), Rec(1.0, error="HTTP 503: busy")]


def test_metrics_match_hand_computed_values() -> None:
    m = metrics(RunResult(recs()), [3, 2, 4])
    assert (m["completed"], m["failed"], m["wrong_lengths"], m["errors"]) == (2, 1, 0, ["HTTP 503: busy"])
    assert m["wall_s"] == pytest.approx(1.0)  # last completion (1.0) - first send (0)
    assert m["output_tokens"] == 5
    assert m["output_tok_s"] == pytest.approx(5.0)
    assert m["request_s"] == pytest.approx(2.0)
    # TTFT [0.1, 0.3]: p90 = 0.1 + 0.2 x 0.9 (linear interpolation between closest ranks)
    assert m["ttft_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298})
    # ITL pooled [0.1, 0.1, 0.2]: p50 = 0.1, p90 at rank 1.8 = 0.18, p99 at rank 1.98 = 0.198
    assert m["itl_ms"] == pytest.approx({"mean": 400 / 3, "p50": 100, "p90": 180, "p99": 198})
    assert m["tpot_ms"] == pytest.approx({"mean": 175, "p50": 175, "p90": 195, "p99": 199.5})
    assert m["e2e_ms"] == pytest.approx({"mean": 450, "p50": 450, "p90": 490, "p99": 499})
    assert "goodput_req_s" not in m


def test_wrong_lengths_count_completed_requests_only() -> None:
    m = metrics(RunResult(recs()), [4, 2, 9])
    assert m["wrong_lengths"] == 1


def test_goodput_counts_requests_meeting_every_bound() -> None:
    slo = parse_slo("ttft_p99=350ms,itl_p99=250ms")
    m = metrics(RunResult(recs()), [3, 2, 4], slo)
    # r1 (TTFT 100 ms, its own ITL p99 198 ms) and r2 (TTFT 300 ms, ITL 100 ms) meet it; r3 failed
    assert m["slo"]["good_requests"] == 2
    assert m["goodput_req_s"] == pytest.approx(2.0)
    assert m["slo"]["met"] is False  # a failed request: the run misses the SLO
    assert m["slo"]["values_ms"] == pytest.approx({"ttft_p99": 298, "itl_p99": 198})
    assert slo.run_meets(recs()[:2]) is True

    tight = parse_slo("ttft_p99=250ms,itl_p99=150ms")
    # r1: its ITL p99 (0.1 + 0.1 x 0.99 = 199 ms) > 150 ms; r2: TTFT 300 ms > 250 ms
    assert [tight.request_meets(r) for r in recs()] == [False, False, False]
    assert tight.run_meets(recs()[:2]) is False
    assert parse_slo("e2e_mean=450ms").run_meets(recs()[:2]) is True
    assert parse_slo("e2e_mean=449ms").run_meets(recs()[:2]) is False


def test_whole_answers_have_no_itl_and_ttft_is_e2e() -> None:
    whole = Rec(0.0, [2.0], end=2.0, n_out=16)
    assert (whole.ttft(), whole.e2e(), whole.itl()) == (2.0, 2.0, [])
    assert whole.tpot() == pytest.approx(0.0)
    slo = parse_slo("ttft_p99=3s,itl_p99=10ms")
    assert slo.request_meets(whole) and slo.run_meets([whole])


@pytest.mark.parametrize("spec,message", [
    ("", "the SLO is empty"),
    ("ttft_p99", "SLO term 'ttft_p99': expected METRIC_STAT=DURATION"),
    ("latency_p99=2s", "SLO term 'latency_p99': the metric must be one of ttft, tpot, itl, e2e"),
    ("ttft_max=2s", "SLO term 'ttft_max': the metric must be one of ttft, tpot, itl, e2e"),
    ("ttft_p0=2s", "SLO term 'ttft_p0': the percentile must be in (0, 100]"),
    ("ttft_p99=2", "SLO term ttft_p99: '2' is not a duration: write a number with a unit, e.g. 2s or 200ms"),
    ("ttft_p99=0ms", "SLO term ttft_p99: the bound must be > 0"),
    ("ttft_p99=1s,ttft_p99=2s", "SLO term 'ttft_p99' is given twice"),
])
def test_bad_slo_is_refused_with_its_term(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_slo(spec)
    assert str(exc.value).startswith(message)


def test_slo_round_trip_and_units() -> None:
    slo = parse_slo(" TTFT_P99 = 2s , itl_p99.9=200ms,tpot_mean=0.05s")
    assert [(b.metric, b.stat, b.limit_s) for b in slo.bounds] == [("ttft", "p99", 2.0), ("itl", "p99.9", 0.2),
                                                                  ("tpot", "mean", 0.05)]
    assert str(slo) == "ttft_p99=2s,itl_p99.9=200ms,tpot_mean=50ms"
    assert parse_duration("1.5s", "x") == 1.5 and parse_duration("250ms", "x") == 0.25


def test_certainly_violated_counts_only_values_known_to_exceed() -> None:
    slo = parse_slo("ttft_p50=100ms")
    expected = [4, 4, 4, 4]
    # 4 requests: p50 (rank 1.5) exceeds 100 ms for sure once 3 TTFTs do (4 - floor(3 x 0.5) = 3)
    rs = [Rec(0.0, [0.5]), Rec(0.0, [0.5]), Rec(0.0), Rec(10.0)]
    assert not certainly_violated(slo, rs, expected, True, now=0.05)  # the waiting one is at 50 ms
    assert certainly_violated(slo, rs, expected, True, now=0.2)  # it waits 200 ms: a third TTFT over the bound
    # a request not sent yet counts for nothing
    assert not certainly_violated(slo, [Rec(0.0, [0.5]), Rec(0.0, [0.5]), Rec(1.0), Rec(1.0)], expected, True,
                                  now=0.5)
    # any failure misses the SLO
    assert certainly_violated(slo, [Rec(0.0, error="HTTP 500")], [4], True, now=0.0)
    # ITL: 2 requests of 3 tokens = 4 gaps; p99 (rank 2.97) is over once 4 - 2 = 2 gaps are (an open gap counts)
    itl = parse_slo("itl_p99=100ms")
    a, b = Rec(0.0, [0.01, 0.5]), Rec(0.0, [0.01, 0.02, 0.03], end=0.03)  # b is done: no open gap
    assert not certainly_violated(itl, [a, b], [3, 3], True, now=0.55)
    assert certainly_violated(itl, [a, b], [3, 3], True, now=0.7)  # a's open gap is 200 ms
    assert not certainly_violated(itl, [a, b], [3, 3], False, now=5.0)  # whole answers have no gaps


def test_pareto_front() -> None:
    pts = [(1.0, 50.0), (2.0, 80.0), (1.5, 90.0), (3.0, 200.0), (0.5, 40.0), (2.5, 300.0)]
    assert pareto_front(pts) == [(0.5, 40.0), (1.0, 50.0), (2.0, 80.0), (3.0, 200.0)]


@pytest.mark.parametrize("text,seconds", [("20m", 1200), ("90s", 90), ("1.5h", 5400), ("600", 600),
                                          ("2min", 120)])
def test_budget(text: str, seconds: float) -> None:
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "0"])
def test_bad_budget(text: str) -> None:
    with pytest.raises(ValueError, match="--budget"):
        parse_budget(text)
