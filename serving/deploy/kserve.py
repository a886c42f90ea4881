"""``serving k8s --kserve``: a KServe ``ServingRuntime`` for rollserve and an ``InferenceService`` that uses it.

The runtime is generic (the image, the listeners, the probes); the InferenceService carries the model: its
ConfigMap mounted as the model folder, the weights' claim as ``storageUri`` (KServe mounts a ``pvc://`` URI at
``/mnt/models``, where ``OPTION_MODEL_ID`` points), the pinned layout, the tokens and the resources.

Protocols: rollserve speaks KServe's Open Inference Protocol over gRPC (``inference.GRPCInferenceService``,
``serving.frontends.grpc.oip``) and REST (``/v2/models/...``, ``serving.frontends.http.oip_rest``), so the runtime
declares ``grpc-v2`` and ``v2``; the InferenceService uses ``grpc-v2`` and the gRPC port is KServe's one container
port (``h2c``); the HTTP APIs (OpenAI, LMI, TGI, OIP REST) answer on 8080 inside the pod. RawDeployment mode:
KServe makes a Deployment, Service and HPA, no Knative.
"""

from __future__ import annotations

from typing import Any

from serving.deploy.monitoring import metadata
from serving.deploy.pods import (
    MODEL_STORE,
    SECURITY,
    PodContext,
    model_env,
    probes,
    scrape_annotations,
    server_env,
    sizing_annotations,
    volume_mounts,
    volumes,
)

MODEL_FORMAT = "rollserve"
MODEL_FORMAT_VERSION = "1"
PROTOCOL_VERSIONS = ["grpc-v2", "v2"]  # the first: the InferenceService's (its port is gRPC's)
KSERVE_MOUNT = "/mnt/models"  # where KServe mounts the storageUri


def storage_uri(model_id: str | None) -> str | None:
    """The storageUri KServe's storage initializer fetches for a fetched ``option.model_id``: ``s3://`` as is, a
    hub id ``org/name[@revision]`` as ``hf://org/name[:revision]``; None for what it cannot fetch (``pypi:``)."""
    if not model_id or model_id.startswith("pypi:"):
        return None
    if model_id.startswith("s3://"):
        return model_id
    from serving.sources.hub import parse_hub_id

    parsed = parse_hub_id(model_id)
    if parsed is None:
        return None
    repo, revision = parsed
    return f"hf://{repo}" + (f":{revision}" if revision else "")
CONTAINER = "kserve-container"  # KServe merges the InferenceService's model into the runtime's container of this name


def serving_runtime(ctx: PodContext, namespace: str | None) -> dict[str, Any]:
    p = ctx.ports
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
            "metadata": metadata(f"{ctx.name}-runtime", namespace, "runtime", ctx.name),
            "spec": {"supportedModelFormats": [{"name": MODEL_FORMAT, "version": MODEL_FORMAT_VERSION,
                                                "autoSelect": True}],
                     "protocolVersions": PROTOCOL_VERSIONS,
                     "multiModel": False,
                     "annotations": scrape_annotations(ctx),
                     "containers": [{"name": CONTAINER, "image": ctx.image, "command": ["serving"],
                                     "args": ["--model-store", MODEL_STORE],
                                     "env": [e for e in server_env(ctx) if "valueFrom" not in e],
                                     "ports": [{"name": "h2c", "containerPort": p.grpc, "protocol": "TCP"}],
                                     **probes(ctx, p.http),
                                     "securityContext": SECURITY}]}}


def inference_service(ctx: PodContext, namespace: str | None, replicas: int, max_replicas: int) -> dict[str, Any]:
    meta = metadata(ctx.name, namespace, "server", ctx.name)
    meta["annotations"] = {"serving.kserve.io/deploymentMode": "RawDeployment"}
    model: dict[str, Any] = {"name": CONTAINER, "modelFormat": {"name": MODEL_FORMAT, "version": MODEL_FORMAT_VERSION},
                             "runtime": f"{ctx.name}-runtime", "protocolVersion": PROTOCOL_VERSIONS[0]}
    if ctx.storage_uri is not None:
        model["storageUri"] = ctx.storage_uri
    elif ctx.model.weights is not None:
        model["storageUri"] = f"pvc://{ctx.weights_claim}"
    model["env"] = model_env(ctx, KSERVE_MOUNT) + [e for e in server_env(ctx) if "valueFrom" in e]
    model["resources"] = ctx.sizing.leader.resources()
    model["volumeMounts"] = volume_mounts(ctx, weights=False)
    predictor = {"minReplicas": replicas, "maxReplicas": max_replicas,
                 "annotations": sizing_annotations(ctx), "labels": {"app.kubernetes.io/component": "server"},
                 "volumes": volumes(ctx, weights=False), "model": model}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
            "spec": {"predictor": predictor}}
