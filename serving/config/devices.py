"""Which accelerators a model's workers get: the devices the server sees, and DJL's assignment rules.

Design note: the frontend never imports torch, so it learns the GPUs from ``CUDA_VISIBLE_DEVICES`` when set
(the container's or the user's choice) and otherwise from ``nvidia-smi -L`` (one line per GPU; absent or
failing: none). A model's ``load_on_devices`` (``*`` = every visible device, or ids ``0;1;3``) narrows them,
and ``tensor_parallel_degree`` cuts them into groups of that many consecutive devices, one group per worker:
DJL Serving's rule, so the number of GPU workers is at most the number of groups. A worker process sees only
its group (``CUDA_VISIBLE_DEVICES`` set per process, in the listed order), so rank r of a worker uses
``cuda:r`` and the handler's ``device_id`` is 0. Without devices, workers run on CPU (``device_id`` -1) and
their ``CUDA_VISIBLE_DEVICES`` is emptied, so a CPU worker never initialises a GPU by accident.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rollcore.errors import ConfigError

Runner = Callable[[list[str]], str]


def _nvidia_smi(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout


def visible_devices(env: Mapping[str, str], run: Runner | None = None) -> tuple[str, ...]:
    """The GPU ids this server may hand out: ``CUDA_VISIBLE_DEVICES`` when set (empty or ``-1``: none), else
    ``0..n-1`` for the n GPUs ``nvidia-smi -L`` lists (none when it is missing or fails)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = tuple(d.strip() for d in listed.split(",") if d.strip())
        return () if not ids or ids[0] == "-1" else ids
    if run is None:
        if shutil.which("nvidia-smi") is None:
            return ()
        run = _nvidia_smi
    try:
        out = run(["nvidia-smi", "-L"])
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU ")))


def chosen_devices(load_on_devices: str, visible: Sequence[str]) -> tuple[str, ...]:
    """The devices of ``visible`` that ``load_on_devices`` names: ``*`` = all, else ids separated by ``;``
    (indices into the visible list, as DJL). Raises ``ConfigError`` for an id that is not visible."""
    spec = load_on_devices.strip()
    if spec in ("", "*"):
        return tuple(visible)
    chosen = []
    for part in (p.strip() for p in spec.split(";")):
        if not part.isdigit() or int(part) >= len(visible):
            raise ConfigError(f"load_on_devices = {load_on_devices!r}: device {part!r} is not one of the "
                              f"{len(visible)} visible device(s) (0..{len(visible) - 1})" if visible else
                              f"load_on_devices = {load_on_devices!r}: no GPU is visible to this server")
        if visible[int(part)] not in chosen:
            chosen.append(visible[int(part)])
    return tuple(chosen)


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """One model's device groups (each a worker's devices, in rank order); empty: CPU workers."""

    groups: tuple[tuple[str, ...], ...] = ()

    @property
    def on_gpu(self) -> bool:
        return bool(self.groups)

    def max_workers(self, wanted: int) -> int:
        """How many of ``wanted`` workers can run: one per group on GPUs, any number on CPU."""
        return min(wanted, len(self.groups)) if self.groups else wanted

    def worker_env(self, group: tuple[str, ...] | None) -> dict[str, str]:
        """The environment a worker with ``group`` (None: a CPU worker) starts with."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(group) if group else ""}


def plan_devices(visible: Sequence[str], load_on_devices: str, tensor_parallel_degree: int) -> DevicePlan:
    """Cut the chosen devices into groups of ``tensor_parallel_degree`` (leftover devices stay idle). Raises
    ``ConfigError`` when GPUs are chosen but fewer than one group's worth."""
    chosen = chosen_devices(load_on_devices, visible)
    if not chosen:
        return DevicePlan()
    tp = max(1, tensor_parallel_degree)
    if len(chosen) < tp:
        raise ConfigError(f"tensor_parallel_degree = {tp} needs {tp} devices; load_on_devices = "
                          f"{load_on_devices!r} gives {len(chosen)} ({','.join(chosen)})")
    return DevicePlan(tuple(tuple(chosen[i:i + tp]) for i in range(0, len(chosen) - tp + 1, tp)))


class DeviceSlots:
    """Which group each live worker holds; a worker takes the first free group and gives it back when it exits."""

    def __init__(self, plan: DevicePlan) -> None:
        self.plan = plan
        self._held: dict[int, tuple[str, ...]] = {}

    def take(self, worker_id: int) -> tuple[str, ...] | None:
        """The group for a starting worker (None on CPU). Raises ``RuntimeError`` when every group is held."""
        if not self.plan.on_gpu:
            return None
        for group in self.plan.groups:
            if group not in self._held.values():
                self._held[worker_id] = group
                return group
        raise RuntimeError(f"no free device group for worker {worker_id}: all {len(self.plan.groups)} are held")

    def release(self, worker_id: int) -> None:
        self._held.pop(worker_id, None)

    def of(self, worker_id: int) -> tuple[str, ...] | None:
        return self._held.get(worker_id)
