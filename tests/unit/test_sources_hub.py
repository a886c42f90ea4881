"""``serving.sources.hub``: hub ids parsed strictly, and repositories fetched through huggingface_hub from a
loopback hub (``tests/sources_servers.py``): only loadable files, the revision honoured, pickle weights refused
unless allowed, and each failure (no repository, no token, no revision, truncated, unreachable) a SourceError."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants

from serving.sources.hub import fetch_hub, parse_hub_id, select_files
from serving.sources.source_error import SourceError
from tests.sources_servers import hub_server

WEIGHTS = random.Random(11).randbytes(200_000)
LOADABLE = {  # what a fetch of org/tiny at main must bring, byte for byte
    "config.json": b'{"model_type": "llama"}',
    "generation_config.json": b'{"do_sample": false}',
    "model.safetensors": WEIGHTS,
    "special_tokens_map.json": b"{}",
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b'{"chat_template": "x"}',
}
REPOS = {
    "org/tiny/main": {**LOADABLE, "pytorch_model.bin": b"pickle", "modeling_tiny.py": b"import os",
                      "README.md": b"# tiny", "sub/config.json": b"{}"},
    "org/tiny/v2": {"config.json": b'{"v": 2}', "model.safetensors": b"v2 weights"},
    "org/pickled/main": {"config.json": b"{}", "pytorch_model.bin": b"pickle weights", "tokenizer.json": b"{}"},
    "org/weightless/main": {"config.json": b"{}", "README.md": b"# none"},
    "org/quantized/main": {"model-q4.gguf": b"GGUF q4", "README.md": b"# gguf"},
}


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hub server's folder: ``REPOS`` written out as ``<org>/<name>/<revision>/<files>``."""
    root = tmp_path_factory.mktemp("hub")
    for revision, files in REPOS.items():
        for name, body in files.items():
            (root / revision / name).parent.mkdir(parents=True, exist_ok=True)
            (root / revision / name).write_bytes(body)
    return root


@pytest.fixture(scope="module")
def hub(hub_root: Path) -> Iterator[str]:
    with hub_server(hub_root) as url:
        yield url


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No token from the machine running the tests (its environment or ``hf auth login``'s file)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fetch(endpoint: str, repo_id: str, revision: str | None, dest: Path, *, allow_unsafe: bool = False,
          token: str | None = None, lines: list[str] | None = None) -> None:
    env = {"HF_ENDPOINT": endpoint, **({"HF_TOKEN": token} if token else {})}
    fetch_hub(repo_id, revision, dest, env, (lines if lines is not None else []).append, allow_unsafe)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("model_id", "parsed"), [
    ("org/name", ("org/name", None)),
    ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None)),
    ("org/name@v1.0", ("org/name", "v1.0")),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ("org/name@0123456789abcdef0123456789abcdef01234567", ("org/name", "0123456789abcdef0123456789abcdef01234567")),
])
def test_hub_ids_are_recognised(model_id: str, parsed: tuple[str, str | None]) -> None:
    assert parse_hub_id(model_id) == parsed


@pytest.mark.parametrize("model_id", ["name", "/abs/org/name", "./org/name", "a/b/c", "s3://bucket/prefix",
                                      "org/name@", "org/..", "../name", "org/na me", "-org/name", "", "org/",
                                      "hf://org/name", "org/name@rev with space"])
def test_other_things_are_not_hub_ids(model_id: str) -> None:
    assert parse_hub_id(model_id) is None


def test_an_existing_relative_path_is_not_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None
    assert parse_hub_id("org/other") == ("org/other", None)


def test_only_loadable_files_land_byte_identical(hub: str, tmp_path: Path) -> None:
    lines: list[str] = []
    fetch(hub, "org/tiny", None, tmp_path, lines=lines)
    assert tree(tmp_path) == LOADABLE  # no .bin beside safetensors, no code, no README, no cache left behind
    total = f"{sum(map(len, LOADABLE.values())) / 2**20:.1f}"
    assert len(lines) == 7
    assert lines[0] == f"org/tiny: 6 files, {total} MiB"
    assert lines[-1] == f"org/tiny: 6/6 files, {total} of {total} MiB"


