"""LoRA adapters on the rolling engine: rows of different adapters and of the base model in one step.

Design note (S-LoRA/Punica's idea, in plain torch): the base weights are never merged. Each projection an
adapter targets (``q/k/v/o_proj``, ``gate/up/down_proj``) is wrapped in ``LoraLinear``, which runs the base
linear on the whole flat batch, then, for each adapter present in the step, gathers that adapter's rows and adds
``x A^T B^T`` (the scale folded into B) to them. The adapters' A and B live in ``max_loras`` slots per layer
(zero-padded to ``max_lora_rank``); ``AdapterSlots`` decides which adapter holds which slot: a slot is pinned
while a sequence of its adapter is in the engine, the least recently used unpinned one is refilled from host
memory when another adapter is needed, and a request whose adapter finds no slot waits outside the scheduler.
Adapters are PEFT folders (``adapter_config.json``, ``adapter_model.safetensors``), read once into host memory.

With tensor parallelism each rank holds the adapters' share that matches its projections' (``parallel.sharding``
records the cut on each): a column-parallel projection (q/k/v/gate/up: its output rows) keeps A whole and B's rows;
a row-parallel one (o/down: its input columns) keeps A's columns and B whole, and its partial deltas are summed by
the block's all-reduce with the base output. Rank 0 decides the slots; each slot it fills (an adapter's name, and
its folder when it was registered over the API) travels with the next step, and the other ranks fill theirs alike.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from rollcore.errors import InvalidRequest, ModelNotFound

logger = logging.getLogger(__name__)
T = TypeVar("T")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter folder the engine cannot serve (its message names the file and the reason)."""


