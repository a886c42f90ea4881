"""A model that could not be loaded (its configuration failed): it only reports its reason.

Design note: the registry keeps such a model under its name so that clients and ``GET /models`` learn why it
does not serve; every request to it is ``Unavailable`` with the reason. It has the attributes of a loaded
``ModelEndpoint`` (``serving.models.endpoint``), all empty, so callers need not tell the two apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from rollcore.errors import Unavailable
from rollcore.types import GenerationRequest, ModelState
from serving.models.model_text import ModelText

if TYPE_CHECKING:  # annotations only
    from serving.batching.dynamic import DynamicBatcher
    from serving.batching.rolling import RollingBatcher
    from serving.batching.streams import ResultStream
    from serving.config.model_config import ModelConfig
    from serving.models.adapters import ApiAdapters
    from serving.models.endpoint_protocol import Endpoint
    from serving.models.residency import Residence, Residency
    from serving.worker.pool import WorkerPool


class FailedEndpoint:
    """A model whose configuration could not be loaded: it only reports its reason."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.version = "1"
        self.state = ModelState.FAILED
        self.reason = reason
        self.rolling = False
        self.info: dict[str, Any] = {}
        self.available = False
        # what a loaded model has, none of it here (serving.models.endpoint_protocol)
        self.config: ModelConfig | None = None
        self.batcher: DynamicBatcher | RollingBatcher | None = None
        self.pool: WorkerPool | None = None
        self.adapters: ApiAdapters | None = None
        self.load_time_s: float | None = None
        self.successor: Endpoint | None = None
        self.residency: Residency | None = None
        self.residence: Residence | None = None
        self.options: Mapping[str, str] = MappingProxyType({})
        self.entry_point = ""
        self.text = ModelText(name, None, {})

    def check_ready(self) -> None:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    def submit(self, request: GenerationRequest) -> ResultStream:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    def cancel(self, request_id: str) -> bool:
        return False

    def forget_affinity(self, key: str) -> None:
        pass

    async def start(self) -> None:
        pass

    async def drain(self, timeout_s: float) -> None:
        self.state = ModelState.UNLOADED

    async def stop(self) -> None:
        self.state = ModelState.UNLOADED

    async def scale(self, num_workers: int) -> None:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    async def update(self, values: Mapping[str, int]) -> dict[str, Any]:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    def describe(self) -> dict[str, Any]:
        return {"model_name": self.name, "version": self.version, "status": self.state.value, "reason": self.reason,
                "workers": []}

