"""LoRA adapters from S3 prefixes and hub ids (``serving.sources.resolve.resolve_adapter``,
``serving.sources.adapter_folder``, ``serving.models.adapter_source``), against moto's S3-protocol server and the
loopback hub: only the adapter's two files are fetched; an unchanged source is served from the cache after one
listing and fetches nothing (the servers' request logs say so); a changed one is fetched again; a source that is
not an adapter is refused from its listing, before any download; a folder that is not a readable adapter is
refused by name; the API's errors name the adapter and ``src`` and no server path."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from huggingface_hub import constants

from rollcore.errors import InvalidRequest
from serving.models.adapter_source import adapter_folder
from serving.sources.adapter_folder import check_folder
from serving.sources.resolve import resolve_adapter
from serving.sources.source_error import SourceError
from tests.sources_servers import commit_of, hub_server, moto_server, s3_fault_proxy

CONFIG = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}).encode()


def safetensors(values: int, fill: int = 1) -> bytes:
    """A safetensors file of one fp32 tensor of ``values`` elements (the format by hand: no torch here)."""
    header = json.dumps({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [1, values], "data_offsets": [0, 4 * values]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes([fill]) * (4 * values)


ADAPTER = {"adapter_config.json": CONFIG, "adapter_model.safetensors": safetensors(64)}
EXTRAS = {"README.md": b"# a fine-tune", "checkpoint-10/optimizer.pt": b"\x80pickle" * 100}
MODEL = {"config.json": b'{"model_type": "llama"}', "model.safetensors": safetensors(16)}


@pytest.fixture()
def s3() -> Iterator[tuple[str, list[str], object]]:
    """moto behind a proxy that logs requests: ``s3://loras/terse`` an adapter (with a README and a checkpoint
    folder beside it), ``s3://loras/model`` a model."""
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="loras")
        for rel, body in {**ADAPTER, **EXTRAS}.items():
            client.put_object(Bucket="loras", Key=f"terse/{rel}", Body=body)
        for rel, body in MODEL.items():
            client.put_object(Bucket="loras", Key=f"model/{rel}", Body=body)
        seen: list[str] = []
        with s3_fault_proxy(url, seen=seen) as proxy:
            yield proxy, seen, client


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str]]]:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    root = tmp_path / "hub"
    for folder, files in {"org/terse/main": {**ADAPTER, **EXTRAS, "config.json": b"{}"},
                          "org/terse/v2": {**ADAPTER, "adapter_model.safetensors": safetensors(64, fill=2)},
                          "org/model/main": MODEL}.items():
        for rel, body in files.items():
            (root / folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / folder / rel).write_bytes(body)
    seen: list[str] = []
    with hub_server(root, seen=seen) as url:
        yield url, seen


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def downloads(seen: list[str], prefix: str) -> list[str]:
    return sorted(r for r in seen if r.startswith(f"GET {prefix}"))


def test_an_s3_adapter_is_its_two_files_and_an_unchanged_prefix_fetches_nothing(
        s3: tuple[str, list[str], object], tmp_path: Path) -> None:
    url, seen, client = s3
    lines: list[str] = []
    first = resolve_adapter("s3://loras/terse", env=s3_env(url), root=tmp_path, progress=lines.append)
    assert files(first) == ADAPTER  # the README and the checkpoint folder were left where they are
    assert downloads(seen, "/loras/terse/") == ["GET /loras/terse/adapter_config.json",
                                                "GET /loras/terse/adapter_model.safetensors"]
    check_folder(first, "terse")
    seen.clear()
    again: list[str] = []
    assert resolve_adapter("s3://loras/terse", env=s3_env(url), root=tmp_path, progress=again.append) == first
    assert again == [f"s3://loras/terse: unchanged (its 2 objects' ETags): cached in {first}"]
    assert downloads(seen, "/loras/terse/") == []  # one listing, no object fetched

    client.put_object(Bucket="loras", Key="terse/README.md", Body=b"# edited")  # type: ignore[attr-defined]
    assert resolve_adapter("s3://loras/terse", env=s3_env(url), root=tmp_path, progress=[].append) == first
    new_weights = safetensors(64, fill=3)
    client.put_object(Bucket="loras", Key="terse/adapter_model.safetensors", Body=new_weights)  # type: ignore
    seen.clear()
    changed = resolve_adapter("s3://loras/terse", env=s3_env(url), root=tmp_path, progress=[].append)
    assert changed != first and files(changed) == {**ADAPTER, "adapter_model.safetensors": new_weights}
    assert downloads(seen, "/loras/terse/") == ["GET /loras/terse/adapter_model.safetensors"]


def test_a_hub_adapter_is_its_two_files_per_commit_and_a_known_commit_fetches_nothing(
        hub: tuple[str, list[str]], tmp_path: Path) -> None:
    url, seen = hub
    env = {"HF_ENDPOINT": url, "HF_HUB_CACHE": str(tmp_path / "no-user-cache")}
    main = resolve_adapter("org/terse", env=env, root=tmp_path / "cache", progress=[].append)
    assert files(main) == ADAPTER and main.name.endswith(commit_of("org/terse", "main")[:16])
    v2 = resolve_adapter("org/terse@v2", env=env, root=tmp_path / "cache", progress=[].append)
    assert v2 != main and files(v2)["adapter_model.safetensors"] == safetensors(64, fill=2)
    seen.clear()
    lines: list[str] = []
    assert resolve_adapter("org/terse", env=env, root=tmp_path / "cache", progress=lines.append) == main
    assert lines == [f"org/terse: commit {commit_of('org/terse', 'main')[:12]}: cached in {main}"]
    assert [r for r in seen if "/resolve/" in r] == []  # the listing only


