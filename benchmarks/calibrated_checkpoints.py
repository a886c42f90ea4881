"""Calibrated quantized checkpoints of the float SmolLM2-135M-Instruct folder, made by llm-compressor itself
(``oneshot`` with its ``GPTQModifier``), saved as compressed-tensors ``pack-quantized`` folders: the checkpoints
a vLLM/LMI user downloads, for ``quantized_checkpoints.py --checkpoint DIR`` to measure.

Calibration text: the Python language reference that every CPython ships (``pydoc_data.topics``), never the
license texts the perplexity is measured on; cut into ``--samples`` windows of ``--length`` tokens. llm-compressor
pins its own compressed-tensors and transformers, so this runs in a virtualenv of its own with the CPU torch:

    python3 -m venv ../llmc-venv && ../llmc-venv/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0
    ../llmc-venv/bin/python benchmarks/calibrated_checkpoints.py --out ~/.cache/rollserve/bench-models/calibrated
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name -> (bits, group (0: per output channel), symmetric)
# (the preset W4A16's groups of 128 divide neither SmolLM2's 576 inputs: llm-compressor refuses them by name)
SCHEMES = {"gptq-w4a16-g32": (4, 32, True), "gptq-w8a16-channel": (8, 0, True), "gptq-w4a16-g64-asym": (4, 64, False),
           "gptq-w4a16-g64": (4, 64, True), "gptq-w4a16-g32-asym": (4, 32, False), "gptq-w4a16-g128": (4, 128, True)}


def calibration_windows(tokenizer: object, length: int, count: int) -> list[list[int]]:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text)["input_ids"]  # type: ignore[operator]
    if len(ids) < length * count:
        raise SystemExit(f"the calibration text has {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def make(source: Path, out: Path, bits: int, group: int, symmetric: bool, chunks: list[list[int]],
         batch: int) -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                               strategy="group" if group else "channel", group_size=group or None)
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head"])
    dataset = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks]})
    oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(chunks),
            max_seq_length=len(chunks[0]), shuffle_calibration_samples=False, batch_size=batch)
    model.save_pretrained(out, save_compressed=True)
    for path in source.iterdir():  # the tokenizer and chat template, as the float folder has them
        if path.suffix != ".safetensors" and not (out / path.name).exists():
            shutil.copy(path, out / path.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="a folder per scheme is made in it")
    ap.add_argument("--source", type=Path, default=None, help="the float folder (default: the tests' SmolLM2)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"of {', '.join(SCHEMES)}")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="calibration windows a forward pass")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    if args.source is None:
        from tests.real_model import smollm2_folder

        args.source = smollm2_folder()
    torch.set_num_threads(2)
    chunks = calibration_windows(AutoTokenizer.from_pretrained(args.source), args.length, args.samples)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.schemes.split(","):
        bits, group, symmetric = SCHEMES[name]
        target = args.out / name
        if (target / "config.json").is_file():
            print(f"{name}: {target} (already made)")
            continue
        started = time.monotonic()
        try:
            make(args.source, target, bits, group, symmetric, chunks, args.batch)
        except Exception as exc:  # a scheme the library refuses for this model's shapes: said, and the rest made
            shutil.rmtree(target, ignore_errors=True)
            print(f"{name}: llm-compressor failed: {type(exc).__name__}: {exc}")
            continue
        quant = json.loads((target / "config.json").read_text())["quantization_config"]
        print(f"{name}: {target} in {time.monotonic() - started:.0f} s ({quant['format']}, "
              f"{args.samples} x {args.length} calibration tokens)")


if __name__ == "__main__":
    main()
