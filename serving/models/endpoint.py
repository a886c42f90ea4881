"""ModelEndpoint: one served model: its config, state, batcher and worker pool.

Design note: frontends call ``submit`` and get a ``ResultStream``; they never see workers. The endpoint
picks the batcher from the config (dynamic or rolling), builds the worker pool and tracks the model's
lifecycle state (LOADING -> READY, or FAILED with a reason; DRAINING -> UNLOADED on removal). ``submit``
gives every request a server-generated id (the client's id stays for logs, headers and cancel-by-id; see
``serving.models.live_requests``). A model that turns FAILED, or is stopped, fails its pending requests at once.

``update`` changes live knobs (``serving.models.knobs``) without a reload: the batcher takes its values at once
(the engines at their next step), workers started later load with the new configuration, and the worker
count moves inside the new ``[min_worker, max_worker]`` range. ``config`` always holds the effective values;
those changed over the API have the source ``API``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rollcore.errors import InvalidRequest, Unavailable
from rollcore.types import GenerationRequest, ModelState
from serving.batching.dynamic import DynamicBatcher
from serving.batching.ports import BatchObserver, Clock, NullObserver
from serving.batching.rolling import RollingBatcher
from serving.batching.routing import Router
from serving.batching.streams import ResultStream
from serving.config.devices import DevicePlan
from serving.config.model_config import ModelConfig
from serving.ipc.messages import Init
from serving.models import knobs
from serving.models.adapters import ApiAdapters
from serving.models.failed_endpoint import FailedEndpoint
from serving.models.knob_changes import engine_answers, knob_table, updated_config
from serving.models.live_requests import LiveRequests
from serving.models.model_text import ModelText, TextSide
from serving.models.residency import Residence, Residency
from serving.redact import scrub_paths
from serving.worker.launcher import Launcher
from serving.worker.pool import WorkerPool

log = logging.getLogger(__name__)

# live engine options (max_itl_ms travels once set: auto leaves the engine's measured default)
ENGINE_KNOBS = frozenset({"max_rolling_batch_size", "max_rolling_batch_prefill_tokens", "max_itl_ms"})


class ModelEndpoint:
    """The unit frontends talk to. Event-loop only."""

    def __init__(self, config: ModelConfig, observer: BatchObserver | None = None,
                 clock: Clock = time.monotonic, env: Mapping[str, str] | None = None,
                 log_format: str = "text", live: LiveRequests | None = None,
                 devices: DevicePlan | None = None, launcher: Launcher | None = None) -> None:
        self.config = config
        self.name = config.name
        self.version = "1"  # set by the registry (serving.models.versions)
        # set when a reload replaced this endpoint: a request that resolved it before the switch is served there
        self.successor: ModelEndpoint | None = None
        self._live = live if live is not None else LiveRequests()
        self.state = ModelState.PENDING
        self.reason: str | None = None
        self._observer = observer or NullObserver()
        self.load_time_s: float | None = None
        self._texts = TextSide(self.name, config.model_dir, config.options)  # the tokenizer every route reads
        self._autoscaler: asyncio.Task[None] | None = None
        self._update_lock = asyncio.Lock()
        b = config.batching
        self.batcher: DynamicBatcher | RollingBatcher
        if b.rolling:
            self.batcher = RollingBatcher(self.name, b.max_rolling_batch_size, b.job_queue_size,
                                          config.predict_timeout_s, self._observer, clock,
                                          max_queue_time_s=b.max_queue_time_s,
                                          liveness_timeout_s=config.liveness_timeout_s,
                                          router=Router(b.routing, b.routing_max_imbalance))
            self.adapters: ApiAdapters | None = ApiAdapters(self.name, self.batcher, config.liveness_timeout_s)
        else:
            self.adapters = None
            self.batcher = DynamicBatcher(self.name, b.batch_size, b.max_batch_delay_ms, b.job_queue_size,
                                          config.predict_timeout_s, self._observer, clock,
                                          max_queue_time_s=b.max_queue_time_s)
        if b.rolling_batch_requested == "auto" and not b.rolling:
            log.warning("model %s: option.rolling_batch=auto falls back to dynamic batching: %s", self.name,
                        b.rolling_batch_reason)
        else:
            log.info("model %s: %s batching: %s", self.name, "rolling" if b.rolling else "dynamic",
                     b.rolling_batch_reason)
        if config.layout_reason:
            log.info("model %s: %d-%d workers: %s", self.name, config.min_workers, config.max_workers,
                     config.layout_reason)
        entry = config.entry_point
        if b.rolling and entry in ("huggingface", "djl_python.huggingface"):
            entry = "rolling"
        init = Init(model_name=self.name, model_dir=str(config.model_dir), entry_point=entry,
                    properties=config.handler_properties(), rolling=b.rolling, log_format=log_format)
        self._new_pool = lambda: WorkerPool(self.name, init, self.batcher, self.config.min_workers,
                                            config.model_loading_timeout_s, on_failed=self._failed, env=env,
                                            devices=devices, launcher=launcher)
        self.pool = self._new_pool()
        self._batcher_started = False
        # the host's memory budget (serving.models.residency), when the registry manages one
        self.residency: Residency | None = None
        self.residence: Residence | None = None  # given by the residency (its manage)

    @classmethod
    def failed(cls, name: str, reason: str) -> FailedEndpoint:
        return FailedEndpoint(name, reason)

    @property
    def rolling(self) -> bool:
        return self.config.batching.rolling

    @property
    def options(self) -> Mapping[str, str]:
        return self.config.options

    @property
    def entry_point(self) -> str:
        return self.config.entry_point

    @property
    def text(self) -> ModelText:
        """The model's tokenizer, chat template and context length, shared by every route."""
        return self._texts.get(self.pool.info)

    @property
    def info(self) -> dict[str, Any]:
        """The handler's ``describe()`` (max_model_len, chat_template, ...) from the first ready worker; its
        ``adapters`` include those registered over the API."""
        info = self.pool.info
        if "adapters" in info and self.adapters is not None and self.adapters.registered:
            info = {**info, "adapters": sorted({*info["adapters"], *self.adapters.registered})}
        return info

    @property
    def available(self) -> bool:
        """READY with a worker serving now (not while its only worker restarts, e.g. after losing a host)."""
        return self.state is ModelState.READY and self.pool.num_serving > 0

    async def start(self) -> None:
        self.state = ModelState.LOADING
        t0 = time.monotonic()
        if not self._batcher_started:  # a model loaded again after an unload keeps its batcher
            self._batcher_started = True
            self.batcher.start()
        if await self.pool.start():
            self.state = ModelState.READY
            self.load_time_s = time.monotonic() - t0
            log.info("model %s ready in %.1fs (%s batching)", self.name, self.load_time_s,
                     "rolling" if self.rolling else "dynamic")
            self._start_autoscaler()

    def _start_autoscaler(self) -> None:
        if self._autoscaler is None and self.config.max_workers > self.pool.target:
            self._autoscaler = asyncio.create_task(self._autoscale())

    async def _autoscale(self, interval_s: float = 0.5) -> None:
        """DJL-style elasticity between minWorkers and maxWorkers: add a worker while requests keep
        queueing for two checks in a row; retire one after ``max_idle_time`` with nothing pending."""
        busy_checks = 0
        idle_since = time.monotonic()
        while self.state is ModelState.READY:
            await asyncio.sleep(interval_s)
            c = self.config  # changed by update()
            now = time.monotonic()
            busy_checks = busy_checks + 1 if self.batcher.num_queued() > 0 else 0
            if self.batcher.num_pending():
                idle_since = now
            if busy_checks >= 2 and self.pool.target < c.max_workers:
                busy_checks = 0
                log.info("model %s: scaling up to %d workers (requests queueing)", self.name, self.pool.target + 1)
                await self.pool.scale(self.pool.target + 1)
            elif self.pool.target > max(1, c.min_workers) and now - idle_since >= c.max_idle_time_s:
                idle_since = now
                log.info("model %s: scaling down to %d workers (idle)", self.name, self.pool.target - 1)
                await self.pool.scale(self.pool.target - 1)

    def _failed(self, reason: str) -> None:
        self.state = ModelState.FAILED
        self.reason = scrub_paths(reason, {str(self.config.model_dir): self.name})
        self.batcher.fail_pending(Unavailable(f"model {self.name!r} is FAILED: {self.reason}"))

    def check_ready(self) -> None:
        """Raises ``Unavailable`` (503, Retry-After) unless the model (or the version replacing it) is READY: routes
        call it before they read the model's tokenizer or chat template, which a model that is not READY lacks."""
        if self.successor is not None:
            self.successor.check_ready()
            return
        if self.state is not ModelState.READY and self.residency is not None:
            self.residency.refuse(self, load=False)  # not loaded: says when it could be
        if self.state is not ModelState.READY:
            detail = f": {self.reason}" if self.reason else ""
            raise Unavailable(f"model {self.name!r} is {self.state.value}{detail}", retry_after_s=5)

    def submit(self, request: GenerationRequest) -> ResultStream:
        """Queue ``request`` (its ``request_id`` is the client's id; see ``GenerationRequest``). Raises
        ``Unavailable`` unless READY, ``Conflict`` for a client id already live, ``Overloaded``."""
        if self.successor is not None:
            return self.successor.submit(request)
        # a model that loaded before waits in its queue for a load on demand; one never loaded is refused, loading
        if self.residency is None or not self.residency.queues(self):
            if self.residency is not None:
                self.residency.refuse(self)
            self.check_ready()
        # a custom handler would ignore these: refuse rather than answer without them
        if request.params.grammar is not None and not self.info.get("structured_output"):
            raise InvalidRequest(f"model {self.name!r} does not apply structured-output constraints (its handler "
                                 "is not one of the built-in text handlers)")
        if request.params.num_beams > 1 and not self.info.get("beam_search"):
            raise InvalidRequest(f"model {self.name!r} does not run beam search (parameter 'num_beams' > 1): beam "
                                 "search runs on dynamic batching with the built-in handler (not the rolling engine)")
        if request.params.adapter is not None and "adapters" not in self.info:
            raise InvalidRequest(f"model {self.name!r} does not serve LoRA adapters ('adapters' / 'adapter_id'): they "
                                 "run on the rolling engine (option.rolling_batch with option.enable_lora)")
        tasks = self.info.get("tasks")  # the built-in handlers' (handlers.embedding.EmbeddingTask.describe)
        if request.params.embed and "embedding" not in (tasks or ()):
            raise InvalidRequest(f"model {self.name!r} does not compute embeddings" + (
                f" (it serves the tasks {', '.join(tasks)})" if tasks else
                " (its handler is not one of the built-in model handlers)"))
        if not request.params.embed and tasks == ["embedding"]:
            raise InvalidRequest(f"model {self.name!r} serves the task 'embedding' (option.task=embedding): it "
                                 "generates no text; use POST /v1/embeddings")
        if request.params.prompt_logprobs is not None and not self.info.get("prompt_logprobs"):
            raise InvalidRequest(f"model {self.name!r} does not compute prompt log-probabilities (its handler is not "
                                 "one of the built-in text handlers)")
        client_id = request.client_id or request.request_id
        internal = self._live.claim(client_id, self)
        try:
            stream = self.batcher.submit(replace(request, request_id=internal, client_id=client_id))
        except BaseException:
            self._live.release(client_id, internal)
            raise
        stream.add_finish_callback(lambda _: self._live.release(client_id, internal))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel by the server's id (``serving.models.live_requests`` maps client ids to it)."""
        return self.batcher.cancel(request_id)

    def forget_affinity(self, key: str) -> None:
        """A session ended: its requests' worker is no longer remembered (rolling batching remembers one)."""
        forget = getattr(self.batcher, "forget_affinity", None)
        if forget is not None:
            forget(key)

    async def scale(self, num_workers: int) -> None:
        await self.pool.scale(num_workers)

    # --- live knobs ---
    async def update(self, values: Mapping[str, int]) -> dict[str, Any]:
        """Change live knobs (names and values checked by ``serving.models.knobs``; the worker range by the
        registry). Everything is checked before anything changes. Raises ``InvalidRequest`` for a knob of the
        other batching mode, a handler that cannot change one live, or ``min_worker`` > ``max_worker``;
        ``Unavailable`` unless READY. Returns what changed and the effective knobs."""
        async with self._update_lock:
            if self.state is not ModelState.READY:
                raise Unavailable(f"model {self.name!r} is {self.state.value}; its knobs change once it is READY",
                                  retry_after_s=5)
            new, changed = updated_config(self.config, values, self.rolling, self.pool.workers)
            engine_options: dict[str, int] = {}
            if ENGINE_KNOBS & set(changed):  # the engines get both limits, so that every one has the same
                engine_options = {k: int(new.options[k]) for k in sorted(ENGINE_KNOBS)
                                  if str(new.options.get(k) or "").isdigit()}  # max_itl_ms auto: left out
            self.config = new
            self.pool.update_init(new.handler_properties())
            b = new.batching
            answer: dict[str, Any] = {}
            if isinstance(self.batcher, RollingBatcher):
                acks = self.batcher.configure(max_rolling_batch_size=b.max_rolling_batch_size,
                                              job_queue_size=b.job_queue_size, engine_options=engine_options)
                answer["engines"] = await engine_answers(self.name, acks, self.config.liveness_timeout_s)
            else:
                answer["batches_before"] = self.batcher.num_batches  # the batches that went out before the change
                self.batcher.configure(batch_size=b.batch_size, max_batch_delay_ms=b.max_batch_delay_ms,
                                       job_queue_size=b.job_queue_size)
            retiring: list[int] = []
            if {"min_worker", "max_worker"} & set(changed):
                target = min(max(self.pool.target, max(1, new.min_workers)), new.max_workers)
                if target != self.pool.target or self.pool.num_serving != target:
                    retiring = await self.pool.scale(target)
                self._start_autoscaler()
            log.info("model %s: changed over the API: %s", self.name,
                     ", ".join(f"{k}={v}" for k, v in changed.items()))
            return {"status": f"model {self.name!r} updated", "modelName": self.name, "changed": changed,
                    **answer, "target_workers": self.pool.target, "retiring_workers": retiring,
                    "knobs": self.knobs()}

    def knobs(self) -> dict[str, dict[str, Any]]:
        """Every live knob: its value, where it came from and whether it applies (``serving.models.knob_changes``)."""
        return knob_table(self.config, self.rolling)

    async def unload(self) -> None:
        """Stop the workers and keep the model registered (evicted under the memory budget): the next ``start``
        loads it again with a fresh pool; what the handler described (``info``) stays known meanwhile."""
        self.state = ModelState.UNLOADED
        if self._autoscaler is not None:
            self._autoscaler.cancel()
            self._autoscaler = None
        old = self.pool
        self.pool = self._new_pool()  # with the knobs changed over the API since
        self.pool.update_init(self.config.handler_properties())
        self.pool.info, self.pool.num_restarts = old.info, old.num_restarts
        await old.stop()

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, wait up to ``timeout_s`` for in-flight ones, then stop the workers."""
        if self.state is ModelState.READY:
            self.state = ModelState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self.batcher.num_pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        self.residency = None  # unregistered (or the server stops): never loaded again on demand
        if self._autoscaler is not None:
            self._autoscaler.cancel()
        await self.pool.stop()
        await self.batcher.close(f"model {self.name!r} was unloaded before this request finished")
        self.state = ModelState.UNLOADED

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "model_name": self.name, "version": self.version, "status": self.state.value, "reason": self.reason,
            "model_dir": c.model_dir.name, "entry_point": c.entry_point,
            "batching": "rolling" if self.rolling else "dynamic",
            "rolling_batch": c.batching.describe_rolling_batch(),
            # the rolling engine's word on the architecture, from its worker's load reply (``Ready.info``):
            # "verified list" or "load-time self-check (...)"; None before a worker is ready, or not the engine
            "admitted": self.info.get("admitted"),
            # its inter-token latency target as loaded (max_itl_ms in force, the auto default it measured); the
            # engines' stats (batcher.engines) say what is in force since
            "itl_target": self.info.get("itl_target"),
            "batch_size": c.batching.batch_size, "max_batch_delay": c.batching.max_batch_delay_ms,
            "job_queue_size": c.batching.job_queue_size, "min_workers": c.min_workers,
            "max_workers": c.max_workers, "target_workers": self.pool.target, "workers": self.pool.describe(),
            "worker_restarts": self.pool.num_restarts, "load_time_s": self.load_time_s,
            "config": c.handler_properties(), "batcher": self.batcher.describe(), "knobs": self.knobs(),
            "sources": {key: {"source": knobs.source_kind(raw), "from": raw} for key, raw in sorted(c.sources.items())},
            **({"residency": self.residency.describe(self)} if self.residency is not None else {}),
        }
