"""The 7B-layout GGUF files of the quantized benchmarks: Llama-2-7B's shapes (32 layers, hidden 4096, 32 heads,
intermediate 11008, vocab 32000) with random weights, written as F16 by the ``gguf`` package tensor by tensor
(``tests/data/gguf/make_files.py``'s writer), then quantized to Q4_0 and Q4_K_M by llama.cpp's own quantizer. Into
``~/.cache/rollserve/bench-models`` (about 21 GB with the F16 source, which is removed after), never committed.
Run it in the environment that has ``gguf`` and ``llama-cpp-python`` (llama.cpp's server's):

    ../llama-venv/bin/python benchmarks/make_7b_gguf.py            # about 10 minutes on 2 cores
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = Path.home() / ".cache" / "rollserve" / "bench-models"
TYPES = {"Q4_0": 2, "Q4_K_M": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_* values


def main() -> None:
    source_file = HERE.parent / "tests" / "data" / "gguf" / "make_files.py"
    spec = importlib.util.spec_from_file_location("make_files", source_file)
    assert spec and spec.loader
    make_files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_files)
    OUT.mkdir(parents=True, exist_ok=True)
    source = OUT / "llama2-7b-layout-F16.gguf"
    wanted = [OUT / f"llama2-7b-layout-{name}.gguf" for name in TYPES]
    if all(p.is_file() for p in wanted):
        print("\n".join(str(p) for p in wanted))
        return
    if not source.is_file():
        part = source.with_suffix(".part")
        make_files.write_llama(part, hidden=4096, heads=32, kv_heads=32, ffn=11008, layers=32, vocab=32000, half=True)
        part.replace(source)
    for ftype, dest in zip(TYPES.values(), wanted, strict=True):
        if not dest.is_file():
            part = dest.with_suffix(".part")
            make_files.quantize(source, part, ftype)
            part.replace(dest)
    source.unlink()
    print("\n".join(str(p) for p in wanted))


if __name__ == "__main__":
    sys.exit(main())
