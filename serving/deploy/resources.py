"""How much a rollserve pod asks of Kubernetes, and how long it may take to start.

Workers and threads: the model's ``minWorkers`` / ``maxWorkers`` and ``option.num_threads`` as set, and where
they are ``auto``, what the server would pick on ``--cpus`` cores (``serving.config.layout.auto_layout``; threads: the
cores shared by the workers and their tensor-parallel ranks, as ``option.num_threads=auto``). The pod's
environment then pins them (``SERVING_MIN_WORKERS``, ``SERVING_MAX_WORKERS``, ``OPTION_NUM_THREADS``): left to
``auto`` in a pod, the server would size itself from the node's cores, not from its CPU request.

CPU = maxWorkers x ranks x threads (every rank of every worker runs ``num_threads`` threads).

Memory (bytes, rounded up to MiB) from the engine's memory preflight (``handlers.preflight.planned_memory``: the
plan a worker makes before loading, with a budget no model reaches, so the KV cache is planned at its full size):
per rank, its share of the weights, prepacked copies and activations, and of the KV cache -- divided by
``kv_cache_memory_fraction`` when the cache is sized ``auto``, since the worker gives the cache only that share of
what is left -- plus ``RANK_OVERHEAD`` (the process: Python, torch, transformers; 250 MiB measured, doubled).
A pod adds ``PROCESS_OVERHEAD`` for its main process (the frontend, or ``serving worker``; 65 MiB of imports
measured, with room for tokenizers and connections). On GPUs the KV cache and activations live on the device
(sized there by ``option.gpu_memory_utilization``): a rank's host memory is its share of the weights, which pass
through it, and each pod with several ranks on GPUs gets ``SHM`` of /dev/shm for NCCL. A model whose weights are
fetched at start is planned the same way from its source's listing and headers (``serving.deploy.source_size``:
nothing is downloaded). Where only the weights' bytes are known (no ``config.json`` to plan with, a model on the
dynamic batcher, a wheel on a package index), a rank gets ``SIZE_FACTOR`` times its share of them (the weights, and
as much again for a dtype conversion, activations and a KV cache the engine sizes to what is left). Only where not
even that can be known (the source cannot be reached from here, no weights in the folder): ``FALLBACK_RANK`` per
rank, said in the notes and the ``rollserve/memory-basis`` annotation; ``--memory`` overrides all of it.

Startup (the startupProbe's window, on the readiness route): ``STARTUP_FLOOR_S`` (start, imports, workers) +
the checkpoint read at ``LOAD_RATE`` + GGUF files repacked at ``GGUF_RATE`` + an eagerly populated KV cache
touched at ``KV_TOUCH_RATE``; a model fetched at start: the floor + ``option.model_loading_timeout``.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from handlers.preflight import PlannedMemory, planned_memory
from rollcore.errors import ConfigError
from serving.config.layout import auto_layout
from serving.deploy import DEFAULT_CPUS
from serving.deploy.model import ModelFolder
from serving.deploy.source_size import measure_source
from serving.sources.source_error import SourceError

MIB = 1 << 20
GIB = 1 << 30
PROCESS_OVERHEAD = 512 * MIB
RANK_OVERHEAD = 512 * MIB
FALLBACK_RANK = 4 * GIB
SIZE_FACTOR = 2
SHM = 1 * GIB
STARTUP_FLOOR_S = 120
LOAD_RATE = 50 * MIB  # bytes/s: a network volume, conservatively
GGUF_RATE = 20 * MIB  # bytes/s: a GGUF file repacked as it loads (SmolLM2's 93 MB: 2.3 s on 2 cores), halved
KV_TOUCH_RATE = 64 * MIB  # bytes/s: half of what a VM that backs memory on first touch managed
PROBE_PERIOD_S = 10



@dataclass(frozen=True, slots=True)
class PodSize:
    cpus: int
    memory_bytes: int
    gpus: int  # nvidia.com/gpu; 0: none

    @property
    def memory(self) -> str:
        """The memory as a Kubernetes quantity (whole MiB, rounded up)."""
        return f"{-(-self.memory_bytes // MIB)}Mi"

    def resources(self) -> dict[str, dict[str, str]]:
        """Requests equal to limits: Guaranteed QoS, so the kubelet's static CPU manager can give whole cores
        (the threads then match the cores) and the memory the worker planned for is not taken back."""
        amounts = {"cpu": str(self.cpus), "memory": self.memory}
        if self.gpus:
            amounts["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


@dataclass(frozen=True, slots=True)
class Sizing:
    min_workers: int
    max_workers: int
    threads: int
    tensor_parallel_degree: int
    nodes: int
    gpu: bool
    leader: PodSize  # the pod running the frontend (every pod without --nodes)
    worker: PodSize | None  # each other pod of a LeaderWorkerSet group
    memory_source: str  # preflight | size | --memory | fallback
    memory_basis: str  # what the figure comes from, in words ("" with --memory)
    plan: PlannedMemory | None
    startup_s: int
    layout_reason: str

    @property
    def ranks_per_pod(self) -> int:
        return self.tensor_parallel_degree // self.nodes

    @property
    def startup_failure_threshold(self) -> int:
        return math.ceil(self.startup_s / PROBE_PERIOD_S)


QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti)?$")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": MIB, "Gi": GIB, "Ti": 1 << 40}


def parse_memory(value: str) -> int:
    """``8Gi``, ``512Mi``, ``1048576`` -> bytes (binary units only). Raises ``ConfigError``."""
    match = QUANTITY.match(value.strip())
    if not match or int(match.group(1)) == 0:
        raise ConfigError(f"--memory {value!r}: expected a positive amount such as 8Gi, 512Mi or bytes")
    return int(match.group(1)) * _UNITS[match.group(2)]


def model_uses_gpus(model: ModelFolder, asked: bool) -> bool:
    """``--gpu``, or ``load_on_devices`` naming device ids (only GPUs have those; ``*`` runs on what is there)."""
    return asked or model.config.parallel.load_on_devices.strip() not in ("", "*")


def layout(model: ModelFolder, cpus: int, nodes: int) -> tuple[int, int, int, str]:
    """``(minWorkers, maxWorkers, threads per rank, why)`` for a pod of ``cpus`` cores (``--cpus``)."""
    cfg = model.config
    tp = cfg.parallel.tensor_parallel_degree
    lo, hi, reason = cfg.min_workers, cfg.max_workers, "minWorkers/maxWorkers as set"
    if nodes > 1:
        lo, hi, reason = 1, 1, f"one worker: its {tp} ranks span {nodes} pods"
    elif model.auto_min_workers or model.auto_max_workers:
        auto = auto_layout(cpus, model.parameters, tp)
        lo = auto.workers if model.auto_min_workers else lo
        hi = max(auto.workers, lo) if model.auto_max_workers else hi
        lo = min(lo, hi)
        reason = f"workers auto on {cpus} cores: {auto.reason}"
    ranks = tp // nodes
    threads = max(1, cpus // (hi * ranks)) if model.auto_threads else int(cfg.options["num_threads"])
    return lo, hi, threads, reason


def _rank_bytes(plan: PlannedMemory, gpu: bool) -> int:
    """One rank's planned bytes beyond its process (see the module note)."""
    tp = plan.tensor_parallel_degree
    if gpu:
        return -(-plan.weight_bytes // tp)
    kv = plan.kv_cache_bytes / plan.kv_fraction if plan.kv_source == "auto" else plan.kv_cache_bytes
    return math.ceil((plan.weight_bytes + plan.prepack_bytes + plan.activation_bytes + kv) / tp)


@dataclass(frozen=True, slots=True)
class Measured:
    source: str  # preflight | size | fallback
    basis: str
    plan: PlannedMemory | None = None
    weight_bytes: int | None = None


def measure(model: ModelFolder, env: Mapping[str, str]) -> Measured:
    """What the model's memory is known from: the preflight of its files (local, or its source's listing and
    headers), the weights' bytes alone, or nothing (see the module note)."""
    cfg = model.config
    options = cfg.handler_properties()
    if model.fetched_model_id is None:
        plan = planned_memory(model.path, cfg.model_id, options) if cfg.batching.rolling else None
        if plan is not None:
            return Measured("preflight", "the memory plan of the model's files", plan, model.checkpoint_bytes)
        if model.checkpoint_bytes:
            return Measured("size", f"the weights' files: {model.checkpoint_bytes} bytes", None, model.checkpoint_bytes)
        return Measured("fallback", "no weights in the model folder to size it from")
    with tempfile.TemporaryDirectory(prefix="rollserve-size-") as tmp:
        try:
            found = measure_source(model.fetched_model_id, gguf_file=cfg.options.get("gguf_file") or None,
                                   allow_unsafe=str(cfg.options.get("allow_unsafe_weights", "false")).lower() == "true",
                                   env=env, scratch=Path(tmp))
        except SourceError as exc:
            return Measured("fallback", f"the size of option.model_id={model.fetched_model_id} cannot be known "
                                        f"from here ({exc})")
        plan = planned_memory(found.folder, None, options) if found.folder and cfg.batching.rolling else None
    return Measured("preflight" if plan else "size", found.basis, plan, found.weight_bytes)


def startup_seconds(model: ModelFolder, plan: PlannedMemory | None, workers: int) -> int:
    """The load-time estimate the startupProbe allows (see the module note)."""
    if model.checkpoint_bytes is None:
        return STARTUP_FLOOR_S + math.ceil(model.config.model_loading_timeout_s)
    seconds = STARTUP_FLOOR_S + model.checkpoint_bytes / LOAD_RATE + model.gguf_bytes / GGUF_RATE
    populate = model.config.options.get("kv_cache_populate", "auto")
    if plan is not None and (populate == "eager" or (populate == "auto" and not model.gguf_bytes)):
        seconds += workers * plan.kv_cache_bytes / KV_TOUCH_RATE
    return math.ceil(seconds)


def size_pods(model: ModelFolder, *, cpus: int = DEFAULT_CPUS, nodes: int = 1, gpu: bool = False,
              memory: str | None = None, env: Mapping[str, str] | None = None) -> Sizing:
    """The pods' resources for ``model`` (see the module note). Raises ``ConfigError``."""
    cfg = model.config
    tp = cfg.parallel.tensor_parallel_degree
    if cpus < 1:
        raise ConfigError(f"--cpus {cpus}: expected at least 1")
    if nodes < 1 or tp % nodes:
        raise ConfigError(f"--nodes {nodes}: option.tensor_parallel_degree = {tp} ranks do not split evenly "
                          f"over {nodes} pods")
    gpu = model_uses_gpus(model, gpu)
    lo, hi, threads, reason = layout(model, cpus, nodes)
    ranks = tp // nodes
    if memory is not None:
        found = Measured("--memory", "")
        rank_bytes, pod_bytes = None, parse_memory(memory)
    else:
        found = measure(model, os.environ if env is None else env)
        if found.plan is not None:
            rank_bytes = RANK_OVERHEAD + _rank_bytes(found.plan, gpu)
        elif found.weight_bytes is not None:
            rank_bytes = RANK_OVERHEAD + SIZE_FACTOR * -(-found.weight_bytes // tp)
        else:
            rank_bytes = RANK_OVERHEAD + FALLBACK_RANK
    if rank_bytes is not None:  # every pod has one main process: the frontend, or `serving worker`
        pod_bytes = PROCESS_OVERHEAD + hi * ranks * rank_bytes + (SHM if gpu and ranks > 1 else 0)
    size = PodSize(hi * ranks * threads, pod_bytes, hi * ranks if gpu else 0)
    return Sizing(min_workers=lo, max_workers=hi, threads=threads, tensor_parallel_degree=tp, nodes=nodes, gpu=gpu,
                  leader=size, worker=size if nodes > 1 else None, memory_source=found.source,
                  memory_basis=found.basis, plan=found.plan, startup_s=startup_seconds(model, found.plan, hi),
                  layout_reason=reason)
