"""How the Kubernetes manifests' tests validate each document: standard kinds with kubernetes-validate (strict),
KServe's through the kserve SDK's models, LeaderWorkerSet and ServiceMonitor against schemas written from their
published CRDs (only the fields ``serving k8s`` emits, nothing else allowed)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

K8S_VERSION = "1.32.0"


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = _strict({"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP,
                     "annotations": _STRING_MAP}, ("name",))
_TEMPLATE = _strict({"metadata": _strict({"labels": _STRING_MAP, "annotations": _STRING_MAP}),
                     "spec": {"type": "object"}}, ("spec",))  # the pod spec: validated as a PodTemplate
LWS_SCHEMA = _strict({
    "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"}, "kind": {"const": "LeaderWorkerSet"},
    "metadata": _METADATA,
    "spec": _strict({
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "leaderWorkerTemplate": _strict({
            "size": {"type": "integer", "minimum": 1},
            "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
            "leaderTemplate": _TEMPLATE, "workerTemplate": _TEMPLATE}, ("workerTemplate",))},
        ("leaderWorkerTemplate",))}, ("apiVersion", "kind", "metadata", "spec"))
_DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICE_MONITOR_SCHEMA = _strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
    "metadata": _METADATA,
    "spec": _strict({
        "selector": _strict({"matchLabels": _STRING_MAP}),
        "endpoints": {"type": "array", "minItems": 1, "items": _strict({
            "port": {"type": "string"}, "path": {"type": "string"},
            "interval": {"type": "string", "pattern": _DURATION},
            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]}})}},
        ("endpoints", "selector"))}, ("apiVersion", "kind", "metadata", "spec"))


def _sdk() -> tuple[Any, Any, Any]:
    """kserve's and kubernetes' generated model classes, loaded without their packages' ``__init__`` (kserve's
    imports its model server, whose dependencies .ci/run leaves out; setup.cfg says why)."""
    for name in ("kubernetes", "kserve"):
        if name not in sys.modules:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.submodule_search_locations is None:
                pytest.fail(f"{name} is not installed (.ci/run installs it with --no-deps)")
            package = types.ModuleType(name)
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules[name] = package
    import kserve.api_client
    import kserve.models
    import kubernetes.client.models

    return kserve.models, kubernetes.client.models, kserve.api_client.ApiClient()


def strict_load(data: Any, type_name: str) -> Any:
    """``data`` as the SDK's ``type_name``; a field the model does not define fails."""
    kserve_models, k8s_models, _ = _sdk()
    if match := re.fullmatch(r"[Ll]ist\[(.+)\]", type_name):
        assert isinstance(data, list), (type_name, data)
        return [strict_load(item, match.group(1)) for item in data]
    if match := re.fullmatch(r"[Dd]ict[(\[]str, (.+)[)\]]", type_name):
        assert isinstance(data, dict), (type_name, data)
        return {key: strict_load(value, match.group(1)) for key, value in data.items()}
    primitives = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": (str, int, dict, list)}
    if type_name in primitives:
        assert isinstance(data, primitives[type_name]), (type_name, data)
        return data
    cls = getattr(kserve_models, type_name, None) or getattr(k8s_models, type_name)
    assert isinstance(data, dict), (type_name, data)
    fields = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{type_name} has no field {unknown}"
    return cls(**{fields[key]: strict_load(value, cls.openapi_types[fields[key]]) for key, value in data.items()})


SDK_TYPES = {"InferenceService": "V1beta1InferenceService", "ServingRuntime": "V1alpha1ServingRuntime"}
STANDARD_KINDS = {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}


def validate(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind in STANDARD_KINDS:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    elif kind in SDK_TYPES:
        obj = strict_load(doc, SDK_TYPES[kind])
        assert _sdk()[2].sanitize_for_serialization(obj) == doc
    elif kind == "LeaderWorkerSet":
        jsonschema.validate(doc, LWS_SCHEMA)
        for role in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": doc["spec"]["leaderWorkerTemplate"][role]},
                                         K8S_VERSION, strict=True)
    elif kind == "ServiceMonitor":
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
    else:
        raise AssertionError(f"no check for kind {kind}")
