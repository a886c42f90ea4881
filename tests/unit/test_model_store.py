"""The model store's layout (versions, model.properties, whole weights), version references and the default
version, and the metrics' version label. No processes, no sockets."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rollcore.errors import ConfigError, InvalidRequest
from rollcore.types import ModelState
from serving.models.store_layout import incomplete_files, is_versioned, pinned_default, versions_of
from serving.models.versions import ModelVersions, split_ref
from serving.telemetry.metrics import ServingMetrics


def folder(root: Path, name: str, properties: str | None = "engine=Python\n") -> Path:
    d = root / name
    d.mkdir(parents=True)
    if properties is not None:
        (d / "serving.properties").write_text(properties)
    return d


def safetensors(path: Path, data_len: int, written: int | None = None) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_len // 4], "data_offsets": [0, data_len]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0" * data_len
    path.write_bytes(blob if written is None else blob[:written])


def test_a_flat_folder_is_one_version_from_its_version_key(tmp_path: Path) -> None:
    assert versions_of(folder(tmp_path, "plain")) == {"1": tmp_path / "plain"}
    assert versions_of(folder(tmp_path, "v3", "version=03\n")) == {"3": tmp_path / "v3"}
    # a bad value is left to the config loader (it names the file and line)
    assert versions_of(folder(tmp_path, "bad", "version=three\n")) == {"1": tmp_path / "bad"}
    assert versions_of(folder(tmp_path, "none", None), require_properties=True) == {}


def test_digit_sub_folders_are_versions(tmp_path: Path) -> None:
    m = tmp_path / "m"
    for v in ("1", "2", "10"):
        folder(m, v)
    folder(m, "0")  # not a version
    (m / "3").mkdir()  # still being copied: no serving.properties yet
    assert is_versioned(m)
    assert versions_of(m) == {"1": m / "1", "2": m / "2", "3": m / "3", "10": m / "10"}
    assert versions_of(m, require_properties=True) == {"1": m / "1", "2": m / "2", "10": m / "10"}
    (m / "serving.properties").write_text("")  # a folder with its own properties is one version
    assert not is_versioned(m) and versions_of(m) == {"1": m}


def test_model_properties_pins_the_default_and_names_file_and_line(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    assert pinned_default(m) is None
    (m / "model.properties").write_text("# pinned\ndefault_version=2\n")
    assert pinned_default(m) == "2"
    (m / "model.properties").write_text("default_version=latest\n")
    with pytest.raises(ConfigError, match=r"model\.properties:1: default_version = 'latest'"):
        pinned_default(m)
    (m / "model.properties").write_text("\ndefault_versoin=2\n")
    with pytest.raises(ConfigError, match=r"model\.properties:2: default_versoin = '2': unknown key"):
        pinned_default(m)


def test_weights_are_whole_only_when_as_long_as_their_header_says(tmp_path: Path) -> None:
    m = folder(tmp_path, "m")
    assert incomplete_files(m) == []
    safetensors(m / "model.safetensors", 4096, written=5)  # not even the header
    assert incomplete_files(m) == ["model.safetensors"]
    safetensors(m / "model.safetensors", 4096, written=200)  # the header, part of the data
    assert incomplete_files(m) == ["model.safetensors"]
    safetensors(m / "model.safetensors", 4096)
    assert incomplete_files(m) == []
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model.safetensors", "b": "model-2.safetensors"}}))
    assert incomplete_files(m) == ["model-2.safetensors"]


def test_references_and_the_default_version() -> None:
    assert split_ref("m") == ("m", None) and split_ref("m:007") == ("m", "7")
    for bad in ("m:", "m:0", "m:x", "m:1.0", "m:-1"):
        with pytest.raises(InvalidRequest):
            split_ref(bad)
    mv = ModelVersions("m")
    assert mv.default_version() is None
    eps = {v: SimpleNamespace(state=ModelState.READY) for v in ("1", "2", "10")}
    for v, ep in eps.items():
        mv.add(v, ep, Path(v), {})
    assert mv.default_version() == "10"  # numerically highest
    eps["10"].state = ModelState.LOADING
    assert mv.default_version() == "2"  # a loading version does not take the name
    mv.pinned = "1"
    assert mv.default_version() == "1"
    mv.pinned = "9"  # not registered: ignored
    assert mv.default_version() == "2"
    for ep in eps.values():
        ep.state = ModelState.FAILED
    assert mv.default_version() == "10"


def test_each_version_counts_under_its_own_label() -> None:
    scraped = {"load_time_s": None, "pool": None, "batcher": None, "info": {}}  # no workers: what a scrape reads
    eps = {"m": SimpleNamespace(state=ModelState.READY, version="2", **scraped)}
    versions = [("m", "1", SimpleNamespace(state=ModelState.READY, version="1", **scraped)), ("m", "2", eps["m"])]
    m = ServingMetrics(CollectorRegistry(), models=lambda: eps, versions=lambda: versions)
    m.for_version("1").on_batch("m", 3)
    m.for_version("2").on_rejected("m", "queue_full")
    m.record_request("m", 200)  # no version resolved: the default's
    m.record_request("m", 200, "1")
    m.record_request("other", 404)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples[("rollserve_batch_size_sum", (("model", "m"), ("version", "1")))] == 3
    assert samples[("rollserve_requests_rejected_total", (("model", "m"), ("reason", "queue_full"),
                                                          ("version", "2")))] == 1
    assert samples[("rollserve_requests_total", (("model", "m"), ("status_class", "2xx"), ("version", "2")))] == 1
    assert samples[("rollserve_requests_total", (("model", "m"), ("status_class", "2xx"), ("version", "1")))] == 1
    assert samples[("rollserve_requests_total", (("model", "__unknown__"), ("status_class", "4xx"),
                                                 ("version", "")))] == 1
    assert samples[("rollserve_model_state", (("model", "m"), ("state", "READY"), ("version", "1")))] == 1
    assert samples[("rollserve_model_state", (("model", "m"), ("state", "READY"), ("version", "2")))] == 1


GGUF = Path(__file__).resolve().parents[1] / "data" / "gguf" / "tiny-Q4_0.gguf"


def test_gguf_files_are_whole_only_when_as_long_as_their_header_says(tmp_path: Path) -> None:
    m = folder(tmp_path, "m")
    data = GGUF.read_bytes()
    for cut in (3, 64, len(data) // 2, len(data) - 1):  # magic, header, tensor data, the last byte
        (m / "model.gguf").write_bytes(data[:cut])
        assert incomplete_files(m) == ["model.gguf"], cut
    (m / "model.gguf").write_bytes(data)
    assert incomplete_files(m) == []


def test_a_whole_gguf_of_a_type_the_server_does_not_load_is_whole(tmp_path: Path) -> None:
    """Its load fails, naming the type; waiting for it to grow would wait for ever."""
    import gguf
    import numpy as np

    m = folder(tmp_path, "m")
    writer = gguf.GGUFWriter(str(m / "model.gguf"), "llama")
    writer.add_tensor("w", np.zeros((2, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert incomplete_files(m) == []


def test_json_files_are_whole_only_when_they_parse(tmp_path: Path) -> None:
    m = folder(tmp_path, "m")
    text = json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": []})
    (m / "tokenizer.json").write_text(text[: len(text) - 2])
    (m / "adapter_config.json").write_text("")
    assert incomplete_files(m) == ["adapter_config.json", "tokenizer.json"]
    (m / "tokenizer.json").write_text(text)
    (m / "adapter_config.json").write_text('{"r": 8}')
    assert incomplete_files(m) == []


def test_torch_save_archives_are_whole_only_with_their_closing_directory(tmp_path: Path) -> None:
    import torch

    m = folder(tmp_path, "m")
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "whole.bin")
    data = (tmp_path / "whole.bin").read_bytes()
    for cut in (2, 100, len(data) - 10):
        (m / "pytorch_model.bin").write_bytes(data[:cut])
        assert incomplete_files(m) == ["pytorch_model.bin"], cut
    (m / "pytorch_model.bin").write_bytes(data)
    assert incomplete_files(m) == []
