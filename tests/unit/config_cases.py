"""Model folders for the configuration tests: a folder with an optional serving.properties and model.py."""

from __future__ import annotations

from pathlib import Path


def make_model(tmp_path: Path, properties: str | None = None, *, name: str = "m",
               model_py: bool = False) -> Path:
    model_dir = tmp_path / name
    model_dir.mkdir()
    if properties is not None:
        (model_dir / "serving.properties").write_text(properties, encoding="utf-8")
    if model_py:
        (model_dir / "model.py").write_text("def handle(inputs):\n    return None\n")
    return model_dir
