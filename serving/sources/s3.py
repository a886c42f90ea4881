"""S3 prefixes (``s3://bucket/prefix``) as a model source, via boto3.

Design note: the client is built from the ``env`` mapping the caller passes (endpoint, region, keys), falling
back to boto3's standard credential chain (profiles, instance roles) when the keys are not there, with bounded
retries and timeouts so an unreachable endpoint fails in seconds, not minutes. Every object under the prefix is
downloaded into the fetcher's private folder at its path relative to the prefix; a key that would land outside
it (a ``..`` component) is refused, and each file's size is checked against the listing, so a truncated body
is an error here, not a corrupt model at load time. The listing (keys, sizes, ETags) names what the bytes are:
the cache keeps one entry per listing, and a fetch after a change links the unchanged files from the previous
entry (``.s3-objects.json`` records each file's ETag) and downloads only what changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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

from serving.sources.fetch import Progress
from serving.sources.source_error import SourceError, SourceUnreachable

_URI = re.compile(r"^s3://(?P<bucket>[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9])(?:/(?P<prefix>.*))?$")
_CLIENT_CONFIG = Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=60)
_TRANSFER = TransferConfig(num_download_attempts=2)
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403")
_CREDENTIALS = "set AWS credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
OBJECTS_FILE = ".s3-objects.json"


@dataclass(frozen=True)
class S3Object:
    key: str
    rel: str  # its path in the model folder
    size: int
    etag: str


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``s3://bucket/prefix`` URI; a SourceError naming option.model_id otherwise."""
    m = _URI.fullmatch(uri)
    if m is None:
        raise SourceError(f"option.model_id={uri!r} is not an S3 URI (expected s3://bucket/prefix)")
    return m["bucket"], (m["prefix"] or "").strip("/")


def list_s3(uri: str, env: Mapping[str, str]) -> list[S3Object]:
    """Every object under the S3 prefix ``uri``: one listing, no download."""
    bucket, prefix = parse_s3_uri(uri)
    endpoint = _endpoint(env)
    with _s3_errors(uri.rstrip("/"), bucket, endpoint):
        return _listing(_client(env, endpoint), bucket, prefix, uri.rstrip("/"))


def read_range(uri: str, obj: S3Object, start: int, length: int, env: Mapping[str, str]) -> bytes:
    """Up to ``length`` bytes of the listed object ``obj`` from ``start`` (one ranged GET: a file's header
    without its body)."""
    bucket, _ = parse_s3_uri(uri)
    endpoint = _endpoint(env)
    with _s3_errors(uri.rstrip("/"), bucket, endpoint, obj.key):
        body = _client(env, endpoint).get_object(Bucket=bucket, Key=obj.key,
                                                 Range=f"bytes={start}-{start + length - 1}")["Body"]
        return bytes(body.read())


def listing_digest(objects: Sequence[S3Object]) -> str:
    """What the prefix holds, as a short digest of its paths, sizes and ETags: the cache entry's name."""
    text = json.dumps(sorted((o.rel, o.size, o.etag) for o in objects))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fetch_s3(uri: str, dest: Path, env: Mapping[str, str], progress: Progress,
             objects: Sequence[S3Object] | None = None, previous: Path | None = None) -> None:
    """Download every object under the S3 prefix ``uri`` (``objects``: its listing, if already made) into
    ``dest``, keeping paths relative to the prefix; a file of the ``previous`` entry with the same path, size and
    ETag is linked instead of downloaded."""
    bucket, prefix = parse_s3_uri(uri)
    endpoint = _endpoint(env)
    label = uri.rstrip("/")
    with _s3_errors(label, bucket, endpoint):
        client = _client(env, endpoint)
        if objects is None:
            objects = _listing(client, bucket, prefix, label)
    kept = _reusable(previous, objects)
    total = sum(o.size for o in objects if o.rel not in kept)
    if kept:
        progress(f"{label}: {len(objects)} files, {len(objects) - len(kept)} changed ({_mib(total)} MiB), "
                 f"{len(kept)} unchanged since the cached copy")
    else:
        progress(f"{label}: {len(objects)} files, {_mib(total)} MiB")
    done = 0
    for i, obj in enumerate(objects, 1):
        target = dest.joinpath(*PurePosixPath(obj.rel).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if obj.rel in kept:
            _link(kept[obj.rel], target)
            continue
        with _s3_errors(label, bucket, endpoint, obj.key):
            client.download_file(bucket, obj.key, str(target), Config=_TRANSFER)
        got = target.stat().st_size
        if got != obj.size:
            raise SourceError(f"{label}: {obj.rel} truncated: got {got} of {obj.size} bytes")
        done += got
        progress(f"{label}: {i}/{len(objects)} files, {_mib(done)} of {_mib(total)} MiB")


def record_objects(entry: Path, objects: Sequence[S3Object]) -> None:
    """Keep the listing a cache entry was fetched from, for the next fetch to tell what changed."""
    (entry / OBJECTS_FILE).write_text(json.dumps({o.rel: {"size": o.size, "etag": o.etag} for o in objects}))


def _reusable(previous: Path | None, objects: Sequence[S3Object]) -> dict[str, Path]:
    """Path -> the previous entry's file, for every object unchanged since it was fetched."""
    if previous is None:
        return {}
    try:
        known = json.loads((previous / OBJECTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for o in objects:
        was = known.get(o.rel) if isinstance(known, dict) else None
        path = previous.joinpath(*PurePosixPath(o.rel).parts)
        if isinstance(was, dict) and was.get("etag") == o.etag and was.get("size") == o.size and path.is_file() \
                and path.stat().st_size == o.size:
            found[o.rel] = path
    return found


def _link(source: Path, target: Path) -> None:
    """The same bytes without a copy where the filesystem allows (a hard link), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        shutil.copyfile(source, target)


def _endpoint(env: Mapping[str, str]) -> str | None:
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")


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


def _listing(client: Any, bucket: str, prefix: str, label: str) -> list[S3Object]:
    """Every object under ``prefix`` (a folder, or one object's own key)."""
    found: list[S3Object] = []
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
            found.append(S3Object(key, rel, int(obj["Size"]), str(obj.get("ETag", "")).strip('"')))
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
        cause = error.last_exception if isinstance(error, RetriesExceededError) else error
        kind = SourceUnreachable if isinstance(cause, (EndpointConnectionError, ConnectTimeoutError)) else SourceError
        raise kind(_message(error, label, bucket, endpoint, key)) from error


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
