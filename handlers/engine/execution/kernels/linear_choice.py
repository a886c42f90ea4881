"""Which GEMM runs the linear layers' inputs of each size: measured on this CPU for the model's own layers.

Design note (why: no instruction-set rule gets it right): oneDNN's packed weight beats MKL's plain GEMM on
large weights and skinny inputs (SmolLM2's 576 x 1536 projections from 4 rows on) and loses on small weights
(a 3.4M model's 256-wide layers) and on single rows, with crossovers that move with the CPU, the shape, the
row count and the threads (benchmarks/HISTORY.md, "Measured kernel choice"). Timing one shape alone misleads:
in a step the layers' calls follow one another, and switching kernels between them costs more than either
kernel alone (a 256-wide model's MLP on the packed weight measured faster alone and slower in sequence).
So with ``prepack_weights=auto`` the engine times passes through its first decoder layers' linear layers in
their order (twice the last-level cache in weights where the model has that much, so that none is found in a
cache, as in a step; fewer layers at large row counts, bound by arithmetic), all plain against all packed against
all on the panel kernel (``panel_linear``, fp32 only), at the row counts a step gives them, and the LM head alone;
each row-count bucket of the body, and of the head, goes to the fastest. At most two kernels per layer, as the
memory plan counts two copies: where the panel kernel wins some buckets, the others all go to the one of plain and
packed whose passes over them sum less. Layers keep only the copies their routes use. Timings are cached
per CPU, torch build and thread count, so the workers of a machine route alike and a restarted worker
computes with the kernels of the one it replaces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from handlers.engine.execution.kernels.native import cache_dir
from handlers.engine.execution.kernels.panel_linear import PanelKernel, PanelLinear, load_panel_kernel, takes
from handlers.engine.execution.kernels.prepack import HYBRID_MAX_PACKED_ROWS, PackedLinear, replace_module
from handlers.engine.planning.cpu import cpu_flags, cpu_model_name, last_level_cache_bytes

logger = logging.getLogger(__name__)

# The row counts measured: the decode batches and prefill chunks, by powers of two; an input is routed by the
# smallest measured bucket that holds it, inputs beyond the largest by the largest.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_MEASURED_FLOP = 4e9  # a bucket is measured when its shortest pass stays within this; larger ones follow it
PASS_FLOP = 8e9  # a bucket's pass runs through as many layers as fit this (at least STREAM_BYTES' worth)
ROUNDS = 3  # timed passes per kernel and bucket, alternating (after one warm-up pass each)
STREAM_BYTES = 16 << 20  # the least weight a pass reads: several times a core's L2 on the CPUs measured
CACHE_VERSION = "6"
KERNELS = ("plain", "packed", "panel")

Shape = tuple[int, int, bool, str]  # in_features, out_features, has bias, dtype


@dataclass(frozen=True)
class Timing:
    """Median seconds of one pass, per measured bucket: plain (``F.linear``), packed (oneDNN) and panel (ours;
    empty where it was not measured)."""
    plain: Mapping[int, float]
    packed: Mapping[int, float]
    panel: Mapping[int, float] = field(default_factory=dict)

    def kernels(self) -> dict[int, str]:
        """Each bucket's kernel: the panel kernel where its pass was the fastest; the others per bucket the faster
        of plain and packed (a tie keeps the plain weight: no second copy for nothing), or, when the panel kernel
        has some buckets and they would split, all the one whose passes over them sum less (two copies at most)."""
        panel = {r for r, t in self.panel.items() if r in self.plain and t < min(self.plain[r], self.packed[r])}
        rest = [r for r in self.plain if r not in panel]
        chosen = {r: "packed" if self.packed[r] < self.plain[r] else "plain" for r in rest}
        if panel and len(set(chosen.values())) > 1:
            one = "packed" if sum(self.packed[r] for r in rest) < sum(self.plain[r] for r in rest) else "plain"
            chosen = dict.fromkeys(rest, one)
        return {**chosen, **dict.fromkeys(panel, "panel")}

    def buckets(self, kernel: str) -> frozenset[int]:
        """The buckets that run on ``kernel``."""
        return frozenset(r for r, k in self.kernels().items() if k == kernel)

    def packed_buckets(self) -> frozenset[int]:
        return self.buckets("packed")


def shape_of(linear: nn.Linear) -> Shape:
    return linear.in_features, linear.out_features, linear.bias is not None, str(linear.weight.dtype)


def buckets_for(shapes: Sequence[Shape], max_rows: int) -> tuple[int, ...]:
    """The buckets measured: up to ``max_rows`` (the rows a step can give these layers) and within
    MAX_MEASURED_FLOP a pass, at least the first."""
    flop_per_row = 2.0 * sum(s[0] * s[1] for s in shapes)
    fits = [r for r in BUCKETS if r <= max(max_rows, 1) and r * flop_per_row <= MAX_MEASURED_FLOP]
    return tuple(fits) or BUCKETS[:1]


def measure(passes: Mapping[int, Sequence[nn.Linear]], panel: PanelKernel | None = None) -> Timing:
    """Seconds of each bucket's pass through its linears in order (``passes``: rows -> the linears, each a prefix
    of the longest): ``F.linear`` on their weights against ``PackedLinear`` on packed copies and, given ``panel``,
    ``PanelLinear`` on panel copies (made here, dropped after), alternating pass by pass, at the bucket's row
    count."""
    longest = max(passes.values(), key=len)
    packs = {id(m): PackedLinear(m) for m in longest}
    panels = {id(m): PanelLinear(m, panel) for m in longest} if panel is not None else {}
    gen = torch.Generator().manual_seed(0)
    result: dict[str, dict[int, float]] = {name: {} for name in KERNELS}
    with torch.inference_mode():
        for rows, linears in passes.items():
            kernels = {"plain": [lambda x, m=m: F.linear(x, m.weight, m.bias) for m in linears],
                       "packed": [packs[id(m)] for m in linears]}
            if panels:
                kernels["panel"] = [panels[id(m)] for m in linears]
            xs = [torch.randn(rows, m.in_features, generator=gen).to(m.weight.dtype) for m in linears]
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for i in range(ROUNDS + 1):
                for name, calls in kernels.items():
                    start = time.perf_counter()
                    for call, x in zip(calls, xs, strict=True):
                        call(x)
                    if i:  # the first pass builds oneDNN's kernels
                        times[name].append(time.perf_counter() - start)
            for name, values in times.items():
                result[name][rows] = statistics.median(values)
    return Timing(result["plain"], result["packed"], result["panel"])


def router(timing: Timing, kernel: str = "packed") -> Callable[[int], bool]:
    """``rows -> runs on kernel``: the choice of the smallest measured bucket that holds ``rows`` (beyond the
    largest, the largest's), looked up in a table (it runs on every call of the layer)."""
    chosen = timing.buckets(kernel)
    table = [False] * (max(timing.plain) + 1)
    previous = 0
    for bucket in sorted(timing.plain):
        for rows in range(previous + 1, bucket + 1):
            table[rows] = bucket in chosen
        previous = bucket
    last = table[-1]
    return lambda rows: table[rows] if rows < len(table) else last


class TimingCache:
    """Timings on disk, one JSON file per CPU, torch build and thread count (``key``)."""

    def __init__(self, folder: Path, threads: int) -> None:
        ident = "|".join([CACHE_VERSION, cpu_model_name(), " ".join(sorted(cpu_flags())), torch.__version__,
                          str(threads)])
        self.path = folder / f"linear-times-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"

    def load(self) -> dict[str, Timing]:
        try:
            raw = json.loads(self.path.read_text())
            return {key: Timing(*({int(r): float(t) for r, t in v.get(name, {}).items()} for name in KERNELS))
                    for key, v in raw.items() if "plain" in v and "packed" in v}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or damaged: measure again
            return {}

    def save(self, timings: Mapping[str, Timing]) -> dict[str, Timing]:
        """Merged with what is there, written atomically; returns the merged timings. An entry already there wins:
        workers that measured at once then route by the first one's timings."""
        merged = {**timings, **self.load()}
        data = {k: {name: dict(getattr(t, name)) for name in KERNELS} for k, t in merged.items()}
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, self.path)
        return merged


