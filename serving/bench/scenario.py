"""Benchmark scenarios: a YAML file (or a shipped preset) -> a validated ``Scenario``.

    name: chat                      # optional, defaults to the file name
    api: lmi                        # lmi (POST /predictions/{model}), openai (/v1/completions), grpc
                                    # (rollserve.v1.Generation, typed)
    stream: auto                    # auto: stream when the model streams (rolling batch), else whole answers
    num_requests: 64                # per pass
    seed: 0
    warmup: 2                       # short requests before timing (0: none)
    prompt_len: {dist: uniform, min: 8, max: 256}       # tokens, special tokens included
    output_len:                                         # tokens generated (EOS ignored)
      mixture:
        - {weight: 0.25, dist: uniform, min: 128, max: 256}
        - {weight: 0.75, dist: uniform, min: 8, max: 32}
    arrival:                        # one pass, or a list of passes run in order on the same requests
      - {process: burst}
      - {process: poisson, rate: 0.9x}                 # "0.9x": 0.9 x the request throughput of the last
                                                        # burst pass; or requests/s: rate: 4
      - {process: sweep, rates: [0.25x, 0.5x, 1x]}      # one Poisson pass per rate; also
                                                        # rates: {start: 0.5x, factor: 1.25, count: 6}
    slo: "ttft_p99=2s,itl_p99=200ms"                    # optional: goodput (``--slo`` overrides)

Distributions (``dist``): ``constant`` (value), ``uniform`` (min, max: integers, both included),
``normal`` (mean, std), ``lognormal`` (median, sigma); the last two are rounded and clipped to [min, max]
(min defaults to 1, max is required). ``mixture``: a list of weighted distributions. Poisson passes take an
optional ``burstiness`` (gamma-distributed gaps, vLLM's meaning). Every error names the file and the key.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from serving.bench.run_metrics import Slo, parse_slo
from serving.bench.workload import clip

APIS = ("lmi", "openai", "grpc")
STREAM = ("auto", "true", "false")
PROCESSES = ("burst", "poisson", "sweep")
_TOP_KEYS = {"name", "description", "api", "stream", "num_requests", "seed", "warmup", "prompt_len", "output_len",
             "arrival", "slo"}


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the file and the key."""


# ------------------------------------------------------------------------------------------ distributions
@dataclass(frozen=True)
class Constant:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    def bounds(self) -> tuple[int, int]:
        return self.value, self.value


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def bounds(self) -> tuple[int, int]:
        return self.lo, self.hi


@dataclass(frozen=True)
class Normal:
    mean: float
    std: float
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return clip(rng.gauss(self.mean, self.std), self.lo, self.hi)

    def bounds(self) -> tuple[int, int]:
        return self.lo, self.hi


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return clip(rng.lognormvariate(math.log(self.median), self.sigma), self.lo, self.hi)

    def bounds(self) -> tuple[int, int]:
        return self.lo, self.hi


@dataclass(frozen=True)
class Mixture:
    """Picks a component with probability proportional to its weight (one ``random()`` draw), then samples it."""

    components: tuple[tuple[float, Any], ...]

    def sample(self, rng: random.Random) -> int:
        total = sum(w for w, _ in self.components)
        u, acc = rng.random(), 0.0
        for w, dist in self.components:
            acc += w / total
            if u < acc:
                return int(dist.sample(rng))
        return int(self.components[-1][1].sample(rng))

    def bounds(self) -> tuple[int, int]:
        b = [d.bounds() for _, d in self.components]
        return min(lo for lo, _ in b), max(hi for _, hi in b)


# ------------------------------------------------------------------------------------------------ arrivals
@dataclass(frozen=True)
class Rate:
    """Requests/s, or a multiple of the last burst pass's request throughput (``relative``)."""

    value: float
    relative: bool = False

    def resolve(self, burst_req_s: float | None, where: str) -> float:
        if not self.relative:
            return self.value
        if not burst_req_s:
            raise ScenarioError(f"{where}: rate {self} is relative to a burst pass's throughput, and no burst "
                                f"pass ran before it (put a {{process: burst}} pass first)")
        return self.value * burst_req_s

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}/s"


@dataclass(frozen=True)
class Pass:
    """One timed pass over the workload: ``process`` burst (all at t=0) or poisson at ``rate``."""

    process: str
    rate: Rate | None = None
    burstiness: float = 1.0
    sweep_index: int | None = None  # position in its sweep (the tuner's load ladder)

    @property
    def label(self) -> str:
        return "burst" if self.process == "burst" else f"poisson@{self.rate}"


