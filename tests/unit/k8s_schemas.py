"""How the Kubernetes manifests' tests validate each document: standard kinds with kubernetes-validate (strict),
KServe's through the kserve SDK's models, LeaderWorkerSet and ServiceMonitor against their projects' published CRDs
(tests/data/crds, copied unchanged), with every field the CRD does not define refused."""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

K8S_VERSION = "1.32.0"


CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"  # copied unchanged; README.md there names the source
CRD_FILES = {"LeaderWorkerSet": "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
             "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml"}


def _closed(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused: the API server would prune them (the field would be
    lost without a word), which for these tests is an error. Objects the CRD keeps open stay open."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@functools.cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    """The published CRD's openAPIV3Schema for ``api_version`` (a served version of the CRD's group), closed."""
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader",
                                                                                             yaml.SafeLoader))
    spec = crd["spec"]
    assert spec["names"]["kind"] == kind
    served = {f"{spec['group']}/{v['name']}": v for v in spec["versions"] if v["served"]}
    assert api_version in served, f"{kind} {api_version} is not served by the CRD (it serves {sorted(served)})"
    schema = copy.deepcopy(served[api_version]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server, not the CRD
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    return _closed(schema)


def validate_custom(doc: dict[str, Any]) -> None:
    """``doc`` against its kind's published CRD (JSON Schema only: the CRD's CEL rules are not run here)."""
    jsonschema.validate(doc, crd_schema(doc["kind"], doc["apiVersion"]))


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
STANDARD_KINDS = {"ConfigMap", "Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler"}


def validate(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind in STANDARD_KINDS:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    elif kind in SDK_TYPES:
        obj = strict_load(doc, SDK_TYPES[kind])
        assert _sdk()[2].sanitize_for_serialization(obj) == doc
    elif kind == "LeaderWorkerSet":
        validate_custom(doc)
        for role in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": doc["spec"]["leaderWorkerTemplate"][role]},
                                         K8S_VERSION, strict=True)
    elif kind == "ServiceMonitor":
        validate_custom(doc)
    else:
        raise AssertionError(f"no check for kind {kind}")
