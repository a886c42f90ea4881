"""What one benchmark run measured, with vLLM's definitions (benchmark_serving), and the SLO / goodput rules.

* **TTFT** = send to first token; **E2E** = send to the last token or byte; "send" is a request's scheduled
  arrival time, so time spent queueing counts. A whole (non-streamed) answer arrives at once: its TTFT is its E2E.
* **ITL** = every gap between consecutive tokens (chunks), pooled over requests; **TPOT** = (E2E - TTFT) /
  (output tokens - 1) per request with more than one token.
* **output tokens/s** = total output tokens / duration, **request throughput** = completed / duration, where
  duration = last completion - first send.
* **goodput** = requests meeting the SLO / duration (vLLM's ``--goodput``). Statistics: mean, p50, p90, p99
  (linear interpolation between closest ranks, as numpy's default).

An SLO is a list of bounds such as ``ttft_p99=2s,itl_p99=200ms`` (metrics ``ttft``, ``tpot``, ``itl``,
``e2e``; statistic ``pNN`` or ``mean``; unit ``s`` or ``ms``). A *run meets the SLO* when no request failed
and every bound holds for the run's statistic (TTFT p99 over requests, ITL p99 over all pooled gaps). A
*request meets the SLO* (it counts toward goodput) when it completed and every bound holds for its own
value: its TTFT, TPOT and E2E, and the same statistic of its own ITL gaps (its p99 gap for ``itl_p99``);
a bound on a value the request does not have (TPOT or ITL of a one-token or whole answer) holds.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

STATS = ("mean", "p50", "p90", "p99")
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class Rec:
    """What one request saw. Times are ``time.perf_counter`` seconds."""

    send: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    n_out: int | None = None  # output tokens (when chunks may carry more than one token, or a whole answer)
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.n_out if self.n_out is not None else len(self.token_times)

    @property
    def done(self) -> float:
        return self.end if self.end is not None else self.token_times[-1]

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    def ttft(self) -> float:
        return self.token_times[0] - self.send

    def e2e(self) -> float:
        return self.done - self.send

    def tpot(self) -> float | None:
        n = self.num_tokens
        return (self.done - self.token_times[0]) / (n - 1) if n > 1 else None

    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass
class RunResult:
    recs: list[Rec]
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (0-100), linear interpolation between closest ranks; NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats_ms(xs: list[float]) -> dict[str, float]:
    """Mean, p50, p90, p99 of ``xs`` (seconds) in milliseconds; NaN when empty."""
    if not xs:
        return {k: float("nan") for k in STATS}
    out = {"mean": 1000 * statistics.fmean(xs)}
    out.update({f"p{q}": 1000 * percentile(xs, q) for q in (50, 90, 99)})
    return out


# --------------------------------------------------------------------------------------------------- SLO
@dataclass(frozen=True)
class Bound:
    """One SLO bound: ``metric`` (ttft, tpot, itl, e2e) at ``stat`` (``mean`` or a percentile) <= ``limit_s``."""

    metric: str
    stat: str  # "mean" or "pNN" (NN may have decimals: p99.9)
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    def of(self, xs: list[float]) -> float:
        """This bound's statistic of ``xs`` (seconds); NaN when empty."""
        if not xs:
            return float("nan")
        return statistics.fmean(xs) if self.stat == "mean" else percentile(xs, float(self.stat[1:]))

    def __str__(self) -> str:
        return f"{self.key}={format_duration(self.limit_s)}"


_BOUND = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<stat>mean|p\d+(?:\.\d+)?)$")
_DURATION = re.compile(r"^(?P<num>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>ms|s)$")


def parse_duration(text: str, what: str) -> float:
    """``'2s'``, ``'200ms'``, ``'1.5s'`` -> seconds. Raises ``ValueError`` naming ``what``."""
    m = _DURATION.match(text.strip().lower())
    if not m:
        raise ValueError(f"{what}: {text!r} is not a duration: write a number with a unit, e.g. 2s or 200ms")
    value = float(m["num"])
    return value / 1000 if m["unit"] == "ms" else value


def format_duration(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:g}ms" if ms < 1000 else f"{seconds:g}s"