def test_a_source_that_is_not_an_adapter_is_refused_before_any_download(
        s3: tuple[str, list[str], object], hub: tuple[str, list[str]], tmp_path: Path) -> None:
    s3_url, s3_seen, _ = s3
    with pytest.raises(SourceError, match=r"^s3://loras/model is not a LoRA adapter: no adapter_config.json and no "
                                          r"adapter_model.safetensors \(PEFT's save_pretrained writes .*\); it "
                                          r"holds: config.json, model.safetensors$"):
        resolve_adapter("s3://loras/model", env=s3_env(s3_url), root=tmp_path / "cache", progress=[].append)
    assert downloads(s3_seen, "/loras/model/") == []
    hub_url, hub_seen = hub
    with pytest.raises(SourceError, match=r"^hub repository org/model is not a LoRA adapter: no adapter_config.json"):
        resolve_adapter("org/model", env={"HF_ENDPOINT": hub_url}, root=tmp_path / "cache", progress=[].append)
    assert [r for r in hub_seen if "/resolve/" in r] == []
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []  # no entry, no leftover


@pytest.mark.parametrize(("files_", "error"), [
    ({}, r"^x is not a LoRA adapter: no adapter_config.json"),
    ({"adapter_config.json": b"{"}, r"^x: adapter_config.json is not JSON"),
    ({"adapter_config.json": b'{"peft_type": "PROMPT_TUNING"}'},
     r"^x: adapter_config.json has peft_type 'PROMPT_TUNING': only LORA adapters are served$"),
    ({"adapter_config.json": CONFIG, "adapter_model.bin": b"pickle"},
     r"^x is not a LoRA adapter: no adapter_model.safetensors \(adapter_model.bin is pickle, not served\)"),
    ({"adapter_config.json": CONFIG, "adapter_model.safetensors": b"not a safetensors file"},
     r"^x: adapter_model.safetensors is not a safetensors file \(22 bytes, no readable header\)$"),
    ({"adapter_config.json": CONFIG, "adapter_model.safetensors": safetensors(64)[:-10]},
     r"^x: adapter_model.safetensors is truncated: its tensors need \d+ bytes, the file has \d+$"),
])
def test_a_folder_that_is_not_a_readable_adapter_is_refused_by_name(tmp_path: Path, files_: dict[str, bytes],
                                                                    error: str) -> None:
    for name, body in files_.items():
        (tmp_path / name).write_bytes(body)
    with pytest.raises(SourceError, match=error):
        check_folder(tmp_path, "x")


def locate(src: str, store: Path, cache: Path, env: dict[str, str]) -> Path:
    def in_store(url: str) -> Path:  # the registry's rule, reduced: a folder directly in the store
        if url.startswith("/") or not (store / url).is_dir():
            raise InvalidRequest(f"url {url!r} is not a model folder in the model store")
        return store / url

    return asyncio.run(adapter_folder("loud", src, in_store=in_store, env=env, cache_root=cache, store=store,
                                      model="m"))


def test_the_api_resolver_answers_4xx_naming_src_and_the_cause_without_server_paths(
        s3: tuple[str, list[str], object], tmp_path: Path) -> None:
    url, _, _ = s3
    store, cache = tmp_path / "store", tmp_path / "cache"
    (store / "uploads" / "loud").mkdir(parents=True)
    for name, body in ADAPTER.items():
        (store / "uploads" / "loud" / name).write_bytes(body)
    assert locate("uploads/loud", store, cache, {}) == store / "uploads" / "loud"
    assert files(locate("s3://loras/terse", store, cache, s3_env(url))) == ADAPTER
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = {
        "s3://no-such-bucket/x": (s3_env(url), "the bucket 'no-such-bucket' does not exist"),
        "s3://loras/model": (s3_env(url), "s3://loras/model is not a LoRA adapter: no adapter_config.json"),
        "s3://loras/elsewhere": (s3_env(closed), "cannot reach the S3 endpoint"),
        "uploads/typo": ({"HF_ENDPOINT": closed}, "(no folder 'uploads/typo' in the model store): cannot reach the "
                                                  "hub"),
        "/etc/passwd": ({}, "is not a model folder in the model store; expected a folder inside the model store, "
                            "an S3 URI (s3://bucket/prefix) or a hub id (org/name[@revision])"),
        "uploads": ({}, "src='uploads' is not a LoRA adapter: no adapter_config.json"),
    }
    for src, (env, cause) in cases.items():
        with pytest.raises(InvalidRequest) as raised:
            locate(src, store, cache, env)
        assert raised.value.message.startswith(f"adapter 'loud': src={src!r}"), raised.value.message
        assert cause in raised.value.message, raised.value.message
        assert str(tmp_path) not in raised.value.message
