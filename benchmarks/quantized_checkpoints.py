"""Perplexity of quantized checkpoints (compressed-tensors W8A16 / W4A16, GPTQ, AWQ) as rollserve serves them
(``handlers.engine.execution.weights.quant_ckpt_load``), against the float model they were made from.

The checkpoints are made from the float SmolLM2-135M-Instruct folder (``tests.real_model.smollm2_folder``) as the
tests make them: compressed-tensors by its own library with min-max scales; GPTQ and AWQ packed by auto-round's
exporters' layers with min-max (round-to-nearest) scales and zero points, no calibration, so these figures measure
the formats and the loader, not those algorithms. (The float folder is itself the Q4_1 GGUF file dequantized: its
weights lie on a 4-bit grid of groups of 32 with a float minimum, which ``option.quantize=int4`` keeps and the
formats' integer zero points do not.) ``option.quantize=int8|int4`` on the float checkpoint (quantized while
loading) is measured alongside. Text and windows: ``benchmarks/gguf_perplexity.py``'s (the license texts).
``--checkpoint DIR`` (repeated) measures checkpoint folders made elsewhere too, such as the calibrated GPTQ ones of
``benchmarks/calibrated_checkpoints.py`` (llm-compressor, in its own virtualenv); ``--only-given`` skips the
uncalibrated ones made here.

    .venv/bin/python benchmarks/quantized_checkpoints.py --windows 8 --window 512
    .venv/bin/python benchmarks/quantized_checkpoints.py --only-given \
        --checkpoint ~/.cache/rollserve/bench-models/calibrated/gptq-w4a16-g32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--activations", default="fp32", choices=("fp32", "int8", "int8x2", "auto"))
    ap.add_argument("--checkpoint", type=Path, action="append", default=[],
                    help="a quantized checkpoint folder made elsewhere (repeatable); named by its folder")
    ap.add_argument("--only-given", action="store_true", help="measure fp32 and the --checkpoint folders only")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from benchmarks.gguf_perplexity import perplexity, windows
    from handlers.engine.execution.weights.quant_ckpt_load import load_quantized_checkpoint, load_quantizing
    from handlers.engine.planning.quant_config import parse_checkpoint_quant
    from tests.engine.test_quantized_checkpoints import (
        build_compressed_tensors,
        build_gptq_or_awq,
        copy_folder_files,
        fp32_model,
    )
    from tests.real_model import smollm2_folder

    torch.set_num_threads(2)
    source = smollm2_folder()
    chunks = windows(AutoTokenizer.from_pretrained(source), args.window, args.windows)
    base = fp32_model()
    result = {"fp32 (transformers)": perplexity(base, chunks)}
    for folder in args.checkpoint:
        quant = parse_checkpoint_quant(json.loads((folder / "config.json").read_text()))
        if quant is None:
            raise SystemExit(f"{folder}: config.json has no quantization_config this server loads as integers")
        result[f"{folder.name} ({quant.describe})"] = perplexity(
            load_quantized_checkpoint(folder, quant, args.activations), chunks)
    for mode in ("int8", "int4") if not args.only_given else ():
        result[f"option.quantize={mode} (while loading)"] = perplexity(
            load_quantizing(source, mode, 32, "fp32" if args.activations == "auto" else args.activations), chunks)
    with tempfile.TemporaryDirectory() as tmp:
        made: dict[str, Path] = {}
        if args.only_given:
            return _report(result, chunks, args)
        for name, (bits, group, symmetric) in {"compressed-tensors W8A16 per channel": (8, 0, True),
                                               "compressed-tensors W4A16 group 32": (4, 32, True),
                                               "compressed-tensors W4A16 group 32 asym": (4, 32, False),
                                               "compressed-tensors W4A16 group 64 asym": (4, 64, False)}.items():
            made[name] = Path(tmp) / f"ct{len(made)}"
            build_compressed_tensors(base, made[name], bits, group, symmetric)
        for method in ("gptq", "awq"):
            made[f"{method.upper()} 4-bit group 64"] = Path(tmp) / method
            build_gptq_or_awq(base, Path(tmp) / method, method)
        for name, folder in made.items():
            copy_folder_files(source, folder)
            quant = parse_checkpoint_quant(json.loads((folder / "config.json").read_text()))
            assert quant is not None
            result[name] = perplexity(load_quantized_checkpoint(folder, quant, args.activations), chunks)
    _report(result, chunks, args)


def _report(result: dict[str, float], chunks: list[list[int]], args: argparse.Namespace) -> None:
    fp32 = result["fp32 (transformers)"]
    print(f"SmolLM2-135M-Instruct: {len(chunks)} windows of {args.window} tokens, {args.activations} activations")
    for name, ppl in result.items():
        print(f"  {name:60s} {ppl:8.4f}  ({ppl / fp32 - 1:+.2%} vs fp32)")


if __name__ == "__main__":
    main()
