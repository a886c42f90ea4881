"""``minWorkers`` / ``maxWorkers`` ``auto``: how many worker processes a model gets, from the cores the server may
run on (its CPU affinity mask: what ``taskset`` or a container's CPU set leaves) and the model's size.

Why the size decides: a decode step of a model of a few million parameters is mostly serial Python (dispatching
each layer's operators), which a second thread does not speed up but a second process does; a larger model's
step is matrix products that every core can share, and one worker keeps one copy of the weights and one KV cache.
Measured on a 2-core AVX2 machine (benchmarks/README.md, "Layout from the cores"): the 3.4M tiny-llama served
more with a worker per core, SmolLM2-135M more with one worker of two threads, and one core is always one worker.
``option.num_threads=auto`` then gives each worker its share of the cores
(``handlers.engine.planning.cpu.auto_threads``), so threads never outnumber cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Below this many parameters a model gets a worker per core (see the module's note).
PROCESS_BOUND_PARAMS = 30_000_000


@dataclass(frozen=True, slots=True)
class Layout:
    workers: int
    threads_per_worker: int
    reason: str


def server_cores() -> int:
    """The CPUs this process may run on (its workers inherit the mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def checkpoint_parameters(weights: Path) -> int | None:
    """Parameters of the folder's safetensors checkpoint (None: no readable checkpoint)."""
    from handlers.preflight import checkpoint_parameters as count  # torch-free: reads the safetensors headers

    return count(weights)


def auto_layout(cores: int, parameters: int | None, tensor_parallel_degree: int = 1) -> Layout:
    """The layout ``auto`` picks for a model of ``parameters`` (None: unknown) on ``cores`` CPUs."""
    cores = max(1, cores)
    if cores == 1:
        return Layout(1, 1, "one core: one worker, one thread")
    if tensor_parallel_degree > 1:
        return Layout(1, max(1, cores // tensor_parallel_degree),
                      f"tensor_parallel_degree={tensor_parallel_degree}: one worker, its ranks share the {cores} cores")
    if parameters is None:
        return Layout(1, cores, f"model size unknown before load: one worker with {cores} threads")
    size = f"{parameters / 1e6:.1f}M parameters"
    if parameters < PROCESS_BOUND_PARAMS:
        return Layout(cores, 1, f"{size} (a step is mostly Python): a worker per core, {cores} x 1 thread")
    return Layout(1, cores, f"{size} (a step is matrix products): one worker with {cores} threads")
