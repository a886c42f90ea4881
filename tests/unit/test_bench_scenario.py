"""Scenario files of ``serving bench``: parsing, the errors a bad file gets (file and key named), presets,
length distributions and the exact-length prompts built from the default model's tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from serving.bench.scenario import (
    Constant,
    LogNormal,
    Mixture,
    Normal,
    Rate,
    ScenarioError,
    Uniform,
    load_scenario,
    presets,
)
from serving.bench.workload import build_workload, load_tokenizer, prompt_of_length

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "models" / "tiny-llama"

FULL = """
name: mine
api: openai
stream: "false"
num_requests: 12
seed: 7
warmup: 0
prompt_len: {dist: normal, mean: 100, std: 20, min: 10, max: 300}
output_len:
  mixture:
    - {weight: 1, dist: constant, value: 5}
    - {weight: 3, dist: lognormal, median: 20, sigma: 0.5, max: 64}
arrival:
  - {process: burst}
  - {process: poisson, rate: 2.5, burstiness: 0.5}
  - {process: sweep, rates: {start: 0.5x, factor: 2, count: 3}}
slo: {ttft_p99: 2s, itl_p90: 50ms}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "scenario.yaml"
    p.write_text(text)
    return p


def test_full_scenario(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, FULL))
    assert (s.name, s.api, s.stream, s.num_requests, s.seed, s.warmup) == ("mine", "openai", "false", 12, 7, 0)
    assert s.prompt_len == Normal(100.0, 20.0, 10, 300)
    assert s.output_len == Mixture(((1.0, Constant(5)), (3.0, LogNormal(20.0, 0.5, 1, 64))))
    assert [p.label for p in s.passes] == ["burst", "poisson@2.5/s", "poisson@0.5x", "poisson@1x", "poisson@2x"]
    assert s.passes[1].burstiness == 0.5
    assert [p.sweep_index for p in s.passes] == [None, None, 0, 1, 2]
    assert str(s.slo) == "ttft_p99=2s,itl_p90=50ms"


def test_every_preset_loads() -> None:
    names = presets()
    assert names == ["bench-default", "chat", "sweep", "tune"]
    for name in names:
        s = load_scenario(name)
        assert s.source == f"preset {name}" and s.passes[0].process == "burst"
    tune = load_scenario("tune")
    assert [str(p.rate) for p in tune.passes[1:4]] == ["0.3x", "0.375x", "0.46875x"]


@pytest.mark.parametrize("text,message", [
    ("api: http", "api: expected one of lmi, openai, grpc, got 'http'"),
    ("num_request: 5", "scenario: unknown key(s) num_request (known: "),
    ("num_requests: 0", "num_requests: must be >= 1, got 0"),
    ("num_requests: ten", "num_requests: expected an integer, got 'ten'"),
    ("stream: maybe", "stream: expected auto, true or false, got 'maybe'"),
    ("prompt_len: {dist: uniform, min: 10, max: 5}", "prompt_len: min (10) must be <= max (5)"),
    ("prompt_len: {dist: uniform, max: 5}", "prompt_len: uniform needs min"),
    ("prompt_len: {dist: zipf, max: 5}", "prompt_len.dist: expected one of constant, uniform, normal, lognormal"),
    ("prompt_len: {dist: constant, value: 5, max: 9}", "prompt_len: constant takes value, not max"),
    ("output_len: {mixture: []}", "output_len.mixture: expected a non-empty list of weighted distributions"),
    ("output_len: {mixture: [{dist: constant, value: 3}]}", "output_len.mixture[0]: each component needs a weight"),
    ("arrival: {process: poisson}", "arrival: a poisson pass needs rate"),
    ("arrival: {process: burst, rate: 3}", "arrival: a burst pass takes no rate"),
    ("arrival: {process: trickle}", "arrival.process: expected one of burst, poisson, sweep, got 'trickle'"),
    ("arrival: [{process: poisson, rate: fast}]", "arrival[0].rate: 'fast' is not a rate"),
    ("arrival: {process: poisson, rate: -1}", "arrival.rate: must be > 0, got -1"),
    ("arrival: {process: sweep, rates: [2, 1]}", "arrival.rates: rates must increase"),
    ("arrival: {process: sweep, rates: [1, 2x]}", "arrival.rates: rates must increase and be all absolute or all"),
    ("arrival: {process: sweep, rates: {start: 1, factor: 1}}", "arrival.rates: a geometric sweep needs start, "
                                                                 "factor and count (missing count)"),
    ("slo: ttft_p99=fast", "slo: SLO term ttft_p99: 'fast' is not a duration"),
    ("[1, 2]", "scenario: expected a mapping, got list"),
    ("api: [unclosed", "not valid YAML"),
])
def test_bad_scenario_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value), str(exc.value)


