"""The S3 cache keyed by what the bytes are (``serving.sources.resolve``, ``serving.sources.s3``), against moto's
S3-protocol server: an unchanged prefix is served from the cache after one listing; a changed object makes a new
entry in which only that object was downloaded (the others are the previous entry's files, linked: the same
inode); an unreachable endpoint serves the cached copy with a warning, and fails without one."""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from serving.sources.resolve import resolve
from serving.sources.source_error import SourceUnreachable
from tests.sources_servers import moto_server

MODEL = {"config.json": b'{"model_type": "llama"}', "model.safetensors": random.Random(3).randbytes(200_000),
         "tokenizer.json": b'{"version": "1.0"}'}
URI = "s3://models/tiny"


@pytest.fixture()
def s3() -> Iterator[tuple[str, object]]:
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for rel, body in MODEL.items():
            client.put_object(Bucket="models", Key=f"tiny/{rel}", Body=body)
        yield url, client


def env_for(endpoint: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def fetch(root: Path, env: dict[str, str], lines: list[str]) -> Path:
    return resolve(root, URI, gguf_file=None, allow_unsafe=False, env=env, root=root / "cache",
                   progress=lines.append)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_an_unchanged_prefix_is_served_from_the_cache_after_one_listing(s3: tuple[str, object],
                                                                         tmp_path: Path) -> None:
    url, _ = s3
    first_lines: list[str] = []
    first = fetch(tmp_path, env_for(url), first_lines)
    assert files(first) == MODEL
    again: list[str] = []
    assert fetch(tmp_path, env_for(url), again) == first
    assert again == [f"{URI}: unchanged (its 3 objects' ETags): cached in {first}"]


def test_a_changed_object_is_the_only_one_downloaded(s3: tuple[str, object], tmp_path: Path) -> None:
    url, client = s3
    first = fetch(tmp_path, env_for(url), [])
    new_weights = random.Random(4).randbytes(200_000)
    client.put_object(Bucket="models", Key="tiny/model.safetensors", Body=new_weights)  # type: ignore[attr-defined]
    lines: list[str] = []
    second = fetch(tmp_path, env_for(url), lines)
    assert second != first
    assert files(second) == {**MODEL, "model.safetensors": new_weights}
    assert lines[0] == f"{URI}: 3 files, 1 changed (0.2 MiB), 2 unchanged since the cached copy"
    for name in ("config.json", "tokenizer.json"):  # linked from the first entry: not downloaded again
        assert (second / name).stat().st_ino == (first / name).stat().st_ino
    assert (second / "model.safetensors").stat().st_ino != (first / "model.safetensors").stat().st_ino
    assert files(first) == MODEL  # the entry a running model may still map is left as it was


def test_an_unreachable_endpoint_serves_the_cached_copy_with_a_warning(
        s3: tuple[str, object], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url, _ = s3
    cached = fetch(tmp_path, env_for(url), [])
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="serving.sources.resolve"):
        assert fetch(tmp_path, env_for(closed), lines) == cached
    assert lines == [f"{URI}: cannot list it; serving the cached copy {cached.name}"]
    assert any("cannot reach the S3 endpoint" in r.getMessage() and "serving the copy cached" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(SourceUnreachable, match="cannot reach the S3 endpoint"):
        fetch(tmp_path / "elsewhere", env_for(closed), [])
