"""``serving tune``'s space and report on hand-made runs: groups of a model folder, clipping, the measured
reasons written next to each chosen value."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.bench.run_metrics import Rec, parse_slo
from serving.config.model_config import load_model_config
from serving.tune.racing import Outcome, better
from serving.tune.report import annotated_properties, describe_outcome, knob_reasons
from serving.tune.runs import Run
from serving.tune.space import Config, Group, build_space, make_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "models" / "tiny-llama"
SLO = parse_slo("ttft_p99=1s,itl_p99=100ms")


def test_space_of_the_default_model() -> None:
    space = build_space(TINY, cores=4)
    # the folder: workers=auto (resolved from this process's cores), option.num_threads=auto (the given cores
    # shared by the workers)
    w = load_model_config(TINY).max_workers
    assert space.baseline == Config(Group("rolling", w, 4 // w), (("max_rolling_batch_size", 32),
                                                                  ("max_rolling_batch_prefill_tokens", 2048)))
    every = ["rolling 1w x 4t", "rolling 2w x 2t", "rolling 4w x 1t", "dynamic 1w x 4t", "dynamic 2w x 2t",
             "dynamic 4w x 1t"]
    base = space.baseline.group.label
    assert [g.label for g in space.groups] == [base] + [g for g in every if g != base]
    # the folder sets the rolling knobs (seeds keep them); dynamic ones are defaults (seeds: 8 requests, 50 ms)
    assert space.seeds[Group("rolling", 1, 4)].knobs == space.baseline.knobs
    assert space.seeds[Group("dynamic", 1, 4)].knobs == (("batch_size", 8), ("max_batch_delay", 50))
    only = build_space(TINY, modes=("dynamic",), workers=(1,), cores=4)
    assert [g.label for g in only.groups] == [base, "dynamic 1w x 4t"]
    assert build_space(TINY, cores=1).baseline.group == Group("rolling", w, 1)  # never fewer than 1 thread


def test_make_config_clips_and_keeps_a_token_per_sequence() -> None:
    c = make_config(Group("rolling", 1, 2), {"max_rolling_batch_size": 500, "max_rolling_batch_prefill_tokens": 3})
    assert c.knobs == (("max_rolling_batch_size", 64), ("max_rolling_batch_prefill_tokens", 64))
    c = make_config(Group("rolling", 1, 2), {"max_rolling_batch_size": 48, "max_rolling_batch_prefill_tokens": 10})
    assert dict(c.knobs)["max_rolling_batch_prefill_tokens"] == 64
    c = make_config(Group("rolling", 1, 2), {"max_rolling_batch_size": 64, "max_rolling_batch_prefill_tokens": 64})
    assert c.properties() == {"option.rolling_batch": "auto", "minWorkers": "1", "maxWorkers": "1",
                              "option.num_threads": "2", "option.max_rolling_batch_size": "64",
                              "option.max_rolling_batch_prefill_tokens": "64"}


def run(config: Config, rung: int, rate: float, ttft: float, gap: float) -> Run:
    # 4 requests, 3 tokens each, sent 1 s apart: TTFT ``ttft``, gaps ``gap``
    recs = [Rec(float(i), [i + ttft, i + ttft + gap, i + ttft + 2 * gap], end=i + ttft + 2 * gap) for i in range(4)]
    return Run(config, rung, rate, recs, [3] * 4, 5.0, False, 3 + ttft + 2 * gap)


def test_reasons_and_annotated_properties() -> None:
    g = Group("rolling", 1, 2)
    small = make_config(g, {"max_rolling_batch_size": 8, "max_rolling_batch_prefill_tokens": 512})
    big = make_config(g, {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 2048})
    dyn = make_config(Group("dynamic", 1, 2), {"batch_size": 4, "max_batch_delay": 20})
    a = run(small, 2, 1.0, 0.2, 0.05)  # meets the SLO at rung 2
    b = run(big, 3, 1.5, 0.3, 0.25)  # misses it at rung 3: ITL 250 ms
    chosen = Outcome(small, a, [a], a.goodput(SLO))
    other = Outcome(big, None, [b], b.goodput(SLO) * b.slack(SLO))
    unmeasured = Outcome(dyn, None, [], 0.0)
    assert a.met(SLO) and not b.met(SLO)
    assert a.goodput(SLO) == pytest.approx(4 / 3.3)  # every request good over 3.3 s
    assert better(chosen, other, SLO) and not better(other, chosen, SLO)
    assert describe_outcome(chosen, SLO, []) == ("goodput 1.21 req/s meeting the SLO at 1 req/s offered "
                                                 "(ttft_p99 200 ms, itl_p99 50 ms)")
    assert describe_outcome(other, SLO, []) == "misses the SLO at 1.5 req/s (itl_p99 250 ms > 100ms)"
    assert describe_outcome(unmeasured, SLO, []) == "not measured (budget)"
    reasons = knob_reasons(chosen, [chosen, other, unmeasured], SLO, [])
    assert reasons == {
        "mode": "no other value measured", "workers": "no other value measured",
        "threads": "no other value measured",
        "max_rolling_batch_size": "best with max_rolling_batch_size=32: misses the SLO at 1.5 req/s "
                                  "(itl_p99 250 ms > 100ms)",
        "max_rolling_batch_prefill_tokens": "best with max_rolling_batch_prefill_tokens=2048: misses the SLO at "
                                            "1.5 req/s (itl_p99 250 ms > 100ms)"}
    text = annotated_properties(TINY, chosen, reasons, ["header one", "header two"])
    lines = text.splitlines()
    assert lines[:2] == ["# header one", "# header two"]
    assert "engine=Python" in lines and "option.enable_prefix_caching=true" in lines
    i = lines.index("option.max_rolling_batch_size=8")
    assert lines[i - 1] == ("# max_rolling_batch_size: best with max_rolling_batch_size=32: misses the SLO at "
                            "1.5 req/s (itl_p99 250 ms > 100ms)")
    assert lines[lines.index("option.num_threads=2") - 1] == "# threads: no other value measured"
    assert lines.count("minWorkers=1") == 1 and lines.count("maxWorkers=1") == 1
