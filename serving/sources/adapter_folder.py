"""What makes a folder a LoRA adapter the server can hand to its workers: PEFT's ``adapter_config.json`` (a LoRA
config) and ``adapter_model.safetensors`` (a readable safetensors file).

Design note: checked in the frontend, without torch, so a worker never gets a folder that is not an adapter (a
model folder, a half-copied prefix, pickle weights). A remote source is checked twice: from its listing, before
anything is downloaded (only the two files are fetched), and the local folder after. The engine still refuses what
it cannot serve (a rank above ``option.max_lora_rank``, DoRA, biases) when it reads the weights. Messages name
files by their name only: they reach API clients.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

from serving.sources.source_error import SourceError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FILES = (CONFIG, WEIGHTS)
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_LAYOUT = f"PEFT's save_pretrained writes {CONFIG} and {WEIGHTS}"


def check_listing(label: str, names: Sequence[str]) -> list[str]:
    """The adapter's files among a remote source's ``names`` (paths relative to it); a SourceError naming what
    is missing when the source is not a LoRA adapter."""
    missing = [n for n in FILES if n not in names]
    if missing:
        held = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "")
        pickle = " (only pickle weights: adapter_model.bin is not served)" if "adapter_model.bin" in names else ""
        raise SourceError(f"{label} is not a LoRA adapter: no {' and no '.join(missing)}{pickle} ({_LAYOUT}); "
                          f"it holds: {held or 'nothing'}")
    return list(FILES)


def check_folder(folder: Path, label: str) -> None:
    """A SourceError naming the file and the reason unless ``folder`` holds a LoRA adapter's config and readable
    safetensors weights."""
    config_path, weights = folder / CONFIG, folder / WEIGHTS
    if not config_path.is_file():
        raise SourceError(f"{label} is not a LoRA adapter: no {CONFIG} ({_LAYOUT})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SourceError(f"{label}: {CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SourceError(f"{label}: {CONFIG} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise SourceError(f"{label}: {CONFIG} has peft_type {config.get('peft_type')!r}: only LORA adapters are "
                          "served")
    if not weights.is_file():
        pickle = " (adapter_model.bin is pickle, not served)" if (folder / "adapter_model.bin").is_file() else ""
        raise SourceError(f"{label} is not a LoRA adapter: no {WEIGHTS}{pickle} ({_LAYOUT})")
    _check_safetensors(weights, label)


def _check_safetensors(path: Path, label: str) -> None:
    """The file's header (a little-endian length, then JSON) is readable and its tensors lie inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > min(_MAX_HEADER, size - 8):
            raise SourceError(f"{label}: {WEIGHTS} is not a safetensors file ({size} bytes, no readable header)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            raise SourceError(f"{label}: {WEIGHTS} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SourceError(f"{label}: {WEIGHTS} is not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    ends = [v.get("data_offsets", [0, 0])[1] for v in tensors.values() if isinstance(v, dict)]
    if not tensors or len(ends) != len(tensors) or not all(isinstance(e, int) for e in ends):
        raise SourceError(f"{label}: {WEIGHTS} holds no tensors or an unreadable tensor entry")
    if max(ends) > size - 8 - n:
        raise SourceError(f"{label}: {WEIGHTS} is truncated: its tensors need {8 + n + max(ends)} bytes, the file "
                          f"has {size}")
