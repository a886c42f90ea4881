"""What a GGUF file costs in memory, from its header alone (torch-free, numpy-free): the tensors' names, shapes and
types, and the bytes each takes in the form the engine serves it (``handlers.engine.execution.weights.gguf_blocks``).

Design note (why not gguf's reader: it parses every metadata value, a vocabulary of 50k strings, in seconds and
~150 MB of Python objects): the header is walked with ``struct``, values skipped by their sizes, and each tensor's
place in the file kept so the loader maps just its bytes; the end of the last tensor's data is checked
against the file's size, so a truncated download is refused here, naming the file, before anything loads.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rollcore.errors import ConfigError

# type id -> (name, elements per block, bytes per block, kernel bits, kernel group, a minimum per group)
GGML_TYPES: dict[int, tuple[str, int, int, int, int, bool]] = {
    0: ("F32", 1, 4, 8, 0, False), 1: ("F16", 1, 2, 8, 0, False), 30: ("BF16", 1, 2, 8, 0, False),
    2: ("Q4_0", 32, 18, 4, 32, True), 3: ("Q4_1", 32, 20, 4, 32, True), 6: ("Q5_0", 32, 22, 8, 32, False),
    7: ("Q5_1", 32, 24, 8, 32, True), 8: ("Q8_0", 32, 34, 8, 32, False), 10: ("Q2_K", 256, 84, 4, 16, True),
    11: ("Q3_K", 256, 110, 4, 16, True), 12: ("Q4_K", 256, 144, 4, 32, True), 13: ("Q5_K", 256, 176, 8, 32, True),
    14: ("Q6_K", 256, 210, 8, 16, False),
}
# every type's scales and minimums are served as fp16 (int_weights.pack): the legacy types' are the file's own
# fp16 values, exactly; the K-quants' products of two scales are rounded to fp16
# names of the types this server does not load, for the message that refuses them
_OTHER_TYPES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
                21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
                29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_NUMBER = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# config.json's names for an architecture's GGUF keys (``{arch}.block_count`` ...), what the memory plan reads
_CONFIG_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
                "attention.key_length": "head_dim"}
_STRING, _ARRAY = 8, 9


class GGUFFileError(ConfigError):
    """A GGUF file whose header cannot be served; the message names the file, never its path."""

    unsupported = False  # the file may be whole: it holds a tensor type this server does not load


class UnsupportedGGUFType(GGUFFileError):
    unsupported = True


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ggml order: the contiguous dimension first
    offset: int = 0  # where its data starts in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, (_OTHER_TYPES.get(self.type_id, f"type {self.type_id}"),))[0]

    def file_bytes(self) -> int:
        _, per_block, size, *_ = GGML_TYPES[self.type_id]
        return self.numel // per_block * size

    def served_bytes(self) -> int:
        """Bytes in the engine: integers and scales (and minimums) per group; F16/BF16/F32 matrices as int8 per
        row, 1-D tensors (norms, biases) as fp32."""
        _, _, _, bits, group, has_min = GGML_TYPES[self.type_id]
        if len(self.shape) == 1:
            return 4 * self.numel
        rows = -(-(self.numel // self.shape[0]) // 16) * 16  # the kernel's blocks of 16 rows
        numel = rows * self.shape[0]
        if group == 0:
            return numel + 4 * rows
        return numel * bits // 8 + (numel // group) * 2 * (1 + has_min)


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    tensors: tuple[GGUFTensor, ...]
    file_bytes: int
    numbers: dict[str, float] = field(default_factory=dict)  # the metadata's scalar numbers, by key

    def model_config(self) -> dict[str, object]:
        """What the memory plan reads of a ``config.json``, from the header: a file not yet given a folder
        (``serving config`` on ``option.model_id=FILE.gguf``) is planned as its worker will plan it."""
        out: dict[str, object] = {"model_type": self.architecture, "dtype": "float32"}
        for key, name in _CONFIG_KEYS.items():
            value = self.numbers.get(f"{self.architecture}.{key}")
            if value is not None:
                out[name] = int(value)
        embed = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        if embed is not None and len(embed.shape) == 2:
            out["vocab_size"] = embed.shape[1]
        out["tie_word_embeddings"] = not any(t.name == "output.weight" for t in self.tensors)
        return out

    def types(self) -> dict[str, int]:
        """Type name -> how many tensors of it."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out

    def served_bytes(self) -> int:
        return sum(t.served_bytes() for t in self.tensors)


