"""Hub sources cached by commit (``serving.sources.resolve``, ``serving.sources.hub``), against the loopback hub
of ``tests/sources_servers.py``: a start or reload asks which commit the revision names and serves that commit's
cached entry; ``option.gguf_file`` fetches that GGUF file only; a file in the user's own hub cache (filled by
huggingface_hub itself) is linked from there, not downloaded; an unreachable hub serves the cached copy."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants, hf_hub_download

from serving.sources.resolve import _download  # the fetch alone: a GGUF's conversion is another test's
from serving.sources.source_error import SourceError
from tests.sources_servers import commit_of, hub_server

REPOS = {
    "org/tiny/main": {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"main weights" * 1000,
                      "tokenizer.json": b'{"version": "1.0"}'},
    "org/tiny/v2": {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"v2 weights" * 1000,
                    "tokenizer.json": b'{"version": "1.0"}'},
    "org/quants/main": {"config.json": b'{"model_type": "llama"}', "model-Q4_0.gguf": b"GGUF q4" * 1000,
                        "model-Q8_0.gguf": b"GGUF q8" * 4000},
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("hub")
    for revision, files in REPOS.items():
        for name, body in files.items():
            (root / revision / name).parent.mkdir(parents=True, exist_ok=True)
            (root / revision / name).write_bytes(body)
    with hub_server(root) as url:
        yield url


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def download(tmp_path: Path, model_id: str, env: dict[str, str], lines: list[str],
             gguf_file: str | None = None) -> Path:
    return _download(model_id, allow_unsafe=False, gguf_file=gguf_file, env={"HF_HUB_CACHE": str(tmp_path / "none"),
                                                                             **env},
                     root=tmp_path / "cache", progress=lines.append)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_each_commit_is_its_own_entry_and_a_known_commit_is_served_from_the_cache(hub: str, tmp_path: Path) -> None:
    env = {"HF_ENDPOINT": hub}
    main = download(tmp_path, "org/tiny", env, [])
    assert main.name.endswith(commit_of("org/tiny", "main")[:16]) and files(main) == REPOS["org/tiny/main"]
    v2 = download(tmp_path, "org/tiny@v2", env, [])
    assert v2 != main and files(v2) == REPOS["org/tiny/v2"]
    lines: list[str] = []
    assert download(tmp_path, "org/tiny", env, lines) == main
    assert lines == [f"org/tiny: commit {commit_of('org/tiny', 'main')[:12]}: cached in {main}"]


def test_a_named_gguf_file_is_the_only_weights_fetched(hub: str, tmp_path: Path) -> None:
    got = download(tmp_path, "org/quants", {"HF_ENDPOINT": hub}, [], gguf_file="model-Q4_0.gguf")
    assert sorted(files(got)) == ["config.json", "model-Q4_0.gguf"]
    with pytest.raises(SourceError, match=r"option.gguf_file='model-Q2_K.gguf' is not in hub repository org/quants "
                                          r"\(GGUF files: model-Q4_0.gguf, model-Q8_0.gguf\)"):
        download(tmp_path / "other", "org/quants", {"HF_ENDPOINT": hub}, [], gguf_file="model-Q2_K.gguf")


def test_a_file_in_the_users_hub_cache_is_linked_not_downloaded(hub: str, tmp_path: Path) -> None:
    user_cache = tmp_path / "hf-home" / "hub"
    held = Path(hf_hub_download("org/tiny", "model.safetensors", cache_dir=user_cache, endpoint=hub))
    lines: list[str] = []
    got = download(tmp_path, "org/tiny", {"HF_ENDPOINT": hub, "HF_HUB_CACHE": str(user_cache)}, lines)
    assert files(got) == REPOS["org/tiny/main"]
    assert (got / "model.safetensors").stat().st_ino == held.resolve().stat().st_ino
    assert "org/tiny: model.safetensors from the hub cache" in lines
    assert "org/tiny: config.json from the hub cache" not in lines  # the others were downloaded


def test_an_unreachable_hub_serves_the_cached_copy(hub: str, tmp_path: Path) -> None:
    cached = download(tmp_path, "org/tiny", {"HF_ENDPOINT": hub}, [])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    lines: list[str] = []
    assert download(tmp_path, "org/tiny", {"HF_ENDPOINT": closed}, lines) == cached
    assert lines == [f"org/tiny: cannot reach the hub; serving the cached copy {cached.name}"]
    with pytest.raises(SourceError, match="cannot reach the hub"):
        download(tmp_path / "elsewhere", "org/tiny", {"HF_ENDPOINT": closed}, [])
