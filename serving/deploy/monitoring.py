"""The Service in front of the frontend pods, and scaling and scraping: a HorizontalPodAutoscaler on the queue
depth the server exports (``rollserve_num_requests_waiting``, ``serving.telemetry.metrics``: requests waiting in the
frontend's queue and the engines' waiting queues), the prometheus-adapter rule that makes it a custom Pods metric,
and a ServiceMonitor for the Prometheus operator.

The HPA's target: an average of a quarter of a pod's batch capacity waiting (maxWorkers x
``max_rolling_batch_size``, or ``batch_size`` with dynamic batching), at least 1 -- a pod whose batch is full and
whose queue keeps growing gets company; one whose queue drains stays alone.
"""

from __future__ import annotations

from typing import Any

import yaml

from serving.deploy.pods import METRICS_PATH, PodContext, labels

QUEUE_METRIC = "rollserve_num_requests_waiting"


def metadata(name: str, namespace: str | None, component: str, instance: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = labels(instance, component)
    return meta


def service(ctx: PodContext, namespace: str | None, component: str) -> dict[str, Any]:
    """HTTP, gRPC and metrics of the pods of ``component`` (``server``, or a LeaderWorkerSet's ``leader``); the
    management API stays off it (``kubectl port-forward`` reaches it)."""
    p = ctx.ports
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(ctx.name, namespace, component, ctx.name),
            "spec": {"type": "ClusterIP", "selector": labels(ctx.name, component),
                     "ports": [{"name": "http", "port": p.http, "targetPort": "http", "protocol": "TCP"},
                               {"name": "grpc", "port": p.grpc, "targetPort": "grpc", "protocol": "TCP",
                                "appProtocol": "kubernetes.io/h2c"},
                               {"name": "metrics", "port": p.metrics, "targetPort": "metrics", "protocol": "TCP"}]}}


def queue_target(ctx: PodContext) -> int:
    b = ctx.model.config.batching
    capacity = ctx.sizing.max_workers * (b.max_rolling_batch_size if b.rolling else b.batch_size)
    return max(1, capacity // 4)


def autoscaler(ctx: PodContext, namespace: str | None, target: dict[str, str], replicas: int,
               max_replicas: int) -> dict[str, Any]:
    """autoscaling/v2 on the queue depth per pod (``target``: the scaled object's apiVersion, kind, name)."""
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(ctx.name, namespace, "autoscaling", ctx.name),
            "spec": {"scaleTargetRef": target, "minReplicas": replicas, "maxReplicas": max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": QUEUE_METRIC},
                         "target": {"type": "AverageValue", "averageValue": str(queue_target(ctx))}}}]}}


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter's rule serving ``QUEUE_METRIC`` per pod from the scraped series (Prometheus adds the
    ``namespace`` and ``pod`` labels of the target)."""
    return {"rules": [{
        "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{QUEUE_METRIC}$", "as": QUEUE_METRIC},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }]}


def adapter_config_map(ctx: PodContext, namespace: str | None) -> dict[str, Any]:
    """The rule as prometheus-adapter's configuration file (``config.yaml``), to merge into the adapter's own
    (its Helm chart's ``rules.custom``) -- the adapter reads one file, so this ConfigMap is not it."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(f"{ctx.name}-prometheus-adapter", namespace, "autoscaling", ctx.name),
            "data": {"config.yaml": yaml.safe_dump(adapter_rules(), sort_keys=False)}}


def service_monitor(ctx: PodContext, namespace: str | None, component: str) -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": metadata(ctx.name, namespace, "monitoring", ctx.name),
            "spec": {"selector": {"matchLabels": labels(ctx.name, component)},
                     "endpoints": [{"port": "metrics", "path": METRICS_PATH, "interval": "15s",
                                    "scheme": "http"}]}}