@dataclass(frozen=True)
class Slo:
    bounds: tuple[Bound, ...]

    def __str__(self) -> str:
        return ",".join(str(b) for b in self.bounds)

    def run_values(self, recs: list[Rec]) -> dict[str, float]:
        """Each bound's statistic over the run's completed requests (seconds)."""
        ok = [r for r in recs if r.ok]
        return {b.key: b.of(_run_samples(b.metric, ok)) for b in self.bounds}

    def run_meets(self, recs: list[Rec]) -> bool:
        """No request failed and every bound holds for the run's statistic."""
        if not recs or any(not r.ok for r in recs):
            return False
        values = self.run_values(recs)
        return all(not (values[b.key] > b.limit_s) for b in self.bounds)  # NaN (no samples) holds

    def request_meets(self, rec: Rec) -> bool:
        if not rec.ok:
            return False
        for b in self.bounds:
            v = b.of(rec.itl()) if b.metric == "itl" else _request_value(b.metric, rec)
            if v is not None and not math.isnan(v) and v > b.limit_s:
                return False
        return True


def _request_value(metric: str, rec: Rec) -> float | None:
    if metric == "ttft":
        return rec.ttft()
    if metric == "e2e":
        return rec.e2e()
    return rec.tpot()


def _run_samples(metric: str, ok: list[Rec]) -> list[float]:
    if metric == "itl":
        return [g for r in ok for g in r.itl()]
    return [v for r in ok if (v := _request_value(metric, r)) is not None]


def parse_slo(text: str | dict[str, Any]) -> Slo:
    """``"ttft_p99=2s,itl_p99=200ms"`` (or a mapping of the same) -> ``Slo``. Raises ``ValueError``."""
    if isinstance(text, dict):
        items = [(str(k), str(v)) for k, v in text.items()]
    else:
        items = []
        for part in str(text).split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"SLO term {part.strip()!r}: expected METRIC_STAT=DURATION, e.g. ttft_p99=2s")
            items.append((key, value))
    if not items:
        raise ValueError("the SLO is empty: give bounds such as ttft_p99=2s,itl_p99=200ms")
    bounds: list[Bound] = []
    for key, value in items:
        key = key.strip().lower()
        m = _BOUND.match(key)
        if not m or m["metric"] not in SLO_METRICS:
            raise ValueError(f"SLO term {key!r}: the metric must be one of {', '.join(SLO_METRICS)} and the "
                             f"statistic mean or pNN, e.g. ttft_p99, itl_p90, tpot_mean, e2e_p50")
        if m["stat"] != "mean" and not 0 < float(m["stat"][1:]) <= 100:
            raise ValueError(f"SLO term {key!r}: the percentile must be in (0, 100]")
        limit = parse_duration(value, f"SLO term {key}")
        if limit <= 0:
            raise ValueError(f"SLO term {key}: the bound must be > 0")
        if any(b.key == key for b in bounds):
            raise ValueError(f"SLO term {key!r} is given twice")
        bounds.append(Bound(m["metric"], m["stat"], limit))
    return Slo(tuple(bounds))


# ------------------------------------------------------------------------------------------------ metrics
def metrics(result: RunResult, expected: list[int], slo: Slo | None = None) -> dict[str, Any]:
    """vLLM's metrics of one run (``expected``: each request's output length, to count wrong lengths)."""
    recs = result.recs
    ok = [r for r in recs if r.ok]
    errors = [r.error for r in recs if r.error is not None]
    if not ok:
        return {"completed": 0, "failed": len(recs), "errors": errors[:3], **result.extra}
    first_send = min(r.send for r in recs)
    wall = max(r.done for r in ok) - first_send
    out_tokens = sum(r.num_tokens for r in ok)
    wrong = sum(1 for r, n in zip(recs, expected, strict=True) if r.ok and r.num_tokens != n)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(recs) - len(ok), "errors": errors[:3], "wrong_lengths": wrong,
        "wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "request_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_ms": stats_ms([r.ttft() for r in ok]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot()) is not None]),
        "itl_ms": stats_ms([g for r in ok for g in r.itl()]),
        "e2e_ms": stats_ms([r.e2e() for r in ok])}
    if slo is not None:
        good = sum(1 for r in recs if slo.request_meets(r))
        out["slo"] = {"spec": str(slo), "met": slo.run_meets(recs), "good_requests": good,
                      "values_ms": {k: 1000 * v for k, v in slo.run_values(recs).items()}}
        out["goodput_req_s"] = good / wall if wall > 0 else 0.0
    return {**out, **result.extra}
