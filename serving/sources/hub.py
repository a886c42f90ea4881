"""Model hub repositories (``org/name`` or ``org/name@revision``) as a model source, via huggingface_hub.

Design note: only what a server loads is fetched (safetensors or GGUF weights, config, tokenizer and chat-template
files), never code, and pickle weights (``*.bin``) only when the operator allows unsafe weights: a pickle runs
code when loaded. The revision is resolved to its commit first and every file is fetched at that commit, so a
branch moving during the download cannot mix two versions, and the cache entry is named by that commit (a
start or a reload asks the hub which commit the revision is now: a new commit is a new entry). With
``option.gguf_file`` only that GGUF file is fetched. A file already in the user's own hub cache (``HF_HUB_CACHE``,
``HF_HOME``) at that commit is linked from there instead of downloaded; the user's cache is never written. Other
files go straight into the fetcher's private folder, with huggingface_hub's metadata folder inside it (removed at
the end). Each file's size is checked against the repository listing, so a truncated body is an error here, not a
corrupt model at load time.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import hf_raise_for_status, tqdm

from serving.sources.adapter_folder import check_listing
from serving.sources.fetch import Progress
from serving.sources.source_error import SourceError, SourceUnreachable

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

# what a server loads besides the weights (matched against the path in the repository, as snapshot_download does)
_SUPPORT = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab.*",
            "merges.txt", "*.model", "chat_template*")
_SAFE_WEIGHTS = ("*.safetensors", "*.safetensors.index.json")
_GGUF = ("*.gguf",)
_PICKLE = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_UNSAFE_WEIGHTS = ("*.bin", "*.bin.index.json")


def parse_hub_id(model_id: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``model_id`` names a hub repository, None for anything else (an existing
    path, a URI, a name with more or fewer than one '/')."""
    if _HUB_ID.fullmatch(model_id) is None or ".." in model_id.partition("@")[0] or os.path.exists(model_id):
        return None
    repo_id, _, revision = model_id.partition("@")
    return repo_id, revision or None


@dataclass(frozen=True)
class HubListing:
    commit: str  # what the revision names now
    sizes: dict[str, int | None]  # file -> bytes


def list_hub(repo_id: str, revision: str | None, env: Mapping[str, str]) -> HubListing:
    """The commit ``revision`` (default branch when None) names now, and the repository's files: one request."""
    endpoint, token, timeout, label = _client_settings(repo_id, revision, env)
    with _hub_errors(label, endpoint, revision):
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True,
                                                                timeout=timeout)
    return HubListing(info.sha or revision or constants.DEFAULT_REVISION,
                      {s.rfilename: s.size for s in info.siblings or []})


def read_range(repo_id: str, commit: str, name: str, start: int, length: int, env: Mapping[str, str]) -> bytes:
    """Up to ``length`` bytes of the repository's file ``name`` at ``commit`` from ``start`` (one ranged GET: a
    file's header without its body)."""
    endpoint, token, timeout, label = _client_settings(repo_id, commit, env)
    headers = {"Range": f"bytes={start}-{start + length - 1}"} | ({"Authorization": f"Bearer {token}"} if token else {})
    with _hub_errors(label, endpoint, commit, name):
        response = httpx2.get(hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint), headers=headers,
                              timeout=timeout, follow_redirects=True)
        hf_raise_for_status(response)
    if response.status_code != 206:  # a server without ranges sent the whole file: keep what was asked
        return response.content[start : start + length]
    return response.content


def fetch_hub(repo_id: str, revision: str | None, dest: Path, env: Mapping[str, str], progress: Progress,
              allow_unsafe: bool, gguf_file: str | None = None, listing: HubListing | None = None,
              adapter: bool = False) -> None:
    """Download the loadable files of ``repo_id`` at ``revision`` (``listing``: its listing, if already made)
    into ``dest``; with ``adapter``, a LoRA adapter's two files only (refused before any download when the
    repository lacks them)."""
    endpoint, token, timeout, label = _client_settings(repo_id, revision, env)
    listing = listing or list_hub(repo_id, revision, env)
    sizes, commit = listing.sizes, listing.commit
    wanted = check_listing(f"hub repository {label}", sorted(sizes)) if adapter else \
        select_files(label, sorted(sizes), allow_unsafe, gguf_file)
    total = sum(sizes[name] or 0 for name in wanted)
    progress(f"{label}: {len(wanted)} files, {_mib(total)} MiB")
    done = 0
    cache = dest / ".cache" / "huggingface"
    user_cache = env.get("HF_HUB_CACHE") or (os.path.join(env["HF_HOME"], "hub") if env.get("HF_HOME")
                                             else constants.HF_HUB_CACHE)
    try:
        for i, name in enumerate(wanted, 1):
            held = try_to_load_from_cache(repo_id, name, cache_dir=user_cache, revision=commit)
            if isinstance(held, str) and os.path.getsize(held) == sizes[name]:
                path = str(dest / name)
                _link(Path(held), Path(path))
                progress(f"{label}: {name} from the hub cache")
            else:
                with _hub_errors(label, endpoint, revision, name):
                    path = hf_hub_download(repo_id, name, revision=commit, local_dir=dest, cache_dir=cache / "hub",
                                           endpoint=endpoint, token=token, etag_timeout=timeout, tqdm_class=_Silent)
            got, expected = os.path.getsize(path), sizes[name]
            if expected is not None and got != expected:
                raise SourceError(f"hub repository {label}: {name} truncated: got {got} of {expected} bytes")
            done += got
            progress(f"{label}: {i}/{len(wanted)} files, {_mib(done)} of {_mib(total)} MiB")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if (dest / ".cache").is_dir() and not any((dest / ".cache").iterdir()):
            (dest / ".cache").rmdir()


