"""Turn a GGUF file into a model folder the engine loads: ``python -m handlers.gguf_convert FILE OUT``.

Design note: transformers reads GGUF (llama.cpp's format: weights, often quantized, plus the tokenizer and chat
template) and dequantizes it to a plain model; this writes that model as safetensors with its tokenizer, config
and generation config, so the rolling engine, the memory preflight and every worker read an ordinary folder.
It runs in a process of its own because the frontend never imports torch (``serving.sources`` starts it once
per file and caches the folder by the file's digest). An architecture or quantization type transformers cannot
read exits 2 with transformers' own message on the last line of stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses the file's metadata (a vocabulary of strings) for the tokenizer, the config and the
    weights, and builds the tensor-name map once per module of the model: both are pure functions of their
    arguments, so each is computed once here (most of a conversion's time otherwise)."""
    import gguf as gguf_py

    reader, name_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    gguf_py.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf_py.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, name_map


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; transformers still marks the model as a GGUF one and refuses to save it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    try:
        convert(args.gguf, args.out)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        print(f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
