"""``serving.sources.s3``: an S3 prefix fetched from a real S3-protocol server (moto's, on loopback), and each
failure (no bucket, empty prefix, a traversal key, a truncated body, denied, no credentials, unreachable) as a
SourceError saying what to set."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from serving.sources.s3 import fetch_s3, parse_s3_uri
from serving.sources.source_error import SourceError
from tests.sources_servers import moto_server, s3_fault_proxy

WEIGHTS = random.Random(7).randbytes(300_000)
MODEL = {  # the objects under s3://models/tiny/, by path relative to the prefix
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": WEIGHTS,
    "tokenizer.json": b'{"version": "1.0"}',
    "sub/extra.json": b'{"nested": true}',
}


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's server holding the bucket ``models``: ``tiny/`` (a model folder, a directory marker), a sibling
    ``tiny-2/`` sharing its first characters, and ``evil/`` with a ``..`` key."""
    with moto_server() as url:
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for rel, body in MODEL.items():
            client.put_object(Bucket="models", Key=f"tiny/{rel}", Body=body)
        client.put_object(Bucket="models", Key="tiny/sub/", Body=b"")
        client.put_object(Bucket="models", Key="tiny-2/config.json", Body=b"{}")
        client.put_object(Bucket="models", Key="evil/config.json", Body=b"{}")
        client.put_object(Bucket="models", Key="evil/../escape.json", Body=b"{}")
        yield url


def env_for(endpoint: str) -> dict[str, str]:
    """The environment a fetch is given: moto's endpoint and its test credentials."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_prefix_lands_byte_identical_with_its_relative_paths(s3: str, tmp_path: Path) -> None:
    lines: list[str] = []
    fetch_s3("s3://models/tiny", tmp_path, env_for(s3), lines.append)
    assert tree(tmp_path) == MODEL
    total = f"{sum(map(len, MODEL.values())) / 2**20:.1f}"
    assert len(lines) == 5
    assert lines[0] == f"s3://models/tiny: 4 files, {total} MiB"
    assert lines[-1] == f"s3://models/tiny: 4/4 files, {total} of {total} MiB"


def test_a_trailing_slash_names_the_same_folder(s3: str, tmp_path: Path) -> None:
    fetch_s3("s3://models/tiny/", tmp_path, env_for(s3), lambda _: None)
    assert tree(tmp_path) == MODEL


def test_a_key_naming_one_object_fetches_that_object(s3: str, tmp_path: Path) -> None:
    fetch_s3("s3://models/tiny/model.safetensors", tmp_path, env_for(s3), lambda _: None)
    assert tree(tmp_path) == {"model.safetensors": WEIGHTS}


def test_the_s3_specific_endpoint_wins_over_the_general_one(s3: str, tmp_path: Path) -> None:
    env = {**env_for(f"http://127.0.0.1:{closed_port()}"), "AWS_ENDPOINT_URL_S3": s3}
    fetch_s3("s3://models/tiny", tmp_path, env, lambda _: None)
    assert tree(tmp_path) == MODEL


@pytest.mark.parametrize("uri", ["s3:/models/tiny", "s3://", "gs://models/tiny", "s3://ab/x", "models/tiny",
                                 "s3://-bad/x"])
def test_a_malformed_uri_names_option_model_id(uri: str) -> None:
    with pytest.raises(SourceError, match=r"^option\.model_id='.*' is not an S3 URI"):
        parse_s3_uri(uri)


def test_a_uri_parses_into_bucket_and_prefix() -> None:
    assert parse_s3_uri("s3://models/a/b/") == ("models", "a/b")
    assert parse_s3_uri("s3://models") == ("models", "")


def test_a_missing_bucket_is_named(s3: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError) as caught:
        fetch_s3("s3://no-such-bucket/tiny", tmp_path, env_for(s3), lambda _: None)
    assert str(caught.value) == "s3://no-such-bucket/tiny: the bucket 'no-such-bucket' does not exist"
    assert isinstance(caught.value.__cause__, ClientError)


def test_an_empty_prefix_is_an_error(s3: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError) as caught:
        fetch_s3("s3://models/absent", tmp_path, env_for(s3), lambda _: None)
    assert str(caught.value) == "s3://models/absent: no objects under s3://models/absent"
    assert tree(tmp_path) == {}


def test_a_key_leaving_the_folder_is_refused_before_any_download(s3: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"refusing the key 'evil/\.\./escape\.json'"):
        fetch_s3("s3://models/evil", tmp_path, env_for(s3), lambda _: None)
    assert tree(tmp_path) == {}
    assert not (tmp_path.parent / "escape.json").exists()


def test_a_truncated_body_is_an_error(s3: str, tmp_path: Path) -> None:
    with s3_fault_proxy(s3, truncate={"models/tiny/model.safetensors"}) as proxy:
        with pytest.raises(SourceError) as caught:
            fetch_s3("s3://models/tiny", tmp_path, env_for(proxy), lambda _: None)
    assert str(caught.value).startswith("s3://models/tiny: tiny/model.safetensors: download truncated or incomplete")
    assert caught.value.__cause__ is not None


def test_a_body_shorter_than_the_listing_is_an_error(s3: str, tmp_path: Path) -> None:
    with s3_fault_proxy(s3, short={"models/tiny/model.safetensors"}) as proxy:
        with pytest.raises(SourceError) as caught:
            fetch_s3("s3://models/tiny", tmp_path, env_for(proxy), lambda _: None)
    size = len(WEIGHTS)
    assert str(caught.value) == f"s3://models/tiny: model.safetensors truncated: got {size // 2} of {size} bytes"


def test_a_corrupt_body_fails_its_checksum(s3: str, tmp_path: Path) -> None:
    with s3_fault_proxy(s3, corrupt={"models/tiny/model.safetensors"}) as proxy:
        with pytest.raises(SourceError) as caught:
            fetch_s3("s3://models/tiny", tmp_path, env_for(proxy), lambda _: None)
    assert str(caught.value).startswith("s3://models/tiny: tiny/model.safetensors: download corrupt (its checksum "
                                        "does not match)")


def test_access_denied_says_to_set_credentials(s3: str, tmp_path: Path) -> None:
    with s3_fault_proxy(s3, deny=True) as proxy:
        with pytest.raises(SourceError) as caught:
            fetch_s3("s3://models/tiny", tmp_path, env_for(proxy), lambda _: None)
    assert str(caught.value) == ("s3://models/tiny: access denied (set AWS credentials: AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, with read access to the bucket 'models')")


def test_no_credentials_anywhere_says_to_set_them(s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(SourceError) as caught:
        fetch_s3("s3://models/tiny", dest, {"AWS_ENDPOINT_URL": s3, "AWS_DEFAULT_REGION": "us-east-1"},
                 lambda _: None)
    assert str(caught.value) == ("s3://models/tiny: no AWS credentials found (set AWS credentials: "
                                 "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")


def test_an_unreachable_endpoint_fails_fast_naming_aws_endpoint_url(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(SourceError) as caught:
        fetch_s3("s3://models/tiny", tmp_path, env_for(endpoint), lambda _: None)
    assert time.monotonic() - started < 15
    assert str(caught.value).startswith(f"s3://models/tiny: cannot reach the S3 endpoint {endpoint} "
                                        "(set AWS_ENDPOINT_URL, or AWS_REGION)")