def _client_settings(repo_id: str, revision: str | None, env: Mapping[str, str]) -> tuple[str, str | None, float, str]:
    endpoint = (env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    label = f"{repo_id}@{revision}" if revision else repo_id
    timeout = _seconds(env, "HF_HUB_ETAG_TIMEOUT", constants.HF_HUB_ETAG_TIMEOUT)
    return endpoint, env.get("HF_TOKEN") or None, timeout, label


def _link(source: Path, target: Path) -> None:
    """The cached file's bytes without a copy where the filesystem allows (a hard link of the blob), else a copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source.resolve(), target)
    except OSError:
        shutil.copyfile(source, target)


def select_files(label: str, names: list[str], allow_unsafe: bool, gguf_file: str | None = None) -> list[str]:
    """The files to fetch from a listing: support files plus one kind of weights, safest first (with
    ``gguf_file``, that GGUF file only)."""
    for name in names:
        parts = PurePosixPath(name).parts
        if name.startswith("/") or ".." in parts:
            raise SourceError(f"hub repository {label}: refusing the file name {name!r} (outside the repository)")

    def matching(patterns: tuple[str, ...]) -> list[str]:
        return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]

    weights = matching(_SAFE_WEIGHTS) if matching(("*.safetensors",)) else matching(_GGUF)
    if gguf_file:
        ggufs = matching(_GGUF)
        if gguf_file not in ggufs:
            raise SourceError(f"option.gguf_file={gguf_file!r} is not in hub repository {label} (GGUF files: "
                              f"{', '.join(ggufs) or 'none'})")
        weights = [gguf_file]
    if not weights and matching(_PICKLE):
        if not allow_unsafe:
            raise SourceError(f"hub repository {label} has only pickle weights ({', '.join(matching(_PICKLE))}), "
                              "which run code when loaded; refused (allow unsafe weights to load them)")
        weights = matching(_UNSAFE_WEIGHTS) if matching(("*.bin",)) else []
    if not weights:
        raise SourceError(f"hub repository {label} has no loadable weights (*.safetensors, *.gguf"
                          f"{', *.bin' if allow_unsafe else ''}); its files: {', '.join(names) or 'none'}")
    return sorted(set(matching(_SUPPORT)) | set(weights))


@contextmanager
def _hub_errors(label: str, endpoint: str, revision: str | None, name: str | None = None) -> Iterator[None]:
    """Turns huggingface_hub's and httpx2's exceptions into a SourceError (with the cause) saying what to set."""
    try:
        yield
    except SourceError:
        raise
    except Exception as error:
        offline = isinstance(error, (OfflineModeIsEnabled, LocalEntryNotFoundError, httpx2.ConnectError,
                                     httpx2.TimeoutException))
        raise (SourceUnreachable if offline else SourceError)(_message(error, label, endpoint, revision, name)) \
            from error


def _message(error: Exception, label: str, endpoint: str, revision: str | None, name: str | None) -> str:
    """What went wrong, in words a user can act on."""
    where = f"hub repository {label}" + (f": {name}" if name else "")
    status = error.response.status_code if isinstance(error, HfHubHTTPError) else None
    if isinstance(error, RevisionNotFoundError):
        return f"hub repository {label}: revision {revision!r} not found"
    if isinstance(error, RepositoryNotFoundError) or status in (401, 403):
        return f"hub repository {label}: not found or not authorised (set HF_TOKEN)"
    if isinstance(error, HFValidationError):
        return f"option.model_id={label!r} is not a valid hub repository id: {error}"
    if isinstance(error, (OfflineModeIsEnabled, LocalEntryNotFoundError, httpx2.ConnectError, httpx2.TimeoutException)):
        return f"cannot reach the hub at {endpoint} (set HF_ENDPOINT or use a local folder): {error}"
    if isinstance(error, (httpx2.TransportError, OSError)) and status is None:
        return f"{where}: download truncated or incomplete: {error}"
    return f"{where}: {type(error).__name__}: {error}"


class _Silent(tqdm):  # type: ignore[type-arg]
    """No progress bars on stderr: progress is reported through the ``progress`` callback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A timeout from ``env`` (huggingface_hub reads its own only at import), else the library's."""
    try:
        return float(env[name])
    except (KeyError, ValueError):
        return float(default)


def _mib(n: int) -> str:
    """Bytes as MiB with one decimal."""
    return f"{n / 2**20:.1f}"
