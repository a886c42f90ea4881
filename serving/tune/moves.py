"""Where a group's search goes next from its best configuration: a compass search (each knob doubled or
halved, the way the missed bound points first) and a jump to the prefill budget the group's step-cost line
allows (``rollcore.step_cost``: a step's seconds as fixed + per-token cost, measured on the group's server)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from rollcore.step_cost import StepCost
from serving.bench.run_metrics import Slo
from serving.tune.racing import Outcome
from serving.tune.runs import missed_bounds
from serving.tune.space import Group, clipped_knobs, knobs_of, make_config

# The share of a decode bound (ITL, TPOT) that the longest step may take by the step-cost line: the rest is
# the line's error (attention grows with the context, which it averages) and the way from the engine to the
# client (the worker's pipe, the frontend's streaming).
STEP_SHARE = 0.8
# The knee of the step-cost line: the token budget at which the fixed part (reading every weight once) is 10%
# of a step. A CPU's matmuls are compute-bound from a few dozen rows on, so a step 10x the knee computes its
# tokens at most 10% cheaper while every running sequence waits the whole step (benchmarks/HISTORY.md, tune
# quality: the 110M model's best budget for both SLOs was near its knee, the folder's 2048 far behind).
KNEE = 9


@dataclass(frozen=True)
class Evidence:
    """A group's best measured configuration's knobs (clipped to their ranges), and whether its lowest failing
    run above its passing rung missed a decode bound (ITL, TPOT)."""

    knobs: dict[str, int]
    decode_bound: bool


@dataclass(frozen=True)
class LineMove:
    knobs: dict[str, int]
    tokens: int
    note: str  # the line and why this budget, as the tune logs it


def evidence(outcomes: Iterable[Outcome], g: Group, slo: Slo, stream: bool) -> Evidence | None:
    """``g``'s evidence (None when nothing was measured in ``g``)."""
    os_ = [o for o in outcomes if o.config.group == g]
    if not os_:
        return None
    best = max(os_, key=lambda o: (o.rung, o.score))
    failing = sorted((r for r in best.runs if r.rung > best.rung and not r.met(slo)), key=lambda r: r.rung)
    decode = bool(failing) and bool(missed_bounds(failing[0], slo, stream) & {"itl", "tpot"})
    return Evidence(clipped_knobs(best.config), decode)


def fitted_move(cost: StepCost | None, slo: Slo, params: dict[str, int]) -> LineMove | None:
    """A rolling group's token budget cut to what its step-cost line says is worth a step: at most the knee
    (``KNEE``), and with a decode bound (ITL, TPOT) in the SLO, what a step may compute within ``STEP_SHARE``
    of the tightest one. One trial where halving the budget a measured run at a time takes several. None
    without a line, or when the budget is already below that (or the server never ran a step that long); the
    sequences are halved as well when the running ones alone would fill the step."""
    line = None if cost is None else cost.fit()
    if cost is None or line is None:
        return None
    seqs_knob, tokens_knob = (k.name for k in knobs_of("rolling"))
    fixed, per_token = line
    knee = math.ceil(KNEE * fixed / per_token - 1e-6)  # 1e-6: a whole number of tokens stays whole
    limits = [b.limit_s for b in slo.bounds if b.metric in ("itl", "tpot")]
    fit = cost.tokens_within(STEP_SHARE * min(limits)) if limits else None
    tokens = knee if fit is None else min(knee, fit)
    if tokens >= params[tokens_knob] or tokens >= cost.max_tokens:
        return None
    seqs = params[seqs_knob]
    if tokens < 2 * seqs:  # room for the decodes and a prefill chunk as large as them
        seqs = max(1, tokens // 2)
    bound = "" if fit is None else f", {fit} fit {STEP_SHARE:.0%} of {1000 * min(limits):g} ms"
    note = (f"{1000 * fixed:.1f} ms + {1000 * per_token:.3f} ms a token ({cost.steps} steps, up to "
            f"{cost.max_tokens} tokens): knee {knee} tokens{bound}")
    return LineMove({**params, seqs_knob: seqs, tokens_knob: tokens}, tokens, note)


def compass(g: Group, ev: Evidence, fitted: LineMove | None) -> list[dict[str, int]]:
    """The neighbours of ``g``'s best configuration, the most promising first by the bound its best missed.

    * A decode bound (ITL, TPOT) missed: the running sequences waited on the step. Rolling: a smaller prefill
      budget first (a prefill chunk stalls every running decode), then fewer sequences; dynamic: a smaller
      ``batch_size`` first.
    * Otherwise (TTFT, E2E: the requests queued), or no failing run: a bigger batch first, for a rolling
      group both the sequences and the prefill tokens, then each alone.
    Before all of them, for a rolling group whose step-cost line is measured, the line's budget. The other
    directions follow (benchmarks/HISTORY.md, tune quality: a TTFT-bound SLO wanted a bigger prefill budget than
    the folder's, a tight ITL one a far smaller one)."""
    params = ev.knobs
    first, second = (k.name for k in knobs_of(g.mode))  # sequences / batch; prefill tokens / delay

    def moved(**factors: float) -> dict[str, int]:
        out = dict(params)
        for name, f in factors.items():
            out[name] = int(out[name] * f)
            if name == "max_batch_delay" and f > 1 and params[name] == 0:
                out[name] = 10  # doubling a delay of 0 ms: 10 ms
        return out

    if g.mode == "rolling":
        up = [moved(**{first: 2, second: 2}), moved(**{second: 2}), moved(**{first: 2})]
        down = [moved(**{second: 0.5}), moved(**{first: 0.5})]
        if fitted is not None:  # the line's budget first, whichever bound was missed
            up.insert(0, fitted.knobs)
            down.insert(0, fitted.knobs)
    else:
        up = [moved(**{first: 2}), moved(**{second: 0.5}), moved(**{second: 2})]
        down = [moved(**{first: 0.5})]
    here = make_config(g, params)
    out: list[dict[str, int]] = []
    for m in (down + up if ev.decode_bound else up + down):
        c = make_config(g, m)
        if c != here and all(dict(c.knobs) != x for x in out):
            out.append(dict(c.knobs))
    return out
