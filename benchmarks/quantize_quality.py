"""Quality of ``option.quantize`` on a real model: perplexity on real English text, fp32 vs int8 vs int4.

The text is the license texts every Debian machine carries (``/usr/share/common-licenses``: Apache-2.0, GPL-3,
...), tokenized with the model's tokenizer and scored in windows of ``--window`` tokens (each window's first
token unscored), the same windows for every mode. The quantized modes run the kernel the server runs
(``handlers.engine.execution.kernels.quantize``); the model's logits come from transformers' forward, so only the
weights differ.

    python benchmarks/quantize_quality.py                       # SmolLM2-135M-Instruct (tests/real_model.py)
    python benchmarks/quantize_quality.py --model DIR --tokens 8192 --mode int4:64
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from handlers.engine.execution.kernels.quantize import quantize_linears  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("Apache-2.0", "GPL-3", "LGPL-3", "MPL-2.0", "Artistic")


def text_ids(tokenizer: object, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of the license texts found, in TEXTS order."""
    ids: list[int] = []
    for name in TEXTS:
        path = LICENSES / name
        if path.is_file():
            ids += tokenizer(path.read_text(errors="replace"))["input_ids"]  # type: ignore[operator]
        if len(ids) >= tokens:
            return ids[:tokens]
    raise SystemExit(f"only {len(ids)} tokens of text in {LICENSES}; ask for fewer with --tokens")


def perplexity(model: torch.nn.Module, ids: list[int], window: int) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
    return math.exp(total / count)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a transformers folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--mode", action="append", default=[], metavar="MODE[:GROUP]",
                    help="none, int8, int4 or int4:GROUP (repeatable; default none, int8, int4:32, int4:64)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model
    if folder is None:
        from tests.real_model import smollm2_folder

        folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = text_ids(tokenizer, args.tokens)
    results = []
    for spec in args.mode or ["none", "int8", "int4:32", "int4:64"]:
        mode, _, group = spec.partition(":")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if mode != "none":
            quantize_linears(model, mode, int(group or 32))
        start = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        results.append({"mode": spec, "perplexity": round(ppl, 4), "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(results[-1]), flush=True)
    base = next((r["perplexity"] for r in results if r["mode"] == "none"), None)
    print(f"\n{folder.name}: {len(ids)} tokens of {', '.join(TEXTS)} (in that order), windows of {args.window}")
    print("| mode | perplexity | vs fp32 |\n|---|---|---|")
    for r in results:
        ratio = f"{(r['perplexity'] / base - 1) * 100:+.2f}%" if base else "-"
        print(f"| {'fp32' if r['mode'] == 'none' else r['mode']} | {r['perplexity']:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
