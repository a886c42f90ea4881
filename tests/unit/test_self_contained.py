"""The repository stands on its own: no file of the project points at design notes or paths outside it, and
every relative link in its markdown resolves to a file inside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis",
             "models", "results", "build", "dist"}
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/work/|\b(ARCHITECTURE|STYLE|REFERENCE)\.md\b|ENGINE-NOTES")
SUFFIXES = {".py", ".md", ".sh", ".cfg", ".toml", ".properties", ".yml", ".txt", ".c", ".json", ""}
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def project_files() -> list[Path]:
    """The project's text files (virtualenvs, caches, git data and built benchmark models pruned)."""
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith((".venv", ".git"))
                   and not d.endswith(".egg-info")]  # pip's build metadata (a copy of an older README)
        files += [Path(root) / n for n in names if n != ".git" and Path(n).suffix in SUFFIXES]
    return files


def test_no_file_points_outside_the_repository() -> None:
    files = project_files()
    assert REPO / "README.md" in files and REPO / ".ci" / "run" in files
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files if p != Path(__file__).resolve()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "\n".join(hits)


def test_markdown_links_resolve_inside_the_repository() -> None:
    for doc in [p for p in project_files() if p.suffix == ".md"]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(REPO) and resolved.exists(), f"{doc.relative_to(REPO)}: {target}"


def test_readme_links_the_architecture_document() -> None:
    assert "](docs/architecture.md)" in (REPO / "README.md").read_text()
