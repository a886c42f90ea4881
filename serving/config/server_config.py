"""The server's configuration (``config.properties``, ``SERVING_*`` and SageMaker's variables), parsed once
into a frozen ``ServerConfig``. Keys, parsers and defaults: ``serving.config.keys.SERVER_KEYS``; an invalid value
fails naming where it came from (``serving.config.settings``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from rollcore.errors import ConfigError
from rollcore.values import integer, split_host_port
from serving.config.keys import SERVER_KEYS
from serving.config.memory_budget import BudgetSetting
from serving.config.settings import (
    EMPTY,
    Setting,
    canonical_keys,
    empty_mapping,
    env_setting,
    norm,
    override_settings,
    read_file,
    resolve,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Process-wide settings. Addresses are validated at load; ``grpc_address`` is "" when gRPC is off.
    ``sagemaker_port`` (from ``SAGEMAKER_BIND_TO_PORT``) is for the composition root to honour."""

    inference_address: str = "http://127.0.0.1:8080"
    management_address: str = "http://127.0.0.1:8081"
    grpc_address: str = "127.0.0.1:8001"
    metrics_address: str | None = None
    model_store: Path = Path("model_store")
    load_models: tuple[str, ...] = ("ALL",)
    job_queue_size: int = 1000
    max_request_size: int = 64 * 1024 * 1024
    drain_timeout_s: float = 30.0
    sagemaker_port: int | None = None
    log_format: str = "text"
    max_queue_time_s: float = 60.0
    ping_requires: str = "all"  # readiness: every load_models model READY, any model READY, or none (liveness)
    health_generate_timeout_s: float = 10.0  # the deep check's wait for each probe's token
    health_generate_interval_s: float = 5.0  # the deep check's result is reused this long
    # Security: token authorization (TorchServe-style), the model API switch, browser/DNS-rebinding guards.
    disable_token_authorization: bool = False
    inference_auth: str = "auto"  # auto: required when the inference address is not loopback
    key_file: Path | None = None  # None: key_file.json in the working directory, removed at shutdown
    # where remote and GGUF models are cached as local folders (serving.sources); None: ~/.cache/rollserve/models
    model_cache_dir: Path | None = None
    management_token: str | None = field(default=None, repr=False)
    inference_token: str | None = field(default=None, repr=False)
    enable_model_api: bool = False
    management_allowed_hosts: tuple[str, ...] = ()
    management_allowed_origins: tuple[str, ...] = ()
    # Caps on what one request or one client may ask for (amplification).
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 64
    max_sequences_per_request: int = 64
    max_models: int = 32
    max_workers_per_model: int = 16
    grpc_max_concurrent_rpcs: int = 1000
    grpc_max_stream_requests: int = 64
    # the watched model store (serving.models.store_watch): folders load, reload and unload as they change on disk
    model_store_watch: bool = False
    model_store_watch_quiet_ms: int = 1000
    worker_fork_server: bool = True  # serving.worker.launcher
    worker_preload: tuple[str, ...] = ()
    # residency (serving.models.residency): the models' memory budget, the wait for a load on demand
    model_memory_budget: BudgetSetting = BudgetSetting(share=0.8)
    model_load_wait_s: float = 60.0
    load_on_demand: bool = False
    sources: Mapping[str, str] = field(default_factory=empty_mapping)

    def inference_host_port(self) -> tuple[str, int]:
        """``(host, port)`` of the inference listener; port 0 means an ephemeral port."""
        return _http_host_port(self.inference_address)

    def management_host_port(self) -> tuple[str, int] | None:
        """``(host, port)`` of the management listener, or None when ``management_address=off``."""
        return _http_host_port(self.management_address) if self.management_address else None

    @property
    def management_enabled(self) -> bool:
        """False when ``management_address=off``: no management listener and no gRPC management RPCs."""
        return bool(self.management_address)

    def inference_auth_required(self) -> bool:
        """Inference needs its token: ``inference_auth=true``, or ``auto`` on a non-loopback address."""
        if self.disable_token_authorization or self.inference_auth == "false":
            return False
        if self.inference_auth == "true":
            return True
        return not is_loopback(self.inference_host_port()[0])

    def metrics_host_port(self) -> tuple[str, int] | None:
        """``(host, port)`` of a separate metrics listener, or None to serve metrics elsewhere."""
        return _http_host_port(self.metrics_address) if self.metrics_address else None

    def grpc_host_port(self) -> tuple[str, int] | None:
        """``(host, port)`` of the gRPC listener, or None when gRPC is disabled."""
        return split_host_port(self.grpc_address) if self.grpc_address else None


def _http_host_port(address: str) -> tuple[str, int]:
    return split_host_port(address.partition("://")[2].rstrip("/"))


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _token(var: str, value: str) -> str:
    """A token from the environment: 8-256 printable ASCII characters without spaces (never echoed)."""
    if not 8 <= len(value) <= 256 or not value.isascii() or not value.isprintable() or " " in value:
        raise ConfigError(f"env {var}: expected 8 to 256 printable ASCII characters without spaces "
                          "(the value is not shown)")
    return value


