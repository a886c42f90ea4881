"""S3 prefixes (``s3://bucket/prefix``) as a model source, via boto3.

Design note: the client is built from the ``env`` mapping the caller passes (endpoint, region, keys), falling
back to boto3's standard credential chain (profiles, instance roles) when the keys are not there, with bounded
retries and timeouts so an unreachable endpoint fails in seconds, not minutes. Every object under the prefix is
downloaded into the fetcher's private folder at its path relative to the prefix; a key that would land outside
it (a ``..`` component) is refused, and each file's size is checked against the listing, so a truncated body
is an error here, not a corrupt model at load time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import boto3  # type: ignore[import-untyped]
from boto3.exceptions import RetriesExceededError, S3TransferFailedError  # type: ignore[import-untyped]
from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)

from serving.sources.errors import SourceError
from serving.sources.fetch import Progress

_URI = re.compile(r"^s3://(?P<bucket>[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9])(?:/(?P<prefix>.*))?$")
_CLIENT_CONFIG = Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=60)
_TRANSFER = TransferConfig(num_download_attempts=2)
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403")
_CREDENTIALS = "set AWS credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``s3://bucket/prefix`` URI; a SourceError naming option.model_id otherwise."""
    m = _URI.fullmatch(uri)
    if m is None:
        raise SourceError(f"option.model_id={uri!r} is not an S3 URI (expected s3://bucket/prefix)")
    return m["bucket"], (m["prefix"] or "").strip("/")


def fetch_s3(uri: str, dest: Path, env: Mapping[str, str], progress: Progress) -> None:
    """Download every object under the S3 prefix ``uri`` into ``dest``, keeping paths relative to the prefix."""
    bucket, prefix = parse_s3_uri(uri)
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    label = uri.rstrip("/")
    with _s3_errors(label, bucket, endpoint):
        client = _client(env, endpoint)
        objects = _listing(client, bucket, prefix, label)
    total = sum(size for _, _, size in objects)
    progress(f"{label}: {len(objects)} files, {_mib(total)} MiB")
    done = 0
    for i, (key, rel, size) in enumerate(objects, 1):
        target = dest.joinpath(*PurePosixPath(rel).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _s3_errors(label, bucket, endpoint, key):
            client.download_file(bucket, key, str(target), Config=_TRANSFER)
        got = target.stat().st_size
        if got != size:
            raise SourceError(f"{label}: {rel} truncated: got {got} of {size} bytes")
        done += got
        progress(f"{label}: {i}/{len(objects)} files, {_mib(done)} of {_mib(total)} MiB")


def _client(env: Mapping[str, str], endpoint: str | None) -> Any:
    """An S3 client from ``env``'s values; boto3's own chain supplies whatever ``env`` leaves out."""
    session = boto3.session.Session(
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        aws_session_token=env.get("AWS_SESSION_TOKEN") or None,
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        profile_name=env.get("AWS_PROFILE") or None,
    )
    return session.client("s3", endpoint_url=endpoint or None, config=_CLIENT_CONFIG)


def _listing(client: Any, bucket: str, prefix: str, label: str) -> list[tuple[str, str, int]]:
    """``(key, relative path, size)`` of every object under ``prefix`` (a folder, or one object's own key)."""
    found: list[tuple[str, str, int]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key: str = obj["Key"]
            if key.endswith("/"):
                continue  # a "directory marker"
            if prefix and key == prefix:
                rel = PurePosixPath(key).name  # the prefix names a single object
            elif not prefix or key.startswith(prefix + "/"):
                rel = key[len(prefix) + 1 :] if prefix else key
            else:
                continue  # a sibling sharing the prefix's first characters ("model" vs "model-2/...")
            parts = rel.split("/")
            if ".." in parts or "" in parts or rel.startswith("/"):
                raise SourceError(f"{label}: refusing the key {key!r} (its path would leave the model folder)")
            found.append((key, rel, int(obj["Size"])))
    if not found:
        raise SourceError(f"{label}: no objects under s3://{bucket}/{prefix}")
    return found


@contextmanager
def _s3_errors(label: str, bucket: str, endpoint: str | None, key: str | None = None) -> Iterator[None]:
    """Turns boto3's exceptions into a SourceError (with the cause) saying what to set."""
    try:
        yield
    except SourceError:
        raise
    except Exception as error:
        raise SourceError(_message(error, label, bucket, endpoint, key)) from error


def _message(error: Exception, label: str, bucket: str, endpoint: str | None, key: str | None) -> str:
    """What went wrong, in words a user can act on."""
    where = f"{label}: {key}" if key else label
    cause = error.last_exception if isinstance(error, RetriesExceededError) else error
    if isinstance(cause, ClientError):
        code = str(cause.response.get("Error", {}).get("Code", ""))
        status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return f"{label}: the bucket {bucket!r} does not exist"
        if code in _DENIED or status == 403:
            return f"{where}: access denied ({_CREDENTIALS}, with read access to the bucket {bucket!r})"
        if code in ("NoSuchKey", "404"):
            return f"{where}: the object disappeared during the download"
        return f"{where}: {code or status}: {cause}"
    if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
        return f"{label}: no AWS credentials found ({_CREDENTIALS})"
    if isinstance(cause, (EndpointConnectionError, ConnectTimeoutError)):
        at = endpoint or "the default AWS endpoint"
        return f"{label}: cannot reach the S3 endpoint {at} (set AWS_ENDPOINT_URL, or AWS_REGION): {cause}"
    if isinstance(cause, FlexibleChecksumError):
        return f"{where}: download corrupt (its checksum does not match): {cause}"
    if isinstance(cause, (IncompleteReadError, ResponseStreamingError, S3TransferFailedError)) or (
            isinstance(error, RetriesExceededError)):
        return f"{where}: download truncated or incomplete: {cause}"
    return f"{where}: {type(cause).__name__}: {cause}"


def _mib(n: int) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / 2**20:.1f}"
