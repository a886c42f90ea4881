"""``serving k8s`` sizes a model fetched at start from its source, never downloading it: an S3 listing (moto's
server) or the hub's (the fake hub) and the headers read by range give the same memory plan as the same files on
disk; a wheel in pip's find-links folder gives its member's plan; a wheel on an index gives its size only; a source
out of reach gives the stated default, said in the notes and the annotation. Every figure is asserted exactly."""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import boto3
import pytest
from huggingface_hub import constants

from handlers.synthetic_model import build_model
from serving.deploy import source_size
from serving.deploy.k8s import Request
from serving.deploy.manifests import Manifests, build
from tests.sources_servers import _Quiet, _serving, commit_of, hub_server, moto_server
from tests.unit.k8s_schemas import validate
from tests.unit.k8s_sources import closed_port
from tests.unit.test_k8s_manifests import TP2_PLAN

MIB = 1 << 20
GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-Q4_K_M.gguf"
TP2_PROPERTIES = ("option.rolling_batch=auto\noption.tensor_parallel_degree=2\noption.max_rolling_batch_size=8\n"
                  "minWorkers=auto\nmaxWorkers=auto\n")
GGUF_PROPERTIES = "option.rolling_batch=auto\noption.max_rolling_batch_size=4\noption.max_model_len=512\n"
WHEEL_MEMBER = "demo_model/tiny-Q4_K_M.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of test_k8s_manifests.py (its tp2 figures worked out by hand there)."""
    return build_model(tmp_path_factory.mktemp("models") / "tiny", "llama", "tiny")


@pytest.fixture(scope="module")
def s3(tiny: Path) -> Iterator[str]:
    """moto's server: ``models/tiny/`` the tiny Llama's files, ``models/gguf/`` a GGUF file."""
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for path in sorted(tiny.iterdir()):
            client.put_object(Bucket="models", Key=f"tiny/{path.name}", Body=path.read_bytes())
        client.put_object(Bucket="models", Key=f"gguf/{GGUF.name}", Body=GGUF.read_bytes())
        yield url


