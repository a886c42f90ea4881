"""``serving k8s --inference-pool``: the InferencePool validates against the Gateway API Inference Extension's
published CRD (tests/data/gateway_api_inference_extension: v1.6.0's, copied unchanged), and selects the pods the
Service fronts on the inference port."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from rollcore.errors import ConfigError
from serving.deploy.k8s import Request
from serving.deploy.manifests import build
from tests.integration.harness import DEFAULT_MODEL
from tests.unit.k8s_sources import sources_out_of_reach

CRD = Path(__file__).resolve().parents[1] / "data" / "gateway_api_inference_extension" / \
    "inference.networking.k8s.io_inferencepools.yaml"


@pytest.fixture(autouse=True)
def no_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sources_out_of_reach(monkeypatch, tmp_path)


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text(encoding="utf-8"))


def closed(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused: the API server would prune them (silently lose
    them), which for this test is an error."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def validate_against_crd(doc: dict[str, Any]) -> None:
    definition = crd()
    spec = definition["spec"]
    served = [v for v in spec["versions"] if v["served"]]
    version = next(v for v in served if f"{spec['group']}/{v['name']}" == doc["apiVersion"])
    assert doc["kind"] == spec["names"]["kind"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server, not the CRD
    jsonschema.validate(doc, closed(schema))
    # the CRD's CEL rules (x-kubernetes-validations), which JSON Schema cannot run
    ref = doc["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref  # "port is required when kind is 'Service'"
    numbers = [p["number"] for p in doc["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))  # "port number must be unique"


@pytest.mark.parametrize("options", [{}, {"namespace": "llm", "replicas": 2}])
def test_the_pool_is_the_published_crds_and_selects_the_served_pods(options: dict[str, Any]) -> None:
    m = build(Request(model_dir=DEFAULT_MODEL, inference_pool=True, **options))
    pools = [d for d in m.documents if d["kind"] == "InferencePool"]
    assert len(pools) == 1
    pool = pools[0]
    validate_against_crd(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    service = next(d for d in m.documents if d["kind"] == "Service")
    deployment = next(d for d in m.documents if d["kind"] == "Deployment")
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    http = next(p for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    assert pool["metadata"].get("namespace") == options.get("namespace")
    assert any(f"{pool['metadata']['name']}-epp" in n for n in m.notes)


def test_the_crd_refuses_what_it_should() -> None:
    """The validation is live: a pool without targetPorts, or with a field the CRD lacks, fails."""
    pool = next(d for d in build(Request(model_dir=DEFAULT_MODEL, inference_pool=True)).documents
                if d["kind"] == "InferencePool")
    for broken in ({**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "targetPorts"}},
                   {**pool, "spec": {**pool["spec"], "targetPortNumber": 8080}},
                   {**pool, "apiVersion": "inference.networking.x-k8s.io/v1alpha2"}):
        with pytest.raises((jsonschema.ValidationError, StopIteration)):
            validate_against_crd(broken)


def test_kserve_takes_no_pool_and_the_command_prints_it() -> None:
    with pytest.raises(ConfigError, match="--kserve with --inference-pool"):
        build(Request(model_dir=DEFAULT_MODEL, kserve=True, inference_pool=True))
    proc = subprocess.run([sys.executable, "-m", "serving", "k8s", str(DEFAULT_MODEL), "--inference-pool"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert docs[-1]["kind"] == "InferencePool"
    validate_against_crd(docs[-1])
