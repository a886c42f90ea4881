"""``Endpoint``: what the frontends, metrics and health checks may use of a served model version.

Design note: the registry holds one endpoint per model version: a ``ModelEndpoint`` (config, batcher, worker pool)
or a ``FailedEndpoint`` (a configuration that could not be loaded: only its reason). Both implement this protocol,
so a route never asks an endpoint what it has: the members a failed one lacks are None (``config``, ``batcher``,
``pool``, ``adapters``), ``options`` is then empty and ``check_ready``/``submit`` raise ``Unavailable``. The
endpoint owns its model's text side (``text``: tokenizer, chat template, context length), shared by every route.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollcore.types import GenerationRequest, ModelState
    from serving.batching.dynamic import DynamicBatcher
    from serving.batching.rolling import RollingBatcher
    from serving.batching.streams import ResultStream
    from serving.config.model_config import ModelConfig
    from serving.models.adapters import ApiAdapters
    from serving.models.model_text import ModelText
    from serving.models.residency import Residence, Residency
    from serving.worker.pool import WorkerPool

# the built-in text handlers: their bodies are the text APIs' (a custom handler's body is its own)
TEXT_ENTRY_POINTS = ("huggingface", "rolling")


class Endpoint(Protocol):
    """One served model version. Event loop only."""

    name: str
    version: str  # set by the registry (serving.models.versions)
    state: ModelState
    reason: str | None  # why it is FAILED (paths scrubbed)
    load_time_s: float | None
    # a reload replaced it: a request that resolved it before the switch is served there
    successor: Endpoint | None
    residency: Residency | None  # the host's memory budget, when the registry manages one
    residence: Residence | None  # its place under that budget (None: loaded at start and kept, or failed)

    @property
    def config(self) -> ModelConfig | None:
        """The effective configuration; None when it could not be loaded."""

    @property
    def batcher(self) -> DynamicBatcher | RollingBatcher | None: ...

    @property
    def pool(self) -> WorkerPool | None: ...

    @property
    def adapters(self) -> ApiAdapters | None:
        """LoRA adapters registered over the API (rolling batching only)."""

    @property
    def rolling(self) -> bool: ...

    @property
    def info(self) -> Mapping[str, Any]:
        """Its workers' ``describe()`` (max_model_len, chat_template, tasks, adapters, ...); empty until one is
        ready."""

    @property
    def available(self) -> bool:
        """READY with a worker serving now."""

    @property
    def options(self) -> Mapping[str, str]:
        """Its ``option.*`` values without the prefix (empty when its configuration failed)."""

    @property
    def entry_point(self) -> str:
        """The handler it runs (``huggingface``, ``rolling``, ``echo``, a custom module); empty when failed."""

    @property
    def text(self) -> ModelText:
        """Its text side, one per model version (built on first use after its workers are ready)."""

    def check_ready(self) -> None: ...

    def submit(self, request: GenerationRequest) -> ResultStream: ...

    def cancel(self, request_id: str) -> bool: ...

    def forget_affinity(self, key: str) -> None: ...

    async def start(self) -> None: ...

    async def drain(self, timeout_s: float) -> None: ...

    async def stop(self) -> None: ...

    async def scale(self, num_workers: int) -> None: ...

    async def update(self, values: Mapping[str, int]) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...


def is_text_model(ep: Endpoint) -> bool:
    """Served by a built-in text handler (its bodies are the text APIs', counted in the frontend)."""
    return ep.entry_point in TEXT_ENTRY_POINTS


def strict_parameters(ep: Endpoint) -> bool:
    """``option.strict_parameters``: unknown body fields are a 400 instead of being dropped with a warning."""
    return ep.options.get("strict_parameters", "").strip().lower() == "true"
