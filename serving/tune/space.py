"""The tune's space: groups (what needs a restart) x live knobs (what ``PUT /models/{name}`` changes).

A *group* is a batching mode (rolling or dynamic), a worker count and threads per worker. Inside a group the
live knobs change on the running model. Which knobs are live, and their ``serving.properties`` keys, come from
the one knob table (``serving.models.knobs.KNOBS``); this module adds only the ranges the search explores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from serving.models import knobs as live


@dataclass(frozen=True)
class Knob:
    """A searched live knob: the knob table's name, key and batching mode, and the range explored."""

    name: str
    prop: str
    lo: int
    hi: int
    log: bool
    mode: str  # rolling | dynamic


# name -> (lo, hi, log scale): the ranges explored; the rest of each knob comes from serving.models.knobs
_RANGES = {"max_rolling_batch_size": (1, 64, True), "max_rolling_batch_prefill_tokens": (64, 4096, True),
           "batch_size": (1, 32, True), "max_batch_delay": (0, 200, False)}
KNOBS = tuple(Knob(k.name, k.key, *_RANGES[k.name], k.applies) for k in live.KNOBS if k.name in _RANGES)
_BY_NAME = {k.name: k for k in KNOBS}
# where a mode's search starts when the folder does not set a knob (the folder's own values otherwise)
SEED = {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 2048, "batch_size": 8,
        "max_batch_delay": 50}


def knobs_of(mode: str) -> tuple[Knob, ...]:
    return tuple(k for k in KNOBS if k.mode == mode)


@dataclass(frozen=True, order=True)
class Group:
    mode: str
    workers: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.mode} {self.workers}w x {self.threads}t"

    def properties(self) -> dict[str, str | None]:
        return {"option.rolling_batch": "auto" if self.mode == "rolling" else "disable",
                "minWorkers": str(self.workers), "maxWorkers": str(self.workers),
                "option.num_threads": str(self.threads)}


@dataclass(frozen=True)
class Config:
    group: Group
    knobs: tuple[tuple[str, int], ...]

    @property
    def id(self) -> str:
        return f"{self.group.label}: " + ", ".join(f"{k}={v}" for k, v in self.knobs)

    def knob(self, name: str) -> int:
        return dict(self.knobs)[name]

    def properties(self) -> dict[str, str | None]:
        props = self.group.properties()
        props.update({_BY_NAME[k].prop: str(v) for k, v in self.knobs})
        return props


def make_config(group: Group, values: dict[str, int]) -> Config:
    """A configuration of ``group`` with ``values`` clipped into range (a prefill budget of at least one
    token per sequence, which a decode step needs)."""
    out = {k.name: max(k.lo, min(k.hi, int(values[k.name]))) for k in knobs_of(group.mode)}
    if group.mode == "rolling":
        out["max_rolling_batch_prefill_tokens"] = max(out["max_rolling_batch_prefill_tokens"],
                                                      out["max_rolling_batch_size"])
    return Config(group, tuple(out.items()))


def clipped_knobs(config: Config) -> dict[str, int]:
    """``config``'s live knobs, each clipped to its range (a folder's value may lie outside)."""
    return {k.name: min(max(int(config.knob(k.name)), k.lo), k.hi) for k in knobs_of(config.group.mode)}


@dataclass(frozen=True)
class Space:
    """The groups a tune explores (the baseline's first) and the folder's configuration (the baseline)."""

    groups: tuple[Group, ...]
    baseline: Config
    seeds: dict[Group, Config]


def cores_available() -> int:
    return len(os.sched_getaffinity(0))


def build_space(model_dir: Path, modes: tuple[str, ...] | None = None, workers: tuple[int, ...] | None = None,
                threads: tuple[int, ...] | None = None, cores: int | None = None) -> Space:
    """The space of a model folder: its configuration (``serving.config.model_config``) is the baseline; the groups are
    every mode the model can run (rolling needs an architecture the engine serves) x worker counts x threads
    with workers x threads = the cores (the CPUs of this process's affinity mask), unless given.
    Raises ``ConfigError`` or ``ValueError``."""
    from serving.config.model_config import load_model_config

    cfg = load_model_config(model_dir, env=os.environ)
    if cfg.entry_point not in ("huggingface", "rolling", "djl_python.huggingface"):
        raise ValueError(f"{model_dir}: entry point {cfg.entry_point!r} is a custom handler; serving tune "
                         f"searches the built-in handlers' knobs (huggingface / rolling)")
    cores = cores or cores_available()
    can_roll = load_model_config(model_dir, env=os.environ,
                                 overrides={"option.rolling_batch": "auto"}).batching.rolling
    all_modes = ("rolling", "dynamic") if can_roll else ("dynamic",)
    modes = modes or all_modes
    bad = [m for m in modes if m not in all_modes]
    if bad:
        raise ValueError(f"mode {bad[0]!r} is not available for this model (available: {', '.join(all_modes)})")
    b = cfg.batching
    base_mode = "rolling" if b.rolling else "dynamic"
    t = cfg.options.get("num_threads", "auto")
    base_threads = max(1, cores // cfg.max_workers) if t == "auto" else int(t)
    base_group = Group(base_mode, cfg.max_workers, base_threads)
    folder = {"max_rolling_batch_size": b.max_rolling_batch_size,
              "max_rolling_batch_prefill_tokens": b.max_rolling_batch_prefill_tokens,
              "batch_size": b.batch_size, "max_batch_delay": b.max_batch_delay_ms}
    seed_values = {k: (v if cfg.sources.get(_BY_NAME[k].prop, "default") != "default" else SEED[k])
                   for k, v in folder.items()}
    pairs = sorted({(w, cores // w) for w in range(1, cores + 1) if cores // w >= 1 and w * (cores // w) == cores})
    if workers:
        pairs = [(w, tt) for w, tt in pairs if w in workers] or [(w, max(1, cores // w)) for w in workers]
    if threads:
        pairs = sorted({(w, x) for w, _ in pairs for x in threads})
    groups = [Group(m, w, tt) for m in modes for w, tt in sorted(pairs)]
    groups = [base_group] + [g for g in groups if g != base_group]
    baseline = Config(base_group, tuple((k.name, folder[k.name]) for k in knobs_of(base_mode)))
    seeds = {g: baseline if g == base_group else make_config(g, seed_values) for g in groups}
    return Space(tuple(groups), baseline, seeds)