def test_unknown_scenario_names_the_presets(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"'nope' is neither a scenario file nor a preset \(presets: "
                                            r"bench-default, chat, sweep, tune\)"):
        load_scenario("nope")
    with pytest.raises(ScenarioError, match="scenario file not found"):
        load_scenario(tmp_path / "missing.yaml")


def test_relative_rate_needs_a_burst_pass_first() -> None:
    with pytest.raises(ScenarioError, match=r"f.yaml: arrival: rate 0.5x is relative to a burst pass's "
                                            r"throughput, and no burst pass ran before it"):
        Rate(0.5, relative=True).resolve(None, "f.yaml: arrival")
    assert Rate(0.5, relative=True).resolve(8.0, "x") == 4.0
    assert Rate(3.0).resolve(None, "x") == 3.0


def test_mixture_draws_like_benchmarks_workload() -> None:
    # one random() picks the component (the first when u < its share), then the component draws
    mix = Mixture(((0.25, Uniform(128, 256)), (0.75, Uniform(8, 32))))
    a, b = random.Random(3), random.Random(3)
    for _ in range(200):
        lo, hi = (128, 256) if b.random() < 0.25 else (8, 32)
        assert mix.sample(a) == b.randint(lo, hi)
    assert mix.bounds() == (8, 256)


def test_clipped_distributions_stay_in_bounds() -> None:
    rng = random.Random(0)
    for d in (Normal(10.0, 50.0, 2, 30), LogNormal(10.0, 2.0, 3, 40)):
        xs = [d.sample(rng) for _ in range(500)]
        assert min(xs) == d.lo and max(xs) == d.hi


def test_prompts_have_exact_token_counts() -> None:
    tok = load_tokenizer(TINY)
    rng = random.Random(0)
    for target in (1, 2, 3, 17, 64, 255, 600):
        text, ids = prompt_of_length(tok, target, rng)
        assert len(ids) == target and tok.encode(text).ids == ids
    with pytest.raises(ValueError, match="a prompt of 0 tokens is impossible: this tokenizer adds 1 special"):
        prompt_of_length(tok, 0, rng)


def test_workload_is_reproducible_and_exact() -> None:
    tok = load_tokenizer(TINY)
    w1 = build_workload(tok, 10, 5, Uniform(4, 90), Uniform(2, 7))
    w2 = build_workload(tok, 10, 5, Uniform(4, 90), Uniform(2, 7))
    assert w1 == w2
    rng = random.Random(5)
    for r in w1.requests:
        assert (r.prompt_len, r.max_new_tokens) == (rng.randint(4, 90), rng.randint(2, 7))
        assert tok.encode(r.prompt).ids == list(r.prompt_token_ids)
        prompt_of_length(tok, r.prompt_len, rng)  # keeps this rng in step with the workload's
    assert w1.arrivals(None) == [0.0] * 10
    gaps = w1.arrivals(4.0)
    assert gaps[0] == 0.0 and gaps == sorted(gaps) and gaps != w1.arrivals(4.0, burstiness=0.5)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(REPO / "docs")


def test_fresh_workload_keeps_lengths_and_arrivals_with_new_prompts() -> None:
    """``fresh(k)``: what each pass and tuning run sends, so that none is answered from an earlier one's
    prefix cache."""
    tok = load_tokenizer(TINY)
    w = build_workload(tok, 12, 5, Uniform(20, 90), Uniform(2, 7))
    assert w.fresh(0) is w
    variants = [w.fresh(k) for k in (1, 2)]
    assert variants[0] == w.fresh(1)  # reproducible
    for v in variants:
        assert [(r.index, r.prompt_len, r.max_new_tokens) for r in v.requests] == \
            [(r.index, r.prompt_len, r.max_new_tokens) for r in w.requests]
        assert v.arrivals(3.0) == w.arrivals(3.0)
        assert all(tok.encode(r.prompt).ids == list(r.prompt_token_ids) for r in v.requests)
    # no prompt shares its first full KV block (16 tokens) with a prompt of another variant
    firsts = [{r.prompt_token_ids[:16] for r in x.requests} for x in (w, *variants)]
    assert all(len(f) == 12 for f in firsts) and not (firsts[0] & firsts[1] or firsts[0] & firsts[2]
                                                      or firsts[1] & firsts[2])