@dataclass(frozen=True)
class Adapter:
    """One adapter in host memory: per wrapped module, A [r, in] and B [out, r] with the scale folded in."""

    name: str
    rank: int
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, folder: Path, modules: Mapping[str, nn.Module], max_rank: int,
                 dtype: torch.dtype) -> Adapter:
    """Read a PEFT LoRA folder for a model whose linear modules are ``modules`` (name -> module, with
    ``in_features``, ``out_features`` and, on a tensor-parallel rank, ``rollserve_shard``: then only this rank's
    share of A or B is kept). Raises ``AdapterError`` for what the engine does not serve: another PEFT type, a
    rank above ``max_rank``, biases, modules to save, or a target that is not one of the projections."""
    from safetensors.torch import load_file

    config_path = folder / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: {config_path}: {exc}") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} exceeds option.max_lora_rank={max_rank}")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: LoRA biases and modules_to_save are not served")
    if config.get("use_dora"):
        raise AdapterError(f"adapter {name!r}: DoRA is not served")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    files = [folder / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise AdapterError(f"adapter {name!r}: {files[0]} is missing (safetensors only)")
    tensors = load_file(str(files[0]))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                module = stem.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA A or B matrix")
    weights = {}
    for module, ab in pairs.items():
        if module not in modules or module.rsplit(".", 1)[-1] not in TARGETS:
            raise AdapterError(f"adapter {name!r}: target {module} is not a projection the engine adapts "
                               f"({', '.join(TARGETS)})")
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: {module} lacks its lora_A or lora_B matrix")
        a, b = ab["lora_A"], ab["lora_B"]
        base = modules[module]
        in_f, out_f = int(base.in_features), int(base.out_features)  # type: ignore[arg-type]
        cut, start, end, full = getattr(base, "rollserve_shard", None) or ("", 0, 0, 0)
        in_f, out_f = (full if cut == "cols" else in_f), (full if cut == "rows" else out_f)  # the whole projection's
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise AdapterError(f"adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                               f"({rank}, {in_f}) and ({out_f}, {rank})")
        a, b = (a[:, start:end], b) if cut == "cols" else (a, b[start:end]) if cut == "rows" else (a, b)
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
    if not weights:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in {files[0]}")
    return Adapter(name, rank, weights)


@dataclass
class StepAdapters:
    """The current step's rows per slot (set by the runner around a forward, read by every ``LoraLinear``)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoraLinear(nn.Module):
    """A linear layer plus the LoRA deltas of the adapters in the step, per row group."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, step: StepAdapters) -> None:
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)  # type: ignore[arg-type]
        self.out_features = int(base.out_features)  # type: ignore[arg-type]
        self.rollserve_shard = getattr(base, "rollserve_shard", None)  # kept here: prepacking swaps ``base``
        weight: torch.Tensor = base.weight  # type: ignore[assignment]
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, self.in_features, dtype=weight.dtype,
                                                   device=weight.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, dtype=weight.dtype,
                                                   device=weight.device), persistent=False)
        self.step = step

    @property
    def weight(self) -> torch.Tensor:  # what code that inspects a projection's weight expects to find
        return self.base.weight  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.step.groups:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        for slot, rows in self.step.groups:
            delta = (flat_x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T
            flat_y.index_add_(0, rows, delta)
        return y


class AdapterSlots:
    """Which adapter holds which of ``max_loras`` slots; pinned while a sequence of it is in the engine."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._pins = [0] * max_loras
        self._holder: list[str | None] = [None] * max_loras
        self._draining: set[int] = set()  # slots of forgotten adapters still used by running sequences

    def acquire(self, name: str) -> tuple[int, bool] | None:
        """A slot for ``name`` and whether it must be filled, or None when every slot is pinned by others."""
        slot = self._slot_of.get(name)
        fill = False
        if slot is None:
            free = [s for s in range(self.max_loras) if self._holder[s] is None]
            if free:
                slot = free[0]
            else:
                victim = next((n for n, s in self._slot_of.items() if self._pins[s] == 0), None)  # LRU first
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
            self._holder[slot] = name
            self._slot_of[name] = slot
            fill = True
        self._slot_of.move_to_end(name)
        self._pins[slot] += 1
        return slot, fill

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0 and slot in self._draining:
            self._draining.discard(slot)
            self._holder[slot] = None

    def forget(self, name: str) -> None:
        """Drop an unregistered (or replaced) adapter's slot; sequences running on it keep it until they end."""
        slot = self._slot_of.pop(name, None)
        if slot is None:
            return
        if self._pins[slot]:
            self._draining.add(slot)
        else:
            self._holder[slot] = None

    @property
    def resident(self) -> list[str]:
        return list(self._slot_of)


class LoraLayers:
    """The wrapped projections of one model, its adapters in host memory, and their slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, record_fills: bool = False) -> None:
        """``record_fills``: rank 0 of a tensor-parallel group keeps each slot fill for the other ranks."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.fills: list[tuple[int, str, str]] | None = [] if record_fills else None  # (slot, name, folder)
        self.step = StepAdapters()
        self.slots = AdapterSlots(max_loras)
        self.adapters: dict[str, Adapter] = {}
        self.runtime: dict[str, str] = {}  # adapters registered over the API: name -> folder
        self.modules: dict[str, LoraLinear] = {}
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, nn.Linear):
                parent = model.get_submodule(name.rsplit(".", 1)[0])
                wrapped = LoraLinear(module, max_loras, max_rank, self.step)
                setattr(parent, name.rsplit(".", 1)[-1], wrapped)
                self.modules[name] = wrapped
        if not self.modules:
            raise AdapterError(f"{type(model).__name__}: no projection named {', '.join(TARGETS)} to adapt")
        self.dtype = next(iter(self.modules.values())).lora_a.dtype

    def register(self, name: str, folder: Path) -> Adapter:
        adapter = read_adapter(name, folder, self.modules, self.max_rank, self.dtype)
        self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.slots.forget(name)

    def set_runtime(self, adapters: Mapping[str, str]) -> None:
        """Make the adapters registered over the API exactly ``adapters`` (name -> folder); the model folder's
        stay. Every new or changed one is read before anything changes (``AdapterError``: nothing changed).
        Requests running on a removed or replaced adapter finish on the weights they started with."""
        builtin = set(self.adapters) - set(self.runtime)
        clash = sorted(set(adapters) & builtin)
        if clash:
            raise AdapterError(f"adapter {clash[0]!r} is one of the model folder's adapters (adapters/{clash[0]}/)")
        fresh = {name: read_adapter(name, Path(folder), self.modules, self.max_rank, self.dtype)
                 for name, folder in adapters.items() if self.runtime.get(name) != folder}
        for name in set(self.runtime) - set(adapters):
            self.unregister(name)
        for name, adapter in fresh.items():
            self.slots.forget(name)
            self.adapters[name] = adapter
        self.runtime = dict(adapters)

    def acquire(self, name: str) -> int | None:
        """A pinned slot holding adapter ``name`` (filled from host memory if needed), or None when all are
        pinned by other adapters."""
        got = self.slots.acquire(name)
        if got is None:
            return None
        slot, fill = got
        if fill:
            self._fill(slot, self.adapters[name])
            if self.fills is not None:
                self.fills.append((slot, name, self.runtime.get(name, "")))
        return slot

    def _fill(self, slot: int, adapter: Adapter) -> None:
        for module_name, module in self.modules.items():
            module.lora_a[slot].zero_()
            module.lora_b[slot].zero_()
            ab = adapter.weights.get(module_name)
            if ab is not None:
                module.lora_a[slot, :adapter.rank].copy_(ab[0])
                module.lora_b[slot, :, :adapter.rank].copy_(ab[1])

    def take_fills(self) -> list[tuple[int, str, str]]:
        """Rank 0: the slot fills since the last step, for the other ranks (in order)."""
        fills, self.fills = self.fills or [], [] if self.fills is not None else None
        return fills

    def apply_fills(self, fills: Sequence[tuple[int, str, str]]) -> None:
        """Another rank: fill the slots as rank 0 did. An adapter registered over the API (its folder given) is
        read here when first seen or when its folder changed; the model folder's are read at start."""
        for slot, name, folder in fills:
            if folder and self.runtime.get(name) != folder:
                self.adapters[name] = read_adapter(name, Path(folder), self.modules, self.max_rank, self.dtype)
                self.runtime[name] = folder
            self._fill(slot, self.adapters[name])

    def set_step(self, seqs: Sequence[tuple[int, int, int, list[int]]], slots: Sequence[int],
                 device: torch.device) -> None:
        """The step's row groups: ``seqs`` are the runner's (q0, start, num_new, table), ``slots`` each
        sequence's slot (-1: the base model)."""
        rows: dict[int, list[int]] = {}
        for (q0, _, num_new, _), slot in zip(seqs, slots, strict=True):
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(q0, q0 + num_new))
        self.step.groups = [(slot, torch.tensor(r, dtype=torch.long, device=device)) for slot, r in rows.items()]

    def clear_step(self) -> None:
        self.step.groups = []


