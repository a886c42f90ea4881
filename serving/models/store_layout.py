"""How a model folder of the store lays out its versions, and whether its files are whole.

Design note: a model folder ``NAME/`` is either one version (its ``serving.properties``' ``version=``, else 1)
or, when it has no ``serving.properties`` of its own and sub-folders named by digits, one version per such
sub-folder (``NAME/1/``, ``NAME/2/``: each a complete model folder). ``NAME/model.properties`` may pin the
default version (``default_version=2``); without it the highest version serves the name. The watched store
(``serving.models.store_watch``) loads a folder only when it is whole: every ``*.safetensors`` and ``*.gguf`` file is as
long as its header says, every shard an index names exists, every ``*.json`` (config, tokenizer, adapter config)
parses, and every ``*.bin``/``*.pt`` file written by ``torch.save`` (a zip archive) has its directory at its end;
so a copy that paused longer than the quiet period still does not load half-way. Reads only; torch-free.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from rollcore.errors import ConfigError, InvalidRequest
from rollcore.values import integer
from serving.config.keys import STORE_KEYS
from serving.config.settings import canonical_keys, norm, read_file, resolve
from serving.models.served_version import DEFAULT_VERSION
from serving.models.versions import check_version

MODEL_PROPERTIES = "serving.properties"
VERSIONS_FILE = "model.properties"
_VERSION_KEYS = {norm("version"): "version"}


def model_folders(store: Path) -> list[Path]:
    """The store's model folders (hidden and ``_``-prefixed ones are not models: copies in progress, caches)."""
    if not store.is_dir():
        return []
    return sorted(d for d in store.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def _version_dirs(folder: Path) -> list[Path]:
    try:
        return sorted(d for d in folder.iterdir() if d.is_dir() and d.name.isascii() and d.name.isdigit()
                      and int(d.name) > 0 and len(d.name) <= 9)
    except OSError:
        return []


def is_versioned(folder: Path) -> bool:
    """True when the folder holds its versions in digit-named sub-folders."""
    return not (folder / MODEL_PROPERTIES).is_file() and bool(_version_dirs(folder))


def versions_of(folder: Path, require_properties: bool = False) -> dict[str, Path]:
    """Version -> the folder it is built from. ``require_properties``: only folders with a ``serving.properties``
    (the watched store registers a folder once it has one)."""
    if is_versioned(folder):
        return {str(int(d.name)): d for d in _version_dirs(folder)
                if not require_properties or (d / MODEL_PROPERTIES).is_file()}
    if require_properties and not (folder / MODEL_PROPERTIES).is_file():
        return {}
    return {declared_version(folder): folder}


def declared_version(folder: Path) -> str:
    """``version=`` of the folder's ``serving.properties``; 1 without one. A bad value is left to the config
    loader, which reports it with its file and line (the folder is then a FAILED model)."""
    path = folder / MODEL_PROPERTIES
    if not path.is_file():
        return DEFAULT_VERSION
    try:
        raw = [(k, s) for k, s in read_file(path) if norm(k) in _VERSION_KEYS]
    except ConfigError:
        return DEFAULT_VERSION
    if not raw:
        return DEFAULT_VERSION
    try:
        return check_version(raw[-1][1].value)
    except InvalidRequest:
        return DEFAULT_VERSION


def pinned_default(folder: Path) -> str | None:
    """``default_version`` of ``NAME/model.properties`` (None without the file or the key). Raises
    ``ConfigError`` naming the file and line for an unknown key or a bad value."""
    path = folder / VERSIONS_FILE
    if not path.is_file():
        return None
    settings = canonical_keys(read_file(path), {norm(k): k for k in STORE_KEYS}, allow_options=False)
    setting = settings.get("default_version")
    return None if setting is None else str(resolve("default_version", setting, integer(1)))


def incomplete_files(folder: Path) -> list[str]:
    """Files under ``folder`` that are not whole yet: a ``*.safetensors`` or ``*.gguf`` shorter than its header
    says (or with a header still being written), a shard named by an ``*.index.json`` that is missing, a ``*.json``
    that does not parse, a ``torch.save`` archive (``*.bin``, ``*.pt``, ``*.pth``) without its closing directory."""
    missing: list[str] = []
    for index in sorted(folder.rglob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            continue  # reported below as a JSON file that does not parse
        missing += [str((index.parent / s).relative_to(folder)) for s in sorted(shards)
                    if isinstance(s, str) and not (index.parent / s).is_file()]
    from handlers.preflight import whole_gguf  # here: the frontend imports nothing of handlers until it needs it

    checks = {".safetensors": _whole_safetensors, ".gguf": whole_gguf, ".json": _whole_json,
              ".bin": _whole_archive, ".pt": _whole_archive, ".pth": _whole_archive}
    for path in sorted(folder.rglob("*")):
        check = checks.get(path.suffix.lower())
        if check is not None and path.is_file() and not check(path):
            missing.append(str(path.relative_to(folder)))
    return missing


def _whole_json(path: Path) -> bool:
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def _whole_archive(path: Path) -> bool:
    """A zip archive (``torch.save``'s format) is whole once its central directory, written last, is there; a
    file of the legacy pickle format cannot tell and counts as whole."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
        if head != b"PK\x03\x04":
            return len(head) == 4 and head[:2] != b"PK"
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return True


def _whole_safetensors(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return False
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > size - 8:
                return False
            header = json.loads(f.read(length))
    except (OSError, ValueError):
        return False
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    return size >= 8 + length + max(ends, default=0)
