"""LoRA adapters registered over the API from S3 and the hub, through the server, on the real SmolLM2-135M-Instruct
with an adapter built by peft (``verbose``, also in the model folder): registered from ``s3://`` (moto's S3 server
behind a request-logging proxy) and from a hub id (the loopback hub), it answers exactly what the model folder's
copy answers (greedy); only its two files are fetched, and registering the unchanged source again fetches nothing
(the servers' request logs); a missing bucket, a prefix that is not an adapter and an unreachable hub are 400s
naming ``src`` and the cause without a server path, while the other adapters and the model serve on."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from tests.integration.harness import ServerProcess
from tests.lora_adapters import model_with_adapters
from tests.sources_servers import hub_server, moto_server, s3_fault_proxy

PROMPT = "Write a haiku about the sea."
MAX_NEW = 12
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


class Sources:
    """The S3 proxy's and the hub's URLs and request logs; ``stop_hub`` takes the hub down."""

    def __init__(self, s3: str, s3_seen: list[str], hub: str, hub_seen: list[str], stop_hub: Callable[[], None]):
        self.s3, self.s3_seen, self.hub, self.hub_seen, self.stop_hub = s3, s3_seen, hub, hub_seen, stop_hub

    def fetched(self) -> list[str]:
        """The adapter files downloaded since the logs were last cleared (listings are not downloads)."""
        s3 = [r.rsplit("/", 1)[1] for r in self.s3_seen if r.startswith("GET /loras/verbose/")]
        hub = [r.rsplit("/", 1)[1] for r in self.hub_seen if r.startswith("GET ") and "/resolve/" in r]
        return sorted(s3 + hub)

    def clear(self) -> None:
        self.s3_seen.clear()
        self.hub_seen.clear()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with_adapters(tmp_path_factory.mktemp("lora-src"))


@pytest.fixture(scope="module")
def sources(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sources]:
    """``s3://loras/verbose`` and the hub's ``acme/verbose-lora``: the model folder's ``verbose`` adapter as peft
    saved it (with its README); ``s3://loras/model``: the model's config, not an adapter."""
    adapter = folder / "adapters" / "verbose"
    hub_root = tmp_path_factory.mktemp("lora-hub")
    shutil.copytree(adapter, hub_root / "acme" / "verbose-lora" / "main")
    with ExitStack() as stack:
        moto = stack.enter_context(moto_server())
        client = boto3.client("s3", endpoint_url=moto, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="loras")
        for f in adapter.iterdir():
            client.put_object(Bucket="loras", Key=f"verbose/{f.name}", Body=f.read_bytes())
        client.put_object(Bucket="loras", Key="model/config.json", Body=(folder / "config.json").read_bytes())
        s3_seen: list[str] = []
        proxy = stack.enter_context(s3_fault_proxy(moto, seen=s3_seen))
        hub_seen: list[str] = []
        hub_stack = stack.enter_context(ExitStack())
        hub = hub_stack.enter_context(hub_server(hub_root, seen=hub_seen))
        yield Sources(proxy, s3_seen, hub, hub_seen, hub_stack.close)


@pytest.fixture(scope="module")
def server(folder: Path, sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("lora-src-server")
    srv = ServerProcess.start(workdir, models={"smollm2": {
        "option.rolling_batch": "auto", "option.max_model_len": "1024", "option.kv_cache_populate": "lazy",
        "option.enable_lora": "true", "option.max_loras": "2"}}, sources={"smollm2": folder},
        config={"enable_model_api": "true", "model_cache_dir": str(workdir / "cache")},
        env={"AWS_ENDPOINT_URL": sources.s3, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
             "AWS_DEFAULT_REGION": "us-east-1", "HF_ENDPOINT": sources.hub, "HF_HUB_OFFLINE": "0",
             "HF_HUB_CACHE": str(workdir / "no-user-hub-cache"), "HF_TOKEN": ""},
        timeout_s=600)
    try:
        yield srv
    finally:
        srv.stop()


def answer(server: ServerProcess, adapter: str | None) -> list[int]:
    r = httpx.post(f"{server.url}/predictions/smollm2", headers=server.inference_headers, timeout=300, json={
        "inputs": PROMPT, **({"adapters": adapter} if adapter else {}),
        "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "details": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def register(server: ServerProcess, name: str, src: str) -> httpx.Response:
    return httpx.post(f"{server.mgmt}/models/smollm2/adapters", params={"name": name, "src": src},
                      headers=server.mgmt_headers, timeout=300)


def listed(server: ServerProcess) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.mgmt}/models/smollm2/adapters", headers=server.mgmt_headers, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["adapters"])


def test_s3_and_hub_adapters_answer_as_the_local_folder_and_an_unchanged_source_fetches_nothing(
        server: ServerProcess, sources: Sources) -> None:
    local = answer(server, "verbose")  # the model folder's adapters/verbose
    assert local != answer(server, None)  # the adapter changes the answer: equal answers below mean something
    sources.clear()
    for name, src in (("from-s3", "s3://loras/verbose"), ("from-hub", "acme/verbose-lora")):
        r = register(server, name, src)
        assert r.status_code == 200, r.text
        assert answer(server, name) == local, name
    assert sources.fetched() == sorted(ADAPTER_FILES * 2)  # the README beside them stayed where it was

    sources.clear()
    # a new name for the S3 source, the same name again for the hub's
    for name, src in (("again-s3", "s3://loras/verbose"), ("from-hub", "acme/verbose-lora")):
        r = register(server, name, src)
        assert r.status_code == 200, r.text
    assert sources.fetched() == []
    assert any(r.startswith("GET /loras") for r in sources.s3_seen)  # it did look: one listing, ETags unchanged
    assert any(r.startswith("GET /api/models/acme/verbose-lora") for r in sources.hub_seen)  # the commit
    assert answer(server, "again-s3") == local and answer(server, "from-hub") == local
    assert [a["name"] for a in listed(server) if a["src"] == "api"] == ["again-s3", "from-hub", "from-s3"]


def test_bad_sources_are_400s_naming_src_and_the_rest_serves_on(server: ServerProcess, sources: Sources) -> None:
    before = listed(server)
    cache = str(server.workdir / "cache")
    sources.stop_hub()
    cases = {
        "s3://no-such-bucket/verbose": "the bucket 'no-such-bucket' does not exist",
        "s3://loras/model": "s3://loras/model is not a LoRA adapter: no adapter_config.json and no "
                            "adapter_model.safetensors",
        "acme/never-fetched": "(no folder 'acme/never-fetched' in the model store): cannot reach the hub",
        "no-such-thing": "is not a model folder in the model store; expected a folder inside the model store, an S3 "
                         "URI (s3://bucket/prefix) or a hub id (org/name[@revision])",
    }
    for src, cause in cases.items():
        r = register(server, "bad", src)
        assert r.status_code == 400, (src, r.text)
        message = r.json()["error"]
        assert f"adapter 'bad': src={src!r}" in message and cause in message, (src, message)
        assert cache not in r.text and str(server.workdir) not in r.text, r.text
    assert listed(server) == before

    # a source fetched before is served from the cache while the hub is down (as a model's source is)
    r = register(server, "from-hub-cached", "acme/verbose-lora")
    assert r.status_code == 200, r.text
    local = answer(server, "verbose")
    assert answer(server, "from-s3") == local and answer(server, "from-hub-cached") == local
    assert answer(server, None) != local
