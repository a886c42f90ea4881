"""Server and model configuration, parsed once into frozen dataclasses.

Design note: this is the only module that interprets ``config.properties``, ``serving.properties`` and
environment variables; the environment arrives as an explicit ``env`` mapping (the composition root
passes ``os.environ``), so tests pass plain dicts. Every value is validated here, once; an invalid one
raises ``ConfigError`` naming where it came from, the key and the value, e.g.
``model/serving.properties:3: batch_size = 'abc': expected an integer >= 1`` or
``env SERVING_BATCH_SIZE: batch_size = 'abc': ...``.

Precedence, highest first: ``overrides`` (CLI flags, management API) > environment > file > default.

Environment mapping (DJL Serving conventions):
- ``OPTION_<KEY>`` -> ``option.<key>`` (lower-cased; known options such as ``option.entryPoint`` match
  case-insensitively, ignoring ``_``: ``OPTION_ENTRYPOINT``). ``HF_MODEL_ID`` -> ``option.model_id``
  unless ``OPTION_MODEL_ID`` is set.
- ``SERVING_<KEY>`` -> a model key (``SERVING_BATCH_SIZE`` -> ``batch_size``, ``SERVING_MIN_WORKERS`` ->
  ``minWorkers``) or a server key (``SERVING_INFERENCE_ADDRESS``). ``job_queue_size`` is a server key:
  ``SERVING_JOB_QUEUE_SIZE`` sets the server default, which models inherit unless they set their own.
  Unrecognised ``SERVING_*`` variables (DJL's ``SERVING_OPTS``) are ignored.
- ``SAGEMAKER_NUM_MODEL_WORKERS`` -> ``minWorkers`` and ``maxWorkers``; ``SAGEMAKER_BIND_TO_PORT`` ->
  ``sagemaker_port``; ``SAGEMAKER_MAX_REQUEST_SIZE`` (bytes) or ``SAGEMAKER_MAX_PAYLOAD_IN_MB`` ->
  ``max_request_size``. ``SERVING_*``/``OPTION_*`` win over these.

Keys in files and overrides match known keys case-insensitively, ignoring ``_`` and ``.``; an unknown
key without the ``option.`` prefix is an error; unknown ``option.*`` keys pass through to the handler,
with a warning (``ModelConfig.warnings``) when one looks like a typo of a known option
(``unknown option.max_rolling_bach_size: did you mean option.max_rolling_batch_size?``). Values are
stripped of surrounding whitespace and parsed by ``rollcore.values``; the ``option.*`` keys rollserve reads
are defined once, in the option schema ``rollcore.options``, which the handlers parse with too.

``option.rolling_batch`` is resolved here, once (``serving.config.rolling_choice`` says how), to the batching the
model gets, so the frontend builds the right batcher before any worker starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rollcore.errors import ConfigError
from rollcore.model_folder import weights_folder
from rollcore.options import (
    LOADER,
    OPTIONS,
    SERVING,
    OptionSpec,
    handlers_of,
    reads,
    suggest,
)
from rollcore.values import (
    AUTO,
    Parser,
    alternative,
    model_name,
    render,
    text,
)
from serving.config.keys import MODEL_KEYS
from serving.config.layout import auto_layout, checkpoint_parameters, server_cores
from serving.config.rolling_choice import ENGINE_ENTRY_POINTS, choose_rolling_batch, embedding_encoder
from serving.config.server_config import ServerConfig
from serving.config.settings import (
    EMPTY,
    Setting,
    canonical_keys,
    empty_mapping,
    env_setting,
    fail,
    norm,
    override_settings,
    read_file,
    resolve,
)

MODEL_PROPERTIES = "serving.properties"


def validate_model_name(name: str) -> str:
    """Return ``name`` if it matches ``^[A-Za-z0-9][A-Za-z0-9._-]*$``; else raise ConfigError."""
    try:
        return model_name(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------
# Model configuration (serving.properties)

@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """How requests are grouped: dynamic batching (``batch_size``, ``max_batch_delay_ms``) or rolling."""

    batch_size: int = 1
    max_batch_delay_ms: int = 100
    job_queue_size: int = 1000
    max_queue_time_s: float = 60.0  # a request waiting this long for a worker gets 503 + Retry-After
    rolling_batch: str = "disable"  # effective: "scheduler" (rolling) or "disable" (dynamic batching)
    max_rolling_batch_size: int = 32
    max_rolling_batch_prefill_tokens: int = 2048
    rolling_batch_requested: str = "disable"  # option.rolling_batch as configured: one of ROLLING_BATCH_MODES
    rolling_batch_reason: str = "option.rolling_batch=disable: dynamic batching"  # why ``rolling_batch``
    routing: str = "prefix"  # rolling: how a request's worker is picked (serving.batching.routing)
    routing_max_imbalance: int = 4  # rolling: most requests a chosen worker may run beyond the least loaded

    @property
    def rolling(self) -> bool:
        """True when the model runs a rolling (continuous) batch instead of dynamic batches."""
        return self.rolling_batch != "disable"

    def describe_rolling_batch(self) -> dict[str, str]:
        """``{"requested", "effective", "reason"}``: what ``GET /models/{name}`` reports."""
        return {"requested": self.rolling_batch_requested, "effective": self.rolling_batch,
                "reason": self.rolling_batch_reason}


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallel degree (``max`` already resolved) and the devices a model may use."""

    tensor_parallel_degree: int = 1
    load_on_devices: str = "*"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """One model's effective configuration.

    ``options`` holds every ``option.*`` key, prefix stripped: the keys of the schema (``rollcore.options``)
    that the frontend or the model's handler reads with their effective value, defaults included, and any
    other key as set. ``sources`` maps each full key to ``serving.properties:LINE``, ``env VAR``,
    ``default``, ``server config (<where the server's value came from>)``, ``override`` (registration
    parameters) or ``API`` (changed on the live model, ``serving.models.knobs``). ``warnings``: an unknown
    ``option.*`` key close to a known one (``unknown option.x: did you mean option.y? (source)``), for
    ``serving config`` to print and the registry to log.
    """

    name: str
    model_dir: Path
    entry_point: str
    engine: str = "Python"
    min_workers: int = 1
    max_workers: int = 1
    max_idle_time_s: int = 60
    predict_timeout_s: float = 120.0
    model_loading_timeout_s: float = 600.0
    liveness_timeout_s: float = 60.0  # rolling: a worker with work pending and no step for this long is restarted
    trust_remote_code: bool = False
    dtype: str = "fp32"
    model_id: str | None = None
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    options: Mapping[str, str] = field(default_factory=empty_mapping)
    # accepted model keys without a typed field (required_memory_mb, gpu.maxWorkers, ...), as set
    extra: Mapping[str, str] = field(default_factory=empty_mapping)
    sources: Mapping[str, str] = field(default_factory=empty_mapping)
    warnings: tuple[str, ...] = ()
    layout_reason: str = ""  # why minWorkers / maxWorkers = auto came out as they did (serving.config.layout)

    def handler_properties(self) -> dict[str, str]:
        """What the handler's ``Context.properties`` receives: options (prefix stripped) + model keys."""
        props = dict(self.options)
        props.update(self.extra)
        props.update({
            "engine": self.engine,
            "batch_size": str(self.batching.batch_size),
            "max_batch_delay": str(self.batching.max_batch_delay_ms),
            "job_queue_size": str(self.batching.job_queue_size),
            "max_queue_time": render(self.batching.max_queue_time_s),
            "minWorkers": str(self.min_workers),
            "maxWorkers": str(self.max_workers),
            "max_idle_time": str(self.max_idle_time_s),
            "load_on_devices": self.parallel.load_on_devices,
        })
        return props