def timing_cache() -> TimingCache | None:
    """The cache for this process's thread count; None (measure every load) without a writable folder."""
    try:
        return TimingCache(cache_dir(), torch.get_num_threads())
    except OSError:
        return None


def pass_key(passes: Mapping[int, Sequence[nn.Linear]]) -> str:
    """The cache's key for a measurement: the longest pass's shapes (hashed), dtype, and each bucket's pass length."""
    longest = max(passes.values(), key=len)
    shapes = " ".join(f"{s[0]}x{s[1]}{'+b' if s[2] else ''}" for s in map(shape_of, longest))
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    lengths = ",".join(f"{rows}/{len(linears)}" for rows, linears in sorted(passes.items()))
    return f"{digest}:{shape_of(longest[0])[3]}:{lengths}"


def timed(passes: Mapping[int, Sequence[nn.Linear]], cache: TimingCache | None, panel: PanelKernel | None = None
          ) -> Timing:
    """The timing of ``passes`` (``measure``) from ``cache`` when there, else measured and cached."""
    key = pass_key(passes)
    known = cache.load() if cache is not None else {}
    if key in known:
        return known[key]
    timing = measure(passes, panel)
    if cache is not None:
        try:
            timing = cache.save({key: timing})[key]  # another worker's, when it saved first
        except OSError as exc:
            logger.warning("could not cache the linear kernel timings in %s: %s", cache.path, exc)
    return timing


