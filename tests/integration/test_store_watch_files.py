"""The watched model store never loads a folder half-way, whatever kind of file is still being copied: a GGUF
file, a ``torch.save`` checkpoint (``pytorch_model.bin``) and a tokenizer, each written in pieces with a stall
longer than the quiet period in the middle (the case the quiet period alone cannot catch). Every wait is on the
state the server reports; the pieces are paced, as a slow copy is."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess, greedy_references, write_model
from tests.integration.store_models import ECHO, NEW_TOKENS, PROMPT, TINY, greedy, state

QUIET_S = 1.0
GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-Q4_0.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The tiny Llama with its weights in ``torch.save``'s format, and its greedy tokens."""
    from handlers.synthetic_model import build_model

    folder = build_model(tmp_path_factory.mktemp("weights") / "tiny", size="tiny", seed=0)
    reference = greedy_references([PROMPT], NEW_TOKENS, model_dir=folder)[PROMPT]
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")  # what transformers reads
    (folder / "model.safetensors").unlink()
    return folder, reference


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("watched")
    write_model(workdir / "model_store", "anchor", ECHO)  # the server reports ready once a model is
    s = ServerProcess.start(workdir, config={"model_store_watch": "true"})
    yield s
    s.stop()


def copy_slowly(server: ServerProcess, name: str, properties: dict[str, str], whole: dict[str, bytes],
                slow: str, data: bytes) -> None:
    """``serving.properties`` and the ``whole`` files first, then ``slow`` in 16 pieces with a stall of 2.5 quiet
    periods half-way; asserts the model was never registered while it was being written."""
    folder = server.workdir / "model_store" / name
    folder.mkdir()
    seen: list[str | None] = []
    writing = threading.Event()
    writing.set()

    def watch() -> None:
        while writing.is_set():
            seen.append(state(server, name))
            time.sleep(0.05)

    monitor = threading.Thread(target=watch, daemon=True)
    monitor.start()
    (folder / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    for file, content in whole.items():
        (folder / file).write_bytes(content)
    pieces = 16
    with open(folder / slow, "wb") as out:
        for i in range(pieces):
            out.write(data[i * len(data) // pieces:(i + 1) * len(data) // pieces])
            out.flush()
            time.sleep(2.5 * QUIET_S if i == pieces // 2 else 0.1)
    writing.clear()
    monitor.join(10)
    assert seen and set(seen) == {None}, sorted(set(map(str, seen)))
    wait_for(lambda: state(server, name) in ("READY", "FAILED"), f"{name} loaded", 120, step_s=0.05)
    assert state(server, name) == "READY", server.log()[-3000:]
    assert f"{name} is not settled: files not whole yet ({slow})" in server.log()


def files_of(folder: Path, *skip: str) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir()
            if f.is_file() and f.name not in skip and f.name != "serving.properties"}


def test_a_gguf_file_still_being_copied_never_loads_half_way(server: ServerProcess) -> None:
    file = server.workdir / "model_store" / "gguf" / "tiny-Q4_0.gguf"
    copy_slowly(server, "gguf", {**TINY, "option.model_id": str(file)}, {}, file.name, GGUF.read_bytes())
    assert len(greedy(server, "/predictions/gguf")) == NEW_TOKENS


def test_a_torch_save_checkpoint_still_being_copied_never_loads_half_way(
        server: ServerProcess, tiny: tuple[Path, list[int]]) -> None:
    folder, reference = tiny
    properties = {**TINY, "option.allow_unsafe_weights": "true"}
    copy_slowly(server, "pickled", properties, files_of(folder, "pytorch_model.bin"), "pytorch_model.bin",
                (folder / "pytorch_model.bin").read_bytes())
    assert greedy(server, "/predictions/pickled") == reference


def test_a_tokenizer_still_being_copied_never_loads_half_way(
        server: ServerProcess, tiny: tuple[Path, list[int]]) -> None:
    folder, reference = tiny
    properties = {**TINY, "option.allow_unsafe_weights": "true"}
    copy_slowly(server, "tokens", properties, files_of(folder, "tokenizer.json"), "tokenizer.json",
                (folder / "tokenizer.json").read_bytes())
    assert greedy(server, "/predictions/tokens") == reference