_TYPED_MODEL_KEYS = ("engine", "batch_size", "max_batch_delay", "job_queue_size", "max_queue_time", "minWorkers",
                     "maxWorkers", "max_idle_time", "load_on_devices")
# Every option of the schema, by its full key (``option.dtype``).
OPTION_SPECS: dict[str, OptionSpec] = {f"option.{key}": spec for key, spec in OPTIONS.items()}
_KNOWN_MODEL_KEYS = {norm(key): key for key in (*MODEL_KEYS, *OPTION_SPECS)}


def model_config_keys() -> tuple[str, ...]:
    """Every known model key (``batch_size``, ``minWorkers``, ``option.dtype``, ``option.block_size``, ...) as
    spelled in files: the model keys and the option schema."""
    return (*MODEL_KEYS, *OPTION_SPECS)

# Server-level keys that SERVING_* sets on the server, not on each model.
_SERVER_LEVEL_MODEL_KEYS = frozenset({"job_queue_size", "max_queue_time", "load_on_demand"})


def _model_env(env: Mapping[str, str]) -> dict[str, Setting]:
    """Model settings from the environment; specific variables override generic ones."""
    settings: dict[str, Setting] = {}
    if "HF_MODEL_ID" in env:
        settings["option.model_id"] = env_setting("HF_MODEL_ID", env["HF_MODEL_ID"])
    if "SAGEMAKER_NUM_MODEL_WORKERS" in env:
        workers = env_setting("SAGEMAKER_NUM_MODEL_WORKERS", env["SAGEMAKER_NUM_MODEL_WORKERS"])
        settings["minWorkers"] = settings["maxWorkers"] = workers
    for var in sorted(env):
        if var.startswith("SERVING_"):
            key = _KNOWN_MODEL_KEYS.get(norm(var[len("SERVING_"):]))
            if key is not None and key in MODEL_KEYS and key not in _SERVER_LEVEL_MODEL_KEYS:
                settings[key] = env_setting(var, env[var])
        elif var.startswith("OPTION_") and len(var) > len("OPTION_"):
            option = "option." + var[len("OPTION_"):].lower()
            settings[_KNOWN_MODEL_KEYS.get(norm(option), option)] = env_setting(var, env[var])
    return settings


