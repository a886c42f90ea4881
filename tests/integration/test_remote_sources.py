"""``option.model_id=s3://...`` and a hub id ``org/name`` through the server: the model is fetched into the model
cache before its workers start and served; a missing bucket or repository, and a download cut short, fail that
model alone with the cause, leaving nothing in the cache; other models serve meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from serving.bench.launch import http_client
from tests.integration.harness import DEFAULT_MODEL, ServerProcess, greedy_references
from tests.sources_servers import hub_server, moto_server, s3_fault_proxy

PROMPT = "The quick brown fox"
MAX_NEW = 8
PROPERTIES = {"option.rolling_batch": "auto", "option.kv_cache_populate": "lazy"}
WEIGHT_FILES = [p for p in DEFAULT_MODEL.iterdir() if p.is_file() and p.name != "serving.properties"]


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server holding the default model's files under ``s3://models/tiny-llama/``."""
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for f in WEIGHT_FILES:
            client.put_object(Bucket="models", Key=f"tiny-llama/{f.name}", Body=f.read_bytes())
        yield url


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _no_files(parent: Path) -> Path:
    folder = parent / "no-files"
    folder.mkdir(exist_ok=True)
    return folder


def _answer(server: ServerProcess, model: str) -> list[int]:
    r = httpx.post(f"{server.url}/predictions/{model}", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def _states(server: ServerProcess) -> dict[str, str]:
    return http_client().get(f"{server.url}/ping", timeout=10).json()["models"]


def _wait_states(server: ServerProcess, want: dict[str, str]) -> None:
    """Until every model has the state wanted (the server reports it; loading models say LOADING)."""
    while _states(server) != want:
        assert server.proc.poll() is None, server.log()
        states = _states(server)
        assert not any(states.get(m) == "FAILED" and w != "FAILED" for m, w in want.items()), server.log()


def test_s3_and_hub_models_serve_and_a_missing_one_fails_alone(tmp_path: Path, s3: str) -> None:
    cache = tmp_path / "cache"
    hub_root = tmp_path / "hub"
    repo = hub_root / "acme" / "tiny" / "main"
    repo.mkdir(parents=True)
    for f in WEIGHT_FILES:
        (repo / f.name).write_bytes(f.read_bytes())
    with hub_server(hub_root) as hub:
        models = {"from-s3": {**PROPERTIES, "option.model_id": "s3://models/tiny-llama"},
                  "from-hub": {**PROPERTIES, "option.model_id": "acme/tiny"},
                  "no-bucket": {**PROPERTIES, "option.model_id": "s3://no-such-bucket/tiny-llama"},
                  "local": dict(PROPERTIES)}
        empty = _no_files(tmp_path)
        server = ServerProcess.start(tmp_path, models=models, wait_ready=False,
                                     env={**s3_env(s3), "HF_ENDPOINT": hub, "HF_HUB_OFFLINE": "0"},
                                     sources={"from-s3": empty, "from-hub": empty, "no-bucket": empty},
                                     config={"model_cache_dir": str(cache)})
        try:
            want = greedy_references([PROMPT], MAX_NEW, ignore_eos=True)[PROMPT]
            _wait_states(server, {"from-s3": "READY", "from-hub": "READY", "no-bucket": "FAILED", "local": "READY"})
            for model in ("from-s3", "from-hub", "local"):
                assert _answer(server, model) == want, model
            reason = str(server.describe("no-bucket"))
            assert "s3://no-such-bucket/tiny-llama" in reason, reason
            entries = sorted(p.name for p in cache.iterdir())
            assert [e[:3] for e in entries] == ["hub", "s3-"], entries  # the failed fetch left nothing
        finally:
            server.stop()


def test_a_download_cut_short_fails_the_model_and_leaves_the_cache_clean(tmp_path: Path, s3: str) -> None:
    cache = tmp_path / "cache"
    with s3_fault_proxy(s3, short={"models/tiny-llama/model.safetensors"}) as cut:
        server = ServerProcess.start(tmp_path, models={"cut": {**PROPERTIES, "option.model_id": "s3://models/tiny-llama"},
                                                       "local": dict(PROPERTIES)},
                                     wait_ready=False, env=s3_env(cut), sources={"cut": _no_files(tmp_path)},
                                     config={"model_cache_dir": str(cache)})
        try:
            _wait_states(server, {"cut": "FAILED", "local": "READY"})
            reason = str(server.describe("cut"))
            assert "model.safetensors" in reason and "truncated" in reason, reason
            assert not cache.exists() or list(cache.iterdir()) == []
            assert _answer(server, "local") == greedy_references([PROMPT], MAX_NEW, ignore_eos=True)[PROMPT]
        finally:
            server.stop()


def test_a_changed_s3_object_is_served_after_a_reload_and_only_it_is_fetched(tmp_path: Path, s3: str) -> None:
    from tests.integration.store_models import build_pair

    a, b = build_pair(tmp_path / "weights")
    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    for f in a.iterdir():
        if f.is_file():
            client.put_object(Bucket="models", Key=f"pair/{f.name}", Body=f.read_bytes())
    cache = tmp_path / "cache"
    server = ServerProcess.start(tmp_path, models={"pair": {**PROPERTIES, "option.model_id": "s3://models/pair"}},
                                 env=s3_env(s3), sources={"pair": _no_files(tmp_path)},
                                 config={"model_cache_dir": str(cache)})
    try:
        refs = [greedy_references([PROMPT], MAX_NEW, model_dir=d, ignore_eos=True)[PROMPT] for d in (a, b)]
        assert refs[0] != refs[1]
        assert _answer(server, "pair") == refs[0]
        client.put_object(Bucket="models", Key="pair/model.safetensors", Body=(b / "model.safetensors").read_bytes())
        r = httpx.put(f"{server.mgmt}/models/pair/reload", headers=server.mgmt_headers, timeout=300)
        assert r.status_code == 200, r.text
        assert _answer(server, "pair") == refs[1]
        entries = sorted(cache.glob("s3-*"), key=lambda e: (e / ".complete").stat().st_mtime_ns)
        assert len(entries) == 2, entries
        old, new = entries
        for f in new.iterdir():
            if f.is_file() and not f.name.startswith("."):
                same = f.stat().st_ino == (old / f.name).stat().st_ino
                assert same == (f.name != "model.safetensors"), f.name  # only the changed object downloaded
        assert "s3://models/pair: " in server.log() and " 1 changed (" in server.log()
    finally:
        server.stop()
