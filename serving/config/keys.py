"""The non-option keys: ``serving.properties``'s model keys and ``config.properties``'s server keys, each with
its parser, default and meaning (the ``option.*`` keys are ``rollcore.options``). ``serving.config.model_config`` and
``serving.config.server_config`` read them; ``serving.config.reference`` renders them into docs/reference.md."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from rollcore.values import (
    Parser,
    boolean,
    choice,
    devices,
    grpc_address,
    http_address,
    integer,
    load_models,
    names,
    number,
    text,
)
from serving.config.memory_budget import memory_budget


@dataclass(frozen=True, slots=True)
class KeySpec:
    key: str
    parser: Parser
    default: str | None  # as text; None: absent unless set
    meaning: str


def _table(*specs: KeySpec) -> Mapping[str, KeySpec]:
    return MappingProxyType({s.key: s for s in specs})


def management_address(value: str) -> str:
    return "" if value.lower() == "off" else http_address(value)


def _optional_http(value: str) -> str:
    return http_address(value) if value else ""


_ACCEPTED = "accepted for DJL compatibility and kept with the model's properties; rollserve does not act on it"

MODEL_KEYS = _table(
    KeySpec("engine", choice(("Python", "MPI")), "Python", "DJL's engine name; rollserve's workers run either way"),
    KeySpec("batch_size", integer(1), "1", "dynamic batching: requests gathered into one batch"),
    KeySpec("max_batch_delay", integer(0), "100", "dynamic batching: milliseconds a batch waits for batch-mates"),
    KeySpec("job_queue_size", integer(1), "1000", "requests that may wait for a worker; full: 503 with Retry-After"),
    KeySpec("max_queue_time", number(0, exclusive=True), "60", "seconds a request may wait in the queue"),
    KeySpec("minWorkers", integer(0, auto=True), "1",
            "worker processes kept running; auto: from the cores of the server's CPU affinity mask and the "
            "checkpoint's size (a worker per core under 30M parameters, else one worker with every core as threads; "
            "one core: one worker); `serving config` shows the choice"),
    KeySpec("maxWorkers", integer(1, auto=True), "1",
            "worker processes the model may grow to while requests queue; auto: as minWorkers"),
    KeySpec("max_idle_time", integer(0), "60", "seconds an added worker may idle before it is retired"),
    KeySpec("load_on_devices", devices, "*", "GPUs the model's workers may use: * or visible indices, ;-separated"),
    KeySpec("required_memory_mb", integer(0), None, _ACCEPTED),
    KeySpec("reserved_memory_mb", integer(0), None, _ACCEPTED),
    KeySpec("log_request_metric", boolean, None, _ACCEPTED),
    KeySpec("retry_threshold", integer(0), None, _ACCEPTED),
    KeySpec("gpu.minWorkers", integer(0), None, _ACCEPTED),
    KeySpec("gpu.maxWorkers", integer(0), None, _ACCEPTED),
    KeySpec("cpu.minWorkers", integer(0), None, _ACCEPTED),
    KeySpec("cpu.maxWorkers", integer(0), None, _ACCEPTED),
    KeySpec("load_on_demand", boolean, None,
            "true: register the model at start and load it on its first request (requests wait up to "
            "model_load_wait); under model_memory_budget such models are unloaded, least recently used first, when "
            "another needs the room (docs/model-store.md); unset: the server's load_on_demand"),
    KeySpec("pin", boolean, None, "true: never unload the model to make room under model_memory_budget"),
    KeySpec("idle_ttl", number(0, exclusive=True), None,
            "seconds without a request after which the model is unloaded (it loads again on its next request); "
            "unset: it stays loaded until the budget needs its room"),
    KeySpec("version", integer(1), None,
            "the model's version (a positive integer; unset: 1); in a versioned folder (NAME/2/) the sub-folder's "
            "name is the version and this key is not read (docs/model-store.md)"),
)

# ``NAME/model.properties`` in the model store: what applies to every version of a model (docs/model-store.md).
STORE_KEYS = _table(
    KeySpec("default_version", integer(1), None,
            "the version that serves requests naming the model without a version (unset: the highest READY one)"),
)

SERVER_KEYS = _table(
    KeySpec("inference_address", http_address, "http://127.0.0.1:8080", "the inference API's listener"),
    KeySpec("management_address", management_address, "http://127.0.0.1:8081",
            "the management API's listener; off: no management API over HTTP or gRPC"),
    KeySpec("grpc_address", grpc_address, "127.0.0.1:8001", "the gRPC listener (OIP v2, rollserve.v1); off: none"),
    KeySpec("metrics_address", _optional_http, None, "a listener of its own for /metrics, without a token "
                                                     "(default: the management listener serves it)"),
    KeySpec("model_store", text, "model_store", "the folder of model folders"),
    KeySpec("load_models", load_models, "ALL", "the models loaded at start: ALL or NAME=PATH, ...-separated"),
    KeySpec("job_queue_size", integer(1), "1000", "the default of the model key"),
    KeySpec("max_request_size", integer(1), str(64 * 1024 * 1024), "bytes of a request body; over: 413"),
    KeySpec("drain_timeout", number(0), "30", "seconds in-flight requests may finish at shutdown"),
    KeySpec("log_format", choice(("text", "json")), "text", "log lines as text or one JSON object each"),
    KeySpec("max_queue_time", number(0, exclusive=True), "60", "the default of the model key"),
    KeySpec("ping_requires", choice(("all", "any", "none")), "all",
            "readiness: every load_models model ready, any, or none (liveness only)"),
    KeySpec("health_generate_timeout", number(0, exclusive=True), "10",
            "seconds GET /health/generate waits for each worker's probe token; none in time: 503 naming it"),
    KeySpec("health_generate_interval", number(0), "5",
            "seconds GET /health/generate answers from its last result before it probes the workers again"),
    KeySpec("disable_token_authorization", boolean, "false", "no tokens on any API (loopback-only setups)"),
    KeySpec("inference_auth", choice(("auto", "true", "false")), "auto",
            "the inference API needs its token: auto = when its address is not loopback"),
    KeySpec("key_file", text, None, "where the tokens are read from (if present) and written (default "
                                    "key_file.json in the working directory)"),
    KeySpec("model_cache_dir", text, None, "where remote and GGUF models are cached as local folders (default "
                                           "~/.cache/rollserve/models)"),
    KeySpec("enable_model_api", boolean, "false", "false: registering, scaling and unregistering over the API are "
                                                  "refused with 403"),
    KeySpec("management_allowed_hosts", names, "",
            "host names accepted in the management API's Host header besides IP literals and localhost"),
    KeySpec("management_allowed_origins", names, "",
            "browser origins the management API accepts (any other Origin: 403)"),
    KeySpec("max_stop_sequences", integer(0, 1024), "16", "stop sequences one request may give"),
    KeySpec("max_stop_length", integer(1, 65536), "256", "characters of one stop sequence"),
    KeySpec("max_stop_token_ids", integer(0, 4096), "64", "stop token ids one request may give"),
    KeySpec("max_sequences_per_request", integer(1, 4096), "64", "n x prompts (x best_of) of one request"),
    KeySpec("max_models", integer(1), "32", "models registered at once"),
    KeySpec("max_workers_per_model", integer(1, 1024), "16", "workers one model may ask for"),
    KeySpec("grpc_max_concurrent_rpcs", integer(1), "1000", "gRPC calls served at once; more: RESOURCE_EXHAUSTED"),
    KeySpec("grpc_max_stream_requests", integer(1), "64", "requests one gRPC stream may carry at once"),
    KeySpec("model_memory_budget", memory_budget, "80%",
            "the memory the models' workers may hold together: a size (6GiB, 512MiB, 2G, bytes) or a share of "
            "MemAvailable at start (80%); models loaded on demand are unloaded to stay under it (docs/model-store.md)"),
    KeySpec("model_load_wait", number(0), "60",
            "seconds a request waits for its model to load on demand; a load expected to take longer: 503 with "
            "Retry-After"),
    KeySpec("load_on_demand", boolean, "false", "the default of the model key"),
    KeySpec("model_store_watch", boolean, "false",
            "watch the model store: a new complete folder loads, a removed one drains and unloads, a changed one "
            "reloads without downtime (with or without enable_model_api; docs/model-store.md)"),
    KeySpec("model_store_watch_quiet_ms", integer(50, 600000), "1000",
            "milliseconds a watched folder must stay unchanged before it is loaded or reloaded (a copy in progress "
            "keeps changing it)"),
    KeySpec("worker_fork_server", boolean, "true",
            "start workers that need torch by forking a process that imported torch and transformers once "
            "(seconds sooner per worker, restart and scale-up); false: each worker is a fresh interpreter"),
    KeySpec("worker_preload", names, "",
            "more modules the fork server imports before it forks workers (a custom handler's heavy imports), "
            "comma-separated; a module that starts threads at import turns the fork server off (logged)"),
)