def stream_bytes() -> int:
    """The weight a pass must read for none of it to be found in a cache: twice the last-level cache, at least
    STREAM_BYTES (a VM's large L3 held a small model's first layers, and timed there the plain GEMM looked as fast
    as the packed one where a step, streaming every layer from memory, ran slower on it: benchmarks/HISTORY.md)."""
    return max(STREAM_BYTES, 2 * last_level_cache_bytes())


def body_passes(body: Sequence[nn.Linear], num_layers: int, max_rows: int,
                stream: int | None = None) -> dict[int, list[nn.Linear]]:
    """Each measured bucket's pass through the body: its first whole decoder layers (the body split in
    ``num_layers`` when that divides it, else all of it as one), as many as read ``stream`` bytes of weights
    (``stream_bytes()``) or as fit PASS_FLOP at the bucket's rows, whichever is fewer, but at least STREAM_BYTES'
    worth (and one layer). Buckets: ``buckets_for`` the shortest such pass."""
    per_layer = len(body) // num_layers if num_layers > 0 and len(body) % num_layers == 0 else len(body)
    layers = [list(body[i:i + per_layer]) for i in range(0, len(body), per_layer)]
    nbytes = [sum(m.weight.nbytes for m in layer) for layer in layers]
    flop_per_row = [2.0 * sum(m.in_features * m.out_features for m in layer) for layer in layers]

    def reaching(total: float) -> int:
        """The fewest first layers whose weights add up to ``total`` bytes (all of them when they never do)."""
        read = 0
        for n, size in enumerate(nbytes, 1):
            read += size
            if read >= total:
                return n
        return len(layers)

    def within_flop(rows: int) -> int:
        """The most first layers whose pass at ``rows`` stays within PASS_FLOP."""
        total = 0.0
        for n, flop in enumerate(flop_per_row):
            total += rows * flop
            if total > PASS_FLOP:
                return n
        return len(layers)

    least = reaching(STREAM_BYTES)
    most = max(least, reaching(stream_bytes() if stream is None else stream))
    shortest = [m for layer in layers[:least] for m in layer]
    passes = {}
    for rows in buckets_for([shape_of(m) for m in shortest], max_rows):
        n = min(most, max(least, within_flop(rows)))
        passes[rows] = [m for layer in layers[:n] for m in layer]
    return passes


def apply_choice(model: nn.Module, step_tokens: int, max_seqs: int, cache: TimingCache | None) -> dict[str, int]:
    """Route the ``nn.Linear`` layers of ``model`` by measurement: the body's (the decoder layers') by passes
    through its first layers, the LM head's (one row per sequence: up to ``max_seqs``) by its own. A layer with
    some bucket on the packed weight becomes a ``PackedLinear`` (the plain copy kept where some bucket runs plain),
    one with some on the panel kernel a ``PanelLinear`` around what runs its other buckets (none where the panel
    kernel runs them all); the others stay as they are. Returns how many layers run some bucket on each kernel."""
    head = getattr(model, "lm_head", None)
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    body = [m for _, m in targets if m is not head]
    panel = load_panel_kernel() if targets and all(takes(m) for _, m in targets) else None
    timings: dict[bool, Timing] = {}  # is the head -> its timing
    if body:
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0
        timings[False] = timed(body_passes(body, layers, max(step_tokens, max_seqs)), cache, panel)
    if type(head) is nn.Linear:
        timings[True] = timed({rows: [head] for rows in buckets_for([shape_of(head)], max_seqs)}, cache, panel)
    if panel is None:  # cached timings from a process that had the panel kernel (or other layers): not here
        timings = {is_head: Timing(t.plain, t.packed) for is_head, t in timings.items()}
    counts = dict.fromkeys(KERNELS, 0)
    # per timing, once: layers of a shape share their routers (the packed kernels are warmed once per router)
    routes = {is_head: (set(t.kernels().values()), router(t), router(t, "panel")) for is_head, t in timings.items()}
    for name, linear in targets:
        used, runs_packed, runs_panel = routes[linear is head]
        for kernel in used:
            counts[kernel] += 1
        module: nn.Module = linear
        if "packed" in used:
            keep_plain = "plain" in used
            module = PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS if keep_plain else None)
            if keep_plain:
                module.router = runs_packed
        if "panel" in used:
            if isinstance(module, PackedLinear):  # the rows the panel kernel takes never reach it: no kernels for them
                module.taken = runs_panel
            module = PanelLinear(linear, panel, rest=module if used != {"panel"} else None, router=runs_panel)
        if module is not linear:
            replace_module(model, name, module)
    return counts