def test_the_revision_is_honoured(hub: str, tmp_path: Path) -> None:
    fetch(hub, "org/tiny", "v2", tmp_path)
    assert tree(tmp_path) == REPOS["org/tiny/v2"]


def test_a_missing_revision_is_named(hub: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"^hub repository org/tiny@nope: revision 'nope' not found$"):
        fetch(hub, "org/tiny", "nope", tmp_path)


def test_a_missing_repository_says_not_found_or_not_authorised(hub: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError) as caught:
        fetch(hub, "org/absent", None, tmp_path)
    assert str(caught.value) == "hub repository org/absent: not found or not authorised (set HF_TOKEN)"
    assert caught.value.__cause__ is not None


def test_a_private_repository_needs_hf_token(hub_root: Path, tmp_path: Path) -> None:
    with hub_server(hub_root, token="hf_secret") as private:
        with pytest.raises(SourceError,
                           match=r"^hub repository org/tiny: not found or not authorised \(set HF_TOKEN\)$"):
            fetch(private, "org/tiny", None, tmp_path / "without")
        fetch(private, "org/tiny", None, tmp_path / "with", token="hf_secret")
    assert tree(tmp_path / "with") == LOADABLE


def test_pickle_only_weights_are_refused_unless_allowed(hub: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError,
                       match=r"^hub repository org/pickled has only pickle weights \(pytorch_model\.bin\)"):
        fetch(hub, "org/pickled", None, tmp_path / "refused")
    assert not (tmp_path / "refused").exists() or tree(tmp_path / "refused") == {}
    fetch(hub, "org/pickled", None, tmp_path / "allowed", allow_unsafe=True)
    assert tree(tmp_path / "allowed") == REPOS["org/pickled/main"]


def test_a_repository_without_weights_is_an_error(hub: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"^hub repository org/weightless has no loadable weights .*"
                                          r"its files: README\.md, config\.json$"):
        fetch(hub, "org/weightless", None, tmp_path)


def test_gguf_weights_are_fetched(hub: str, tmp_path: Path) -> None:
    fetch(hub, "org/quantized", None, tmp_path)
    assert tree(tmp_path) == {"model-q4.gguf": b"GGUF q4"}


def test_a_truncated_body_is_an_error(hub_root: Path, tmp_path: Path) -> None:
    with hub_server(hub_root, truncate={"model.safetensors"}) as cutting:
        with pytest.raises(SourceError) as caught:
            fetch(cutting, "org/tiny", "v2", tmp_path)
    assert str(caught.value).startswith("hub repository org/tiny@v2: model.safetensors: download truncated or "
                                        "incomplete")


def test_a_body_shorter_than_the_listing_is_an_error(hub_root: Path, tmp_path: Path) -> None:
    with hub_server(hub_root, short={"model.safetensors"}) as shortening:
        with pytest.raises(SourceError) as caught:
            fetch(shortening, "org/tiny", None, tmp_path)
    size = len(WEIGHTS)
    assert str(caught.value) == f"hub repository org/tiny: model.safetensors truncated: got {size // 2} of {size} bytes"


def test_an_unreachable_endpoint_names_hf_endpoint(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(SourceError) as caught:
        fetch(endpoint, "org/tiny", None, tmp_path)
    assert str(caught.value).startswith(f"cannot reach the hub at {endpoint} (set HF_ENDPOINT or use a local folder)")


def test_safetensors_win_over_gguf_and_pickle() -> None:
    names = ["config.json", "model.gguf", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "run.py", "original/x.pth"]
    assert select_files("r", names, allow_unsafe=True) == [
        "chat_template.jinja", "config.json", "merges.txt", "model.safetensors", "model.safetensors.index.json",
        "tokenizer.model", "vocab.json"]


def test_a_listed_name_leaving_the_folder_is_refused() -> None:
    with pytest.raises(SourceError, match=r"refusing the file name '\.\./model\.safetensors'"):
        select_files("r", ["config.json", "../model.safetensors"], allow_unsafe=False)
