"""A text prompt is tokenized once per request, in the frontend: its ids travel to the worker, which does not
tokenize it again (``rollcore.tokenizer_probe``). Every text encoding in the server's processes is counted by
``encode_counter/sitecustomize.py`` on the rolling engine; answers stay those of the text path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess

COUNTER = Path(__file__).resolve().parent / "encode_counter"
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    work = tmp_path_factory.mktemp("encodes")
    log = work / "encodes.log"
    path = os.pathsep.join(p for p in (str(COUNTER), os.environ.get("PYTHONPATH", "")) if p)
    server = ServerProcess.start(work, models={"tiny": {"option.rolling_batch": "auto",
                                                        "minWorkers": "1", "maxWorkers": "1"}},
                                 env={"PYTHONPATH": path, "ROLLSERVE_TEST_ENCODE_LOG": str(log)})
    try:
        yield server, log
    finally:
        server.stop()


def _encodes(log: Path) -> list[tuple[int, int, int]]:
    """(pid, texts, probes) per encoder call so far."""
    return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in log.read_text().splitlines())]


def _post(server: ServerProcess, path: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(server.url + path, json=body, headers=server.inference_headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


ROUTES = [
    ("/predictions/tiny", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}),
    ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                              "temperature": 0}),
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[r[0] for r in ROUTES])
def test_one_request_is_tokenized_once_across_frontend_and_worker(counted: tuple[ServerProcess, Path], path: str,
                                                                  body: dict[str, object]) -> None:
    server, log = counted
    _post(server, path, body)  # the model's text side is built on its first request
    before = len(_encodes(log))
    _post(server, path, body)
    calls = _encodes(log)[before:]
    assert [(pid == server.proc.pid, texts) for pid, texts, _ in calls] == [(True, 1)], calls


def test_the_model_text_side_is_built_once_for_every_route(counted: tuple[ServerProcess, Path]) -> None:
    """The frontend loads a model's tokenizer once (its probe encoded once), whichever routes serve it."""
    server, log = counted
    for path, body in ROUTES:
        _post(server, path, body)
    frontend_probes = sum(p for pid, _, p in _encodes(log) if pid == server.proc.pid)
    assert frontend_probes == 1


def test_the_answer_from_token_ids_is_the_answer_from_text(counted: tuple[ServerProcess, Path]) -> None:
    """The worker's greedy answer to the frontend's ids is its answer to the same prompt given as ids by the client
    (the frontend and worker tokenizers agree: the ids are the worker's own)."""
    server, _ = counted
    ids = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT},
                     headers=server.inference_headers, timeout=60).json()["tokens"]
    by_text = _post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    by_ids = _post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0})
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]  # type: ignore[index]
    assert by_text["usage"] == by_ids["usage"]
