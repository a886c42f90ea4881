"""The inter-token latency target on a real engine (built llama): derived at load, kept per step, set at run time,
greedy output unchanged."""

from __future__ import annotations

from pathlib import Path

from handlers.engine.core.itl_target import AUTO_DECODE_STEPS
from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams, TokenDelta
from tests.engine.conftest import make_prompts
from tests.engine.test_engine_greedy import MAX_NEW, check_against_generate


def test_the_auto_target_is_measured_at_load(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64"})
    itl = engine.stats()["itl_target"]
    assert itl["source"] == "auto" and itl["derived_ms"] > 0 and itl["max_itl_ms"] == itl["derived_ms"]
    model = engine.step_fit.model  # the calibration steps gave the step cost a first fit
    assert model is not None and model.per_token > 0
    # the default is the measured decode step of a full batch (32 rows), times AUTO_DECODE_STEPS
    assert itl["derived_ms"] == round(AUTO_DECODE_STEPS * itl["decode_step_ms"], 1)
    # the cache is as before: every block lent for the measurement came back
    assert engine.scheduler.allocator.num_free_blocks == 64 and engine.stats()["num_steps_total"] == 0
    set_at_load = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "max_itl_ms": "250"})
    assert set_at_load.stats()["itl_target"]["max_itl_ms"] == 250.0
    assert set_at_load.stats()["itl_target"]["source"] == "option"


def test_streams_stay_in_every_step_of_a_burst_and_greedy_output_is_unchanged(model_dirs: dict[str, Path]) -> None:
    """Two answers stream, then eight prompts arrive at once under a target no step can keep: every step still
    carries both streams (no pause) and a floor of prompt tokens (block_size, 16: the prompts are chunked); the
    steps over the target are counted; the answers are generate's."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "256", "max_itl_ms": "1000"})
    engine.configure(max_itl_ms=1)  # set at run time: from the next step on
    assert engine.stats()["itl_target"] | {"derived_ms": None, "decode_step_ms": None} == {
        "max_itl_ms": 1.0, "source": "API", "derived_ms": None, "decode_step_ms": None, "steps_over_total": 0,
        "seconds_over_total": 0.0, "max_gap_ms": 0.0, "margin": 1.0}
    prompts = make_prompts(10, seed=13)
    max_new = [60, 60] + [MAX_NEW] * 8
    deltas: dict[str, list[TokenDelta]] = {f"r{i}": [] for i in range(len(prompts))}
    for i in (0, 1):
        engine.add(f"r{i}", prompts[i], SamplingParams(max_new_tokens=max_new[i]))
    while len(deltas["r0"]) < 2:
        for d in engine.step():
            deltas[d.request_id].append(d)
    for i in range(2, len(prompts)):
        engine.add(f"r{i}", prompts[i], SamplingParams(max_new_tokens=MAX_NEW))
    waiting_tokens = sum(len(p) for p in prompts[2:])
    steps = 0
    while len(deltas["r0"]) < max_new[0]:
        got = set()
        for d in engine.step():
            deltas[d.request_id].append(d)
            got.add(d.request_id)
        steps += 1
        assert {"r0", "r1"} <= got  # both streams in every step
    assert steps >= min(max_new[0] - 2, waiting_tokens // 16)  # the floor: the burst's prompts took many steps
    while engine.has_work():
        for d in engine.step():
            deltas[d.request_id].append(d)
    check_against_generate(model_dirs["llama"], prompts, deltas, max_new)
    stats = engine.stats()
    assert stats["num_burst_paused_steps_total"] == 0
    assert stats["itl_over_target_steps_total"] > 0 and stats["itl_over_target_seconds_total"] > 0
    assert stats["itl_target"]["steps_over_total"] == stats["itl_over_target_steps_total"]