_KNOWN_SERVER_KEYS = {norm(key): key for key in SERVER_KEYS}


def _server_env(env: Mapping[str, str]) -> dict[str, Setting]:
    settings: dict[str, Setting] = {}
    if "SAGEMAKER_MAX_PAYLOAD_IN_MB" in env:
        setting = env_setting("SAGEMAKER_MAX_PAYLOAD_IN_MB", env["SAGEMAKER_MAX_PAYLOAD_IN_MB"])
        megabytes = resolve("max_request_size", setting, integer(1))
        settings["max_request_size"] = Setting(str(megabytes * 1024 * 1024), setting.source, setting.where)
    if "SAGEMAKER_MAX_REQUEST_SIZE" in env:
        var = "SAGEMAKER_MAX_REQUEST_SIZE"
        settings["max_request_size"] = env_setting(var, env[var])
    for var in sorted(env):
        if var.startswith("SERVING_"):
            key = _KNOWN_SERVER_KEYS.get(norm(var[len("SERVING_"):]))
            if key is not None:
                settings[key] = env_setting(var, env[var])
    return settings


def load_server_config(path: Path | None, *, env: Mapping[str, str] = EMPTY,
                       overrides: Mapping[str, str] = EMPTY) -> ServerConfig:
    """Read ``config.properties`` at ``path`` (None: defaults only) and apply env and overrides.

    A relative ``model_store`` is kept as given (relative to the working directory). Raises ``ConfigError``
    for an unreadable file, an unknown key or a bad value.
    """
    raw = read_file(Path(path)) if path is not None else []
    override_raw = override_settings(overrides)
    defaults = {key: Setting(default, "default", "default")
                for key, spec in SERVER_KEYS.items() if (default := spec.default) is not None}
    settings = {**defaults,
                **canonical_keys(raw, _KNOWN_SERVER_KEYS, allow_options=False),
                **_server_env(env),
                **canonical_keys(override_raw, _KNOWN_SERVER_KEYS, allow_options=False)}
    values = {key: resolve(key, setting, SERVER_KEYS[key].parser) for key, setting in settings.items()}
    sources = {key: setting.source for key, setting in settings.items()}

    sagemaker_port = None
    if "SAGEMAKER_BIND_TO_PORT" in env:
        setting = env_setting("SAGEMAKER_BIND_TO_PORT", env["SAGEMAKER_BIND_TO_PORT"])
        sagemaker_port = resolve("sagemaker_port", setting, integer(1, 65535))
        sources["sagemaker_port"] = setting.source

    management_token = _token("SERVING_MANAGEMENT_TOKEN", env["SERVING_MANAGEMENT_TOKEN"]) \
        if env.get("SERVING_MANAGEMENT_TOKEN") else None
    inference_token = _token("SERVING_INFERENCE_TOKEN", env["SERVING_INFERENCE_TOKEN"]) \
        if env.get("SERVING_INFERENCE_TOKEN") else None
    return ServerConfig(
        management_token=management_token,
        inference_token=inference_token,
        inference_address=values["inference_address"],
        management_address=values["management_address"],
        grpc_address=values["grpc_address"],
        metrics_address=values.get("metrics_address") or None,
        model_store=Path(values["model_store"]),
        load_models=values["load_models"],
        job_queue_size=values["job_queue_size"],
        max_request_size=values["max_request_size"],
        drain_timeout_s=values["drain_timeout"],
        sagemaker_port=sagemaker_port,
        log_format=values["log_format"],
        max_queue_time_s=values["max_queue_time"],
        ping_requires=values["ping_requires"],
        health_generate_timeout_s=values["health_generate_timeout"],
        health_generate_interval_s=values["health_generate_interval"],
        disable_token_authorization=values["disable_token_authorization"],
        inference_auth=values["inference_auth"],
        key_file=Path(values["key_file"]) if values.get("key_file") else None,
        model_cache_dir=Path(values["model_cache_dir"]) if values.get("model_cache_dir") else None,
        enable_model_api=values["enable_model_api"],
        management_allowed_hosts=values["management_allowed_hosts"],
        management_allowed_origins=values["management_allowed_origins"],
        **{key: values[key] for key in _CAP_KEYS},
        model_store_watch=values["model_store_watch"],
        model_store_watch_quiet_ms=values["model_store_watch_quiet_ms"],
        worker_fork_server=values["worker_fork_server"],
        worker_preload=values["worker_preload"],
        model_memory_budget=values["model_memory_budget"],
        model_load_wait_s=values["model_load_wait"],
        load_on_demand=values["load_on_demand"],
        sources=MappingProxyType(sources),
    )


_CAP_KEYS = ("max_stop_sequences", "max_stop_length", "max_stop_token_ids", "max_sequences_per_request",
             "max_models", "max_workers_per_model", "grpc_max_concurrent_rpcs", "grpc_max_stream_requests")
