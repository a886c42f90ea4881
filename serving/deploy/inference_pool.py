"""``serving k8s --inference-pool``: the Gateway API Inference Extension's ``InferencePool`` over the server pods.

Design note: the object is the extension's v1 CRD (``inference.networking.k8s.io/v1``, kind ``InferencePool``;
kubernetes-sigs/gateway-api-inference-extension, config/crd): ``selector.matchLabels`` picks the pods the Service
fronts (the Deployment's, or a LeaderWorkerSet's leaders), ``targetPorts`` is the inference API's port (OpenAI's
routes, which the protocol requires), ``endpointPickerRef`` the endpoint picker's Service (``NAME-epp``, the
extension's ext-proc port 9002), which the user deploys (the extension's ``inferencepool`` chart does); the picker
scrapes the pods' ``/metrics`` (the vLLM names, ``serving.telemetry.metrics_gateway``) on the metrics port, which the
note names. KServe's objects bring their own pods and routing, so ``--kserve`` does not take it.
"""

from __future__ import annotations

from typing import Any

from serving.deploy.monitoring import metadata
from serving.deploy.pods import PodContext, labels

API_VERSION = "inference.networking.k8s.io/v1"
KIND = "InferencePool"
EPP_PORT = 9002  # the endpoint picker's ext-proc (gRPC) port in the extension's deployments


def epp_service(ctx: PodContext) -> str:
    return f"{ctx.name}-epp"


def inference_pool(ctx: PodContext, namespace: str | None, component: str) -> dict[str, Any]:
    """The pool of ``component``'s pods (``server``, or ``leader`` with --nodes)."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": metadata(ctx.name, namespace, "inference-pool", ctx.name),
            "spec": {"selector": {"matchLabels": labels(ctx.name, component)},
                     "targetPorts": [{"number": ctx.ports.http}],
                     "appProtocol": "http",
                     "endpointPickerRef": {"kind": "Service", "name": epp_service(ctx),
                                           "port": {"number": EPP_PORT}, "failureMode": "FailClose"}}}


def note(ctx: PodContext) -> str:
    """What the user deploys beside the pool."""
    return (f"the InferencePool {ctx.name} needs its endpoint picker as the Service {epp_service(ctx)} (port "
            f"{EPP_PORT}; the gateway-api-inference-extension's inferencepool chart), scraping the pods' metrics on "
            f"port {ctx.ports.metrics} (--model-server-metrics-port={ctx.ports.metrics})")
