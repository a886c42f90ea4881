"""compare.py's --arrivals-from: the tail of a seeded Poisson pass, sent at the same offsets as in the full pass."""

import pytest

from benchmarks.compare import arrivals_from
from serving.bench.workload import BenchRequest, Workload


def workload(n: int) -> Workload:
    return Workload(tuple(BenchRequest(i, f"p{i}", (1, i + 2), 8 + i) for i in range(n)), seed=0)


def test_the_tail_keeps_its_requests_and_their_gaps():
    w = workload(12)
    full = w.arrivals(0.5)
    start = full[7]
    tail, offsets = arrivals_from(w, 0.5, start - 1e-9)
    assert [r.index for r in tail.requests] == list(range(7, 12))
    assert offsets[0] == 0.0
    assert offsets == pytest.approx([t - start for t in full[7:]])


def test_zero_is_the_whole_pass_and_too_late_is_an_error():
    w = workload(5)
    same, offsets = arrivals_from(w, 0.5, 0.0)
    assert same is w and offsets == w.arrivals(0.5)
    with pytest.raises(SystemExit, match="no request arrives that late"):
        arrivals_from(w, 0.5, 1e6)
