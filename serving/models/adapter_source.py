"""Where a LoRA adapter registered over the API comes from, turned into a checked local folder for the workers.

Design note: ``src`` is a folder inside the model store (as before), an S3 prefix ``s3://bucket/prefix`` or a hub
id ``org/name[@revision]``: the syntax of ``option.model_id``, resolved by the same resolver into the same cache
(``serving.sources.resolve.resolve_adapter``: revalidated by ETags or commit on every registration, so an
unchanged source fetches nothing and a changed one is fetched again), in a thread so the server keeps answering.
A name that is both a folder of the store and a hub id is the folder. The folder is checked to be an adapter here
(``serving.sources.adapter_folder``), so workers only ever get a local adapter folder. Every failure is an
``InvalidRequest`` naming the adapter, ``src`` and the cause, with server paths scrubbed out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from rollcore.errors import InvalidRequest
from serving.redact import scrub_paths
from serving.sources.adapter_folder import check_folder
from serving.sources.resolve import resolve_adapter
from serving.sources.source_error import SourceError

log = logging.getLogger(__name__)

FORMS = "a folder inside the model store, an S3 URI (s3://bucket/prefix) or a hub id (org/name[@revision])"


async def adapter_folder(name: str, src: str, *, in_store: Callable[[str], Path], env: Mapping[str, str],
                         cache_root: Path, store: Path, model: str) -> Path:
    """The local folder holding the adapter ``src`` names (``in_store``: a client's folder name -> the folder in
    the model store, or InvalidRequest). Raises ``InvalidRequest``."""
    where = f"adapter {name!r}: src={src!r}"
    folder, remote = None, src.startswith("s3://")
    if not remote:
        try:
            folder = in_store(src)
        except InvalidRequest as exc:
            from serving.sources.hub import parse_hub_id

            if src.startswith(("/", "\\")) or parse_hub_id(src) is None:
                raise InvalidRequest(f"{where}: {exc.message}; expected {FORMS}") from None
            remote = True
    try:
        if remote:
            folder = await asyncio.to_thread(
                resolve_adapter, src, env=env, root=cache_root,
                progress=lambda line: log.info("model %s: adapter %s: %s", model, name, line))
            log.info("model %s: adapter %s (%s) is served from %s", model, name, src, folder)
        assert folder is not None
        check_folder(folder, where)
    except SourceError as exc:
        log.warning("model %s: adapter %s: %s", model, name, exc)
        not_local = f" (no folder {src!r} in the model store)" if remote and not src.startswith("s3://") else ""
        text = str(exc) if str(exc).startswith(where) else f"{where}{not_local}: {exc}"
        raise InvalidRequest(scrub_paths(text, {str(cache_root): "<model_cache>", str(store): "<model_store>"})) \
            from None
    return folder
