"""The model folder of a GGUF file: ``python -m handlers.gguf_folder FILE OUT``.

Design note: the engine serves a GGUF file's weights as the file holds them (``handlers.engine.execution.
gguf_load``); what it needs beside them in transformers' form (the config, the tokenizer with its chat template
and special tokens, the generation config) is read from the file's metadata here, once per file, and written
with a link to the file (``model.gguf``): no weight is read. It runs in a process of its own because the frontend
never imports torch (``serving.sources`` starts it once per file and caches the folder by the file's digest). A
file whose architecture or tensor types the engine does not load, or that is truncated, exits 2 with the reason
on the last line of stderr, naming the file by its name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def write_folder(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from handlers.engine.planning.gguf_plan import read_header

    read_header(gguf)  # truncated, corrupt, or a tensor type the engine does not load: refused here, by name
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):  # transformers marks it GGUF; the engine reads the file itself
        delattr(config, "quantization_config")
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    link = out / "model.gguf"
    try:
        os.link(gguf, link)  # the same file, no copy, and no dangling link if the source cache is cleaned
    except OSError:
        link.symlink_to(gguf.resolve())


def write_fp32_folder(gguf: Path, out: Path) -> None:
    """The fp32 detour, for whoever asks for it (tools, the tests' float twin of a file): transformers dequantizes
    the whole file and the folder holds it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # transformers marks a GGUF model and refuses to save it otherwise
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--fp32", action="store_true", help="write the weights dequantized to fp32 safetensors instead")
    args = ap.parse_args(argv)
    try:
        (write_fp32_folder if args.fp32 else write_folder)(args.gguf, args.out)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        message = ' '.join(str(exc).split()).replace(str(args.gguf.parent) + os.sep, "")
        print(f"{type(exc).__name__}: {message[:500]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