def _option_parser(key: str, spec: OptionSpec, num_devices: int) -> Parser:
    if key == "option.tensor_parallel_degree":  # 'max': every device (the handler gets the count)
        return alternative("max", lambda: num_devices, spec.parser)
    return spec.parser


def _unknown_option_warnings(settings: Mapping[str, Setting]) -> tuple[str, ...]:
    """``unknown option.x: did you mean option.y? (source)`` for each unknown ``option.*`` key close to a known
    one; other unknown keys are a custom handler's own and pass silently."""
    found = []
    for key, setting in settings.items():
        if key.startswith("option.") and key not in OPTION_SPECS:
            known = suggest(key[len("option."):])
            if known is not None:
                found.append(f"unknown {key}: did you mean option.{known}? ({setting.source})")
    return tuple(found)


def load_model_config(model_dir: Path, *, name: str | None = None, env: Mapping[str, str] = EMPTY,
                      overrides: Mapping[str, str] = EMPTY, server: ServerConfig | None = None,
                      num_devices: int | None = None) -> ModelConfig:
    """Read ``model_dir/serving.properties`` (optional) and build the model's effective config.

    ``name`` defaults to the folder name. ``server`` supplies defaults that models inherit
    (``job_queue_size``). ``num_devices`` resolves ``option.tensor_parallel_degree=max`` (default: the
    CPU count; the composition root passes the accelerator count). The options of the schema that the
    frontend or a built-in handler of the entry point reads are validated here; the defaults of those the
    model's handler reads are added (``serving config`` shows them). Raises ``ConfigError``.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: model folder not found")
    name = validate_model_name(name if name is not None else model_dir.name)
    path = model_dir / MODEL_PROPERTIES
    raw = read_file(path) if path.is_file() else []
    override_raw = override_settings(overrides)

    defaults = {key: Setting(default, "default", "default")
                for key, spec in MODEL_KEYS.items() if (default := spec.default) is not None}
    defaults.update({key: Setting(spec.default, "default", "default") for key, spec in OPTION_SPECS.items()
                     if spec.default is not None and spec.readers & {SERVING, LOADER}})
    defaults["option.entryPoint"] = Setting(
        "model.py" if (model_dir / "model.py").is_file() else "huggingface", "default", "default")
    if server is not None:
        inherit = [("job_queue_size", str(server.job_queue_size)), ("max_queue_time", render(server.max_queue_time_s))]
        if server.load_on_demand:  # only when on: models that do not say stay as they were
            inherit.append(("load_on_demand", "true"))
        for key, value in inherit:
            inherited = f"server config ({server.sources.get(key, 'default')})"
            defaults[key] = Setting(value, inherited, inherited)
    settings = {**defaults,
                **canonical_keys(raw, _KNOWN_MODEL_KEYS, allow_options=True),
                **_model_env(env),
                **canonical_keys(override_raw, _KNOWN_MODEL_KEYS, allow_options=True)}

    entry_point = resolve("option.entryPoint", settings["option.entryPoint"], text)
    # Validated: the model keys, and the options that the frontend or a handler of this entry point reads
    # (a custom handler's keys are its own business, even when the schema knows the name).
    parsers = {key: spec.parser for key, spec in MODEL_KEYS.items()}
    num_devices = num_devices or os.cpu_count() or 1
    parsers.update({key: _option_parser(key, spec, num_devices) for key, spec in OPTION_SPECS.items()
                    if reads(spec, handlers_of(entry_point))})
    values: dict[str, Any] = {key: resolve(key, setting, parsers[key]) if key in parsers else setting.value
                              for key, setting in settings.items()}
    layout_reason = _resolve_auto_workers(values, model_dir)
    if values["minWorkers"] > values["maxWorkers"]:
        max_setting = settings["maxWorkers"]
        raise fail("minWorkers", settings["minWorkers"],
                    f"must be <= maxWorkers ({max_setting.value}, from {max_setting.source})")
    max_model_len = values.get("option.max_model_len")
    rolling_batch, rolling_reason = choose_rolling_batch(
        values["option.rolling_batch"], settings["option.rolling_batch"], entry_point,
        model_dir, values.get("option.model_id"), max_model_len if isinstance(max_model_len, int) else None)
    if values.get("option.task") == "embedding" and rolling_batch != "disable" and entry_point in ENGINE_ENTRY_POINTS:
        rolling_batch, rolling_reason = embedding_encoder(
            values["option.rolling_batch"], settings["option.rolling_batch"],
            weights_folder(model_dir, values.get("option.model_id")), rolling_batch, rolling_reason)
    # The defaults of the options that the handler the model runs reads.
    runs = handlers_of(entry_point, rolling_batch != "disable")
    for key, spec in OPTION_SPECS.items():
        if key not in settings and spec.default is not None and reads(spec, runs):
            settings[key] = Setting(spec.default, "default", "default")
            values[key] = resolve(key, settings[key], spec.parser)

    return ModelConfig(
        name=name,
        model_dir=model_dir.resolve(),
        entry_point=entry_point,
        engine=values["engine"],
        min_workers=values["minWorkers"],
        max_workers=values["maxWorkers"],
        max_idle_time_s=values["max_idle_time"],
        predict_timeout_s=values["option.predict_timeout"],
        model_loading_timeout_s=values["option.model_loading_timeout"],
        liveness_timeout_s=values["option.liveness_timeout"],
        trust_remote_code=values["option.trust_remote_code"],
        dtype=values["option.dtype"],
        model_id=values.get("option.model_id"),
        batching=BatchingConfig(
            batch_size=values["batch_size"],
            max_batch_delay_ms=values["max_batch_delay"],
            job_queue_size=values["job_queue_size"],
            max_queue_time_s=values["max_queue_time"],
            rolling_batch=rolling_batch,
            max_rolling_batch_size=values["option.max_rolling_batch_size"],
            max_rolling_batch_prefill_tokens=values["option.max_rolling_batch_prefill_tokens"],
            rolling_batch_requested=values["option.rolling_batch"],
            rolling_batch_reason=rolling_reason,
            routing=values["option.routing"],
            routing_max_imbalance=values["option.routing_max_imbalance"],
        ),
        parallel=ParallelConfig(tensor_parallel_degree=values["option.tensor_parallel_degree"],
                                load_on_devices=values["load_on_devices"]),
        options=MappingProxyType({key[len("option."):]: render(value)
                                  for key, value in sorted(values.items()) if key.startswith("option.")}),
        extra=MappingProxyType({key: render(value) for key, value in values.items()
                                if key in MODEL_KEYS and key not in _TYPED_MODEL_KEYS}),
        sources=MappingProxyType({key: setting.source for key, setting in settings.items()}),
        warnings=_unknown_option_warnings(settings),
        layout_reason=layout_reason,
    )


def _resolve_auto_workers(values: dict[str, Any], model_dir: Path) -> str:
    """Replace ``auto`` in minWorkers / maxWorkers by the layout ``serving.config.layout`` picks; returns why ('' when
    neither is auto). One auto bound follows the other's number where that is larger."""
    if AUTO not in (values["minWorkers"], values["maxWorkers"]):
        return ""
    tp = values.get("option.tensor_parallel_degree", 1)
    folder = weights_folder(model_dir, values.get("option.model_id"))
    layout = auto_layout(server_cores(), checkpoint_parameters(folder), tp if isinstance(tp, int) else 1)
    lo, hi = values["minWorkers"], values["maxWorkers"]
    values["minWorkers"] = layout.workers if lo == AUTO else lo
    values["maxWorkers"] = max(layout.workers, values["minWorkers"]) if hi == AUTO else hi
    if lo == AUTO and values["minWorkers"] > values["maxWorkers"]:
        values["minWorkers"] = values["maxWorkers"]
    return f"workers auto: {layout.reason}"