@pytest.fixture(scope="module")
def hub(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("hub")
    shutil.copytree(tiny, root / "acme" / "tiny" / "main")
    with hub_server(root) as url:
        yield url


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A find-links folder holding demo-model 0.1, the GGUF file its member."""
    folder = tmp_path_factory.mktemp("wheels")
    with zipfile.ZipFile(folder / "demo_model-0.1-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as whl:
        whl.writestr("demo_model/__init__.py", "")
        whl.write(GGUF, WHEEL_MEMBER)
        whl.writestr("demo_model-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-model\nVersion: 0.1\n")
    return folder


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing of the machine running the tests: no hub token, no pip index, test credentials for S3."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path), "OPTION_TENSOR_PARALLEL_DEGREE": "1",
                        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def folder(parent: Path, model_id: str, properties: str) -> Path:
    d = parent / "model"
    d.mkdir()
    (d / "serving.properties").write_text(f"option.model_id={model_id}\n{properties}")
    return d


def generated(model_dir: Path) -> Manifests:
    m = build(Request(model_dir=model_dir))
    for doc in m.documents:
        validate(doc)
    return m


def resources(m: Manifests) -> dict[str, str]:
    (deployment,) = [d for d in m.documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == container["resources"]["requests"]
    return dict(container["resources"]["requests"])


def annotations(m: Manifests) -> dict[str, Any]:
    (deployment,) = [d for d in m.documents if d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["metadata"]["annotations"])


def test_an_s3_model_is_planned_from_its_listing_and_headers(s3: str, tiny: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-worked tp2 figures of test_k8s_manifests.py (1 worker of 2 ranks: 512 + 2 x 525.10 MiB)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    m = generated(folder(tmp_path, "s3://models/tiny", TP2_PROPERTIES))
    assert resources(m) == {"cpu": "4", "memory": "1563Mi"}
    notes = annotations(m)
    assert notes["rollserve/memory-source"] == "preflight"
    assert notes["rollserve/memory-plan"] == TP2_PLAN
    weights = (tiny / "model.safetensors").stat().st_size
    basis = f"S3 listing of s3://models/tiny: 1 weights files, {weights} bytes (config and headers read by range)"
    assert notes["rollserve/memory-basis"] == basis
    assert f"memory: the engine's memory plan from {basis}" in m.notes


def test_a_hub_model_is_planned_from_its_listing_and_headers(hub: str, tiny: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub)
    m = generated(folder(tmp_path, "acme/tiny", TP2_PROPERTIES))
    assert resources(m) == {"cpu": "4", "memory": "1563Mi"}
    notes = annotations(m)
    assert (notes["rollserve/memory-source"], notes["rollserve/memory-plan"]) == ("preflight", TP2_PLAN)
    weights = (tiny / "model.safetensors").stat().st_size
    assert notes["rollserve/memory-basis"] == (
        f"hub listing of acme/tiny (commit {commit_of('acme/tiny', 'main')[:12]}): 1 weights files, {weights} "
        "bytes (config and headers read by range)")


def local_gguf_figures(tmp_path: Path) -> tuple[dict[str, str], str]:
    """What the same GGUF file on disk is sized to (the preflight reading the whole file)."""
    m = generated(folder(tmp_path / "local", str(GGUF), GGUF_PROPERTIES))
    notes = annotations(m)
    assert notes["rollserve/memory-source"] == "preflight"
    return resources(m), notes["rollserve/memory-plan"]


def test_an_s3_gguf_file_is_planned_from_its_header_read_in_growing_ranges(s3: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "local").mkdir()
    expected = local_gguf_figures(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    monkeypatch.setattr(source_size, "HEADER_FIRST", 256)  # the header takes several reads
    m = generated(folder(tmp_path, f"s3://models/gguf/{GGUF.name}", GGUF_PROPERTIES))
    notes = annotations(m)
    assert (resources(m), notes["rollserve/memory-plan"]) == expected
    assert notes["rollserve/memory-basis"] == (f"S3 listing of s3://models/gguf/{GGUF.name}: 1 weights files, "
                                               f"{GGUF.stat().st_size} bytes (config and headers read by range)")


def test_a_find_links_wheel_is_planned_from_its_members_header(wheels: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "local").mkdir()
    expected = local_gguf_figures(tmp_path)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    m = generated(folder(tmp_path, f"pypi:demo-model==0.1/{WHEEL_MEMBER}", GGUF_PROPERTIES))
    notes = annotations(m)
    assert (resources(m), notes["rollserve/memory-plan"]) == expected
    assert notes["rollserve/memory-basis"] == (
        f"{WHEEL_MEMBER} of the wheel demo_model-0.1-py3-none-any.whl in pip's find-links folder: 1 weights files, "
        f"{GGUF.stat().st_size} bytes (config and headers read by range)")


@pytest.fixture
def index(wheels: Path) -> Iterator[str]:
    """A package index's JSON listing (PEP 691) of demo-model with the wheel's size, and of other-model without
    one (its size then comes from the file's Content-Length)."""
    wheel = next(wheels.glob("*.whl"))
    size = wheel.stat().st_size

    class Index(_Quiet):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            listings = {"/simple/demo-model/": [{"filename": wheel.name, "url": f"/files/{wheel.name}",
                                                 "size": size, "hashes": {}}],
                        "/simple/other-model/": [{"filename": "other_model-2.0-py3-none-any.whl",
                                                  "url": "/files/other.whl", "hashes": {}}]}
            if self.path not in listings or self.headers.get("Accept") != "application/vnd.pypi.simple.v1+json":
                self.send_error(404)
                return
            body = json.dumps({"meta": {"api-version": "1.1"}, "name": self.path.split("/")[2],
                               "files": listings[self.path]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/files/other.whl":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", "123456789")
            self.end_headers()

    handler: type[BaseHTTPRequestHandler] = Index
    with _serving(handler) as url:
        yield url


@pytest.mark.parametrize(("model_id", "wheel_bytes"), [
    (f"pypi:demo-model==0.1/{WHEEL_MEMBER}", None), ("pypi:other-model==2.0/other/weights.gguf", 123456789)])
def test_a_wheel_on_an_index_is_sized_by_its_listing(index: str, wheels: Path, tmp_path: Path, model_id: str,
                                                     wheel_bytes: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the size is known: 1 worker of 1 rank, 512 MiB for the pod's process + 512 MiB for the rank's + twice
    the wheel's bytes."""
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.setenv("PIP_INDEX_URL", f"{index}/simple")
    size = wheel_bytes or next(wheels.glob("*.whl")).stat().st_size
    m = generated(folder(tmp_path, model_id, GGUF_PROPERTIES))
    assert resources(m) == {"cpu": "4", "memory": f"{-(-(1024 * MIB + 2 * size) // MIB)}Mi"}
    notes = annotations(m)
    assert notes["rollserve/memory-source"] == "size" and "rollserve/memory-plan" not in notes
    requirement = model_id.removeprefix("pypi:").split("/")[0]
    name = "demo_model-0.1-py3-none-any.whl" if wheel_bytes is None else "other_model-2.0-py3-none-any.whl"
    basis = f"package index listing of {requirement}: wheel {name}, {size} bytes (sizes only)"
    assert notes["rollserve/memory-basis"] == basis
    assert (f"memory: from {basis}: 2 x a rank's share of the weights + overheads (no memory plan without the "
            "model's config): pass --memory to set it") in m.notes


def test_a_local_model_off_the_rolling_engine_is_sized_by_its_files(tiny: Path, tmp_path: Path) -> None:
    """No memory plan for the dynamic batcher: 512 + 512 + 2 x the checkpoint's bytes (one worker of 2 threads)."""
    m = generated(folder(tmp_path, str(tiny), "option.rolling_batch=disable\nminWorkers=1\nmaxWorkers=1\n"
                                              "option.num_threads=2\n"))
    weights = sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
    assert resources(m) == {"cpu": "2", "memory": f"{-(-(1024 * MIB + 2 * weights) // MIB)}Mi"}
    assert annotations(m)["rollserve/memory-basis"] == f"the weights' files: {weights} bytes"


def test_a_source_out_of_reach_gets_the_stated_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    m = generated(folder(tmp_path, "s3://models/tiny", "option.rolling_batch=auto\n"))
    assert resources(m) == {"cpu": "4", "memory": "5120Mi"}  # 512 + 512 + 4,096 MiB
    notes = annotations(m)
    assert notes["rollserve/memory-source"] == "fallback"
    assert notes["rollserve/memory-basis"].startswith(
        f"the size of option.model_id=s3://models/tiny cannot be known from here (s3://models/tiny: cannot reach "
        f"the S3 endpoint {endpoint}")
    (note,) = [n for n in m.notes if n.startswith("memory: ")]
    assert note == (f"memory: {notes['rollserve/memory-basis']}; 5120Mi assumed (the stated default of 4 GiB a rank "
                    "+ overheads): pass --memory to set it")