class AdapterQueue(Generic[T]):
    """Requests of adapters waiting for a slot, in arrival order (the first waits, so none is starved);
    ``start(item, slot)`` hands one to the scheduler once its adapter holds a pinned slot."""

    def __init__(self, layers: LoraLayers | None, start: Callable[[T, int], None]) -> None:
        self._layers = layers
        self._start = start
        self._waiting: list[tuple[T, str]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def push(self, item: T, adapter: str) -> None:
        self._waiting.append((item, adapter))
        self._drain()

    def release(self, slot: int) -> None:
        """A sequence holding ``slot`` left the engine: unpin it, maybe for a waiting request."""
        assert self._layers is not None
        self._layers.slots.release(slot)
        self._drain()

    def discard(self, item: T) -> None:
        self._waiting = [(i, a) for i, a in self._waiting if i is not item]

    def _drain(self) -> None:
        while self._waiting and self._layers is not None:
            item, adapter = self._waiting[0]
            slot = self._layers.acquire(adapter)
            if slot is None:
                return  # every slot is pinned by running sequences of other adapters
            self._waiting.pop(0)
            self._start(item, slot)


def enable_lora(model: nn.Module, config: Any, leads_group: bool,
                adapters: Mapping[str, Path]) -> LoraLayers | None:
    """Wrap ``model``'s projections (sharded already on a tensor-parallel rank) and read ``adapters`` when
    ``config.enable_lora``; None otherwise. ``leads_group``: rank 0 of a tensor-parallel group, which records its
    slot fills for the other ranks. Raises ``AdapterError`` for an adapter the engine cannot serve."""
    if not config.enable_lora:
        if adapters:
            logger.info("option.enable_lora is off: the adapters in the model folder (%s) are not served",
                        ", ".join(sorted(adapters)))
        return None
    layers = LoraLayers(model, config.max_loras, config.max_lora_rank, record_fills=leads_group)
    for name, folder in sorted(adapters.items()):
        layers.register(name, folder)
    logger.info("LoRA: %d projections adapted, %d slots of rank %d; adapters: %s", len(layers.modules),
                config.max_loras, config.max_lora_rank, ", ".join(sorted(adapters)) or "none yet")
    return layers


def check_adapter(layers: LoraLayers | None, name: str) -> None:
    """Raise the error a request naming adapter ``name`` gets when it cannot have it."""
    if layers is None:
        raise InvalidRequest(f"'adapters': this model serves no LoRA adapters (option.enable_lora is off); "
                             f"got {name!r}")
    if name not in layers.adapters:
        known = ", ".join(sorted(layers.adapters)) or "none"
        raise ModelNotFound(f"LoRA adapter {name!r} is not registered for this model (registered: {known})")


def folder_adapters(model_dir: Path) -> dict[str, Path]:
    """The adapters shipped in a model folder: ``adapters/NAME/`` with an ``adapter_config.json``."""
    root = model_dir / "adapters"
    if not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir()) if (d / "adapter_config.json").is_file()}