@dataclass(frozen=True)
class Scenario:
    name: str
    api: str = "lmi"
    stream: str = "auto"
    num_requests: int = 64
    seed: int = 0
    warmup: int = 2
    prompt_len: Any = field(default_factory=lambda: Uniform(8, 256))
    output_len: Any = field(default_factory=lambda: Uniform(8, 32))
    passes: tuple[Pass, ...] = (Pass("burst"),)
    slo: Slo | None = None
    description: str = ""
    source: str = "<scenario>"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "api": self.api, "stream": self.stream,
                "num_requests": self.num_requests, "seed": self.seed, "warmup": self.warmup,
                "prompt_len": _dist_doc(self.prompt_len), "output_len": _dist_doc(self.output_len),
                "passes": [p.label for p in self.passes], "slo": str(self.slo) if self.slo else None}


def _dist_doc(d: Any) -> Any:
    if isinstance(d, Mixture):
        return {"mixture": [{"weight": w, **_dist_doc(c)} for w, c in d.components]}
    kind = {Constant: "constant", Uniform: "uniform", Normal: "normal", LogNormal: "lognormal"}[type(d)]
    return {"dist": kind, **{k: v for k, v in vars(d).items()}}


# ------------------------------------------------------------------------------------------------ parsing
class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, msg: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {key}: {msg}")

    def mapping(self, value: Any, key: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {type(value).__name__} {value!r}")
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise self.fail(key, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})")
        return value

    def integer(self, value: Any, key: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def number(self, value: Any, key: str, *, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(key, f"expected a number, got {value!r}")
        if positive and value <= 0:
            raise self.fail(key, f"must be > 0, got {value}")
        return float(value)

    def rate(self, value: Any, key: str) -> Rate:
        if isinstance(value, str) and value.strip().lower().endswith("x"):
            try:
                v = float(value.strip()[:-1])
            except ValueError:
                raise self.fail(key, f"{value!r} is not a rate: write requests/s (4) or a multiple of the "
                                     f"burst throughput (0.9x)") from None
            return Rate(self.number(v, key), relative=True)
        if isinstance(value, str):
            raise self.fail(key, f"{value!r} is not a rate: write requests/s (4) or a multiple of the burst "
                                 f"throughput (0.9x)")
        return Rate(self.number(value, key))

    def dist(self, value: Any, key: str) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return Constant(self.integer(value, key, 1))
        if isinstance(value, dict) and "mixture" in value:
            self.mapping(value, key, {"mixture"})
            comps = value["mixture"]
            if not isinstance(comps, list) or not comps:
                raise self.fail(f"{key}.mixture", "expected a non-empty list of weighted distributions")
            out = []
            for i, c in enumerate(comps):
                where = f"{key}.mixture[{i}]"
                if not isinstance(c, dict) or "weight" not in c:
                    raise self.fail(where, "each component needs a weight and a dist")
                rest = {k: v for k, v in c.items() if k != "weight"}
                out.append((self.number(c["weight"], f"{where}.weight"), self.dist(rest, where)))
            return Mixture(tuple(out))
        m = self.mapping(value, key, {"dist", "value", "min", "max", "mean", "std", "median", "sigma"})
        kind = m.get("dist")
        shape_keys = {"constant": {"value"}, "uniform": {"min", "max"}, "normal": {"mean", "std", "min", "max"},
                      "lognormal": {"median", "sigma", "min", "max"}}
        if kind not in shape_keys:
            raise self.fail(f"{key}.dist", f"expected one of {', '.join(shape_keys)} (or a mixture), got {kind!r}")
        extra = sorted(set(m) - {"dist"} - shape_keys[kind])
        if extra:
            raise self.fail(key, f"{kind} takes {', '.join(sorted(shape_keys[kind]))}, not {', '.join(extra)}")
        if kind == "constant":
            return Constant(self.integer(m.get("value"), f"{key}.value", 1))
        for req in ("max",) + (("min",) if kind == "uniform" else ()):
            if req not in m:
                raise self.fail(key, f"{kind} needs {req}")
        lo = self.integer(m.get("min", 1), f"{key}.min", 1)
        hi = self.integer(m["max"], f"{key}.max", 1)
        if lo > hi:
            raise self.fail(key, f"min ({lo}) must be <= max ({hi})")
        if kind == "uniform":
            return Uniform(lo, hi)
        if kind == "normal":
            return Normal(self.number(m.get("mean"), f"{key}.mean"),
                          self.number(m.get("std"), f"{key}.std", positive=False), lo, hi)
        return LogNormal(self.number(m.get("median"), f"{key}.median"),
                         self.number(m.get("sigma"), f"{key}.sigma", positive=False), lo, hi)

    def passes(self, value: Any, key: str) -> tuple[Pass, ...]:
        items = value if isinstance(value, list) else [value]
        if not items:
            raise self.fail(key, "expected at least one pass")
        out: list[Pass] = []
        for i, item in enumerate(items):
            where = f"{key}[{i}]" if isinstance(value, list) else key
            m = self.mapping(item, where, {"process", "rate", "rates", "burstiness"})
            process = m.get("process")
            if process not in PROCESSES:
                raise self.fail(f"{where}.process", f"expected one of {', '.join(PROCESSES)}, got {process!r}")
            burstiness = self.number(m.get("burstiness", 1.0), f"{where}.burstiness")
            if process == "burst":
                if set(m) - {"process"}:
                    raise self.fail(where, "a burst pass takes no rate (every request arrives at t=0)")
                out.append(Pass("burst"))
            elif process == "poisson":
                if "rate" not in m or "rates" in m:
                    raise self.fail(where, "a poisson pass needs rate (requests/s, or 0.9x: a multiple of the "
                                           "last burst pass's throughput)")
                out.append(Pass("poisson", self.rate(m["rate"], f"{where}.rate"), burstiness))
            else:
                if "rates" not in m or "rate" in m:
                    raise self.fail(where, "a sweep needs rates: a list, or {start, factor, count}")
                rates = self.sweep_rates(m["rates"], f"{where}.rates")
                out.extend(Pass("poisson", r, burstiness, j) for j, r in enumerate(rates))
        return tuple(out)

    def sweep_rates(self, value: Any, key: str) -> list[Rate]:
        if isinstance(value, list):
            if not value:
                raise self.fail(key, "expected at least one rate")
            rates = [self.rate(v, f"{key}[{i}]") for i, v in enumerate(value)]
        else:
            m = self.mapping(value, key, {"start", "factor", "count"})
            for req in ("start", "factor", "count"):
                if req not in m:
                    raise self.fail(key, f"a geometric sweep needs start, factor and count (missing {req})")
            start = self.rate(m["start"], f"{key}.start")
            factor = self.number(m["factor"], f"{key}.factor")
            if factor <= 1:
                raise self.fail(f"{key}.factor", f"must be > 1, got {factor}")
            count = self.integer(m["count"], f"{key}.count", 1)
            rates = [Rate(start.value * factor ** i, start.relative) for i in range(count)]
        if any(b.relative != rates[0].relative or b.value <= a.value for a, b in zip(rates, rates[1:],
                                                                                     strict=False)):
            raise self.fail(key, "rates must increase and be all absolute or all relative (x)")
        return rates


def parse_scenario(data: Any, source: str = "<scenario>", default_name: str = "scenario") -> Scenario:
    """A scenario from parsed YAML. Raises ``ScenarioError`` naming ``source`` and the key."""
    r = _Reader(source)
    if data is None:
        data = {}
    m = r.mapping(data, "scenario", _TOP_KEYS)
    api = m.get("api", "lmi")
    if api not in APIS:
        raise r.fail("api", f"expected one of {', '.join(APIS)}, got {api!r}")
    stream = str(m.get("stream", "auto")).lower()
    if stream not in STREAM:
        raise r.fail("stream", f"expected auto, true or false, got {m.get('stream')!r}")
    slo = None
    if m.get("slo") is not None:
        try:
            slo = parse_slo(m["slo"])
        except ValueError as exc:
            raise r.fail("slo", str(exc)) from None
    name = m.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise r.fail("name", f"expected a non-empty string, got {name!r}")
    scenario = Scenario(
        name=name, api=api, stream=stream,
        num_requests=r.integer(m.get("num_requests", 64), "num_requests", 1),
        seed=r.integer(m.get("seed", 0), "seed", 0),
        warmup=r.integer(m.get("warmup", 2), "warmup", 0),
        prompt_len=r.dist(m.get("prompt_len", {"dist": "uniform", "min": 8, "max": 256}), "prompt_len"),
        output_len=r.dist(m.get("output_len", {"dist": "uniform", "min": 8, "max": 32}), "output_len"),
        passes=r.passes(m.get("arrival", {"process": "burst"}), "arrival"),
        slo=slo, description=str(m.get("description", "")), source=source)
    return scenario


def presets() -> list[str]:
    """Names of the shipped scenario presets (``serving/bench/presets/*.yaml``)."""
    return sorted(p.name[:-5] for p in resources.files("serving.bench").joinpath("presets").iterdir()
                  if p.name.endswith(".yaml"))


def load_scenario(spec: str | Path) -> Scenario:
    """A preset name (``presets()``) or a YAML file path. Raises ``ScenarioError``."""
    import yaml

    text: str
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ScenarioError(f"{spec}: scenario file not found (presets: {', '.join(presets())})")
        text, source, default_name = path.read_text(encoding="utf-8"), str(path), path.stem
    else:
        if str(spec) not in presets():
            raise ScenarioError(f"{spec!r} is neither a scenario file nor a preset (presets: "
                                f"{', '.join(presets())})")
        res = resources.files("serving.bench").joinpath("presets").joinpath(f"{spec}.yaml")
        text, source, default_name = res.read_text(encoding="utf-8"), f"preset {spec}", str(spec)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{source}: not valid YAML: {exc}") from None
    return parse_scenario(data, source, default_name)