def _read(f: BinaryIO, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise EOFError
    return struct.unpack(fmt, raw)


def _string(f: BinaryIO) -> bytes:
    (n,) = _read(f, "<Q")
    raw = f.read(n)
    if len(raw) != n:
        raise EOFError
    return raw


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        _string(f)
    elif kind == _ARRAY:
        inner, count = _read(f, "<IQ")
        if inner in _SCALAR:
            f.seek(_SCALAR[inner] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, inner)
    elif kind in _SCALAR:
        f.seek(_SCALAR[kind], 1)
    else:
        raise ValueError(f"metadata value type {kind}")


def read_header(path: Path, size: int | None = None) -> GGUFHeader:
    """The tensors and architecture of a GGUF file; raises ``GGUFFileError`` (naming the file) for a file that is
    not GGUF, is truncated, or holds a tensor type this server does not load. ``size``: the whole file's, when
    ``path`` holds only its beginning (a remote file's header, read by range)."""
    size = path.stat().st_size if size is None else size
    try:
        with path.open("rb") as f:
            magic, version = _read(f, "<4sI")
            if magic != b"GGUF" or version not in (2, 3):
                raise GGUFFileError(f"{path.name} is not a GGUF file (version 2 or 3)")
            n_tensors, n_kv = _read(f, "<QQ")
            arch, alignment, numbers = "", 32, {}
            for _ in range(n_kv):
                key = _string(f).decode(errors="replace")
                (kind,) = _read(f, "<I")
                if key == "general.architecture" and kind == _STRING:
                    arch = _string(f).decode(errors="replace")
                elif kind in _NUMBER:
                    (numbers[key],) = _read(f, _NUMBER[kind])
                else:
                    _skip_value(f, kind)
            alignment = int(numbers.get("general.alignment", alignment))
            found, ends = [], 0
            for _ in range(n_tensors):
                name = _string(f).decode(errors="replace")
                (dims,) = _read(f, "<I")
                shape = _read(f, f"<{dims}Q")
                kind, offset = _read(f, "<IQ")
                tensor = GGUFTensor(name, kind, tuple(int(d) for d in shape))
                if kind not in GGML_TYPES:
                    loads = ", ".join(t[0] for t in GGML_TYPES.values())
                    raise UnsupportedGGUFType(f"GGUF file {path.name}: tensor {name} is {tensor.type_name}, which this "
                                        f"server does not load (it loads {loads})")
                found.append((tensor, offset))
                ends = max(ends, offset + tensor.file_bytes())
            data_start = -(-f.tell() // alignment) * alignment
            tensors = [GGUFTensor(t.name, t.type_id, t.shape, data_start + offset) for t, offset in found]
    except GGUFFileError:
        raise
    except (EOFError, ValueError, struct.error, MemoryError) as exc:
        detail = str(exc) or "it ends early"  # an EOFError has no text: say what it means
        raise GGUFFileError(f"GGUF file {path.name}: its header is truncated or corrupt ({detail})") from None
    if data_start + ends > size:
        raise GGUFFileError(f"GGUF file {path.name} is truncated: its tensors need {data_start + ends} bytes, the "
                            f"file has {size}")
    return GGUFHeader(arch, tuple(tensors), size, numbers)


def whole_gguf(path: Path) -> bool:
    """False while a GGUF file is shorter than its header says (or its header is still being written): the watched
    store's test for a copy in progress. A whole file of a type this server does not load counts as whole (its load
    then fails, naming the type)."""
    try:
        read_header(path)
    except GGUFFileError as exc:
        return exc.unsupported
    except OSError:
        return False
    return True


def gguf_file_in(folder: Path) -> Path | None:
    """The GGUF file a model folder is served from (a resolved source: config, tokenizer and one ``*.gguf``, no
    safetensors), or the path itself when it is a ``.gguf`` file; else None."""
    folder = Path(folder)
    if folder.is_file():
        return folder if folder.suffix.lower() == ".gguf" else None
    if any(folder.glob("*.safetensors")):
        return None
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None
