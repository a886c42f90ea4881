"""Perplexity of a GGUF file as rollserve serves it against llama.cpp's own on the same file and the same tokens.

Text: the license texts in /usr/share/common-licenses (real English), tokenized once by the file's tokenizer (as
rollserve reads it), cut into windows of ``--window`` tokens; each window is scored from its first token (the
same windows and ids for both). rollserve: ``handlers.engine.execution.weights.gguf_load`` (the file's blocks as served,
fp32, int8 or int8x2 activations) and, as the float reference, transformers' dequantization of the file. llama.cpp:
``Llama(model, logits_all=True)`` in its own virtualenv (``--llama-python``), fed the same ids.

    .venv/bin/python benchmarks/gguf_perplexity.py                      # SmolLM2-135M-Instruct Q4_1, 16 windows
    .venv/bin/python benchmarks/gguf_perplexity.py --gguf FILE --windows 8 --window 512
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_LLAMA = """
import json, math, sys
import numpy as np
from llama_cpp import Llama
path, windows = sys.argv[1], json.load(open(sys.argv[2]))
llm = Llama(model_path=path, n_ctx=max(len(w) for w in windows), logits_all=True, n_threads=2, verbose=False)
total, count = 0.0, 0
for ids in windows:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    total -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
    count += len(ids) - 1
print(json.dumps({"nll": total, "tokens": count}))
"""


def windows(tokenizer: object, size: int, count: int) -> list[list[int]]:
    text = "\n\n".join(p.read_text(errors="replace") for p in sorted(Path("/usr/share/common-licenses").iterdir())
                       if p.is_file())
    ids = tokenizer(text)["input_ids"]  # type: ignore[operator]
    return [ids[i * size:(i + 1) * size] for i in range(min(count, len(ids) // size))]


def perplexity(model: object, chunks: list[list[int]]) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in chunks:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()  # type: ignore[operator]
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--llama-python", type=Path, default=REPO.parent / "llama-venv" / "bin" / "python")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from handlers.engine.execution.kernels.quantize import QuantizedLinear
    from handlers.engine.execution.weights.gguf_load import load_gguf_model
    from handlers.gguf_folder import write_folder
    from tests.real_model import smollm2_gguf

    gguf = (args.gguf or smollm2_gguf()).resolve()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        write_folder(gguf, folder)
        chunks = windows(AutoTokenizer.from_pretrained(folder), args.window, args.windows)
        result: dict[str, float] = {}
        model = load_gguf_model(folder, folder / "model.gguf", "auto", 32)
        for mode in ("fp32", "int8", "int8x2"):
            on = [m.use_activations(mode) for m in model.modules() if isinstance(m, QuantizedLinear)]
            if mode not in on:
                continue
            result[f"rollserve, {mode} activations"] = perplexity(model, chunks)
        del model
        reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()
        result["transformers, dequantized fp32"] = perplexity(reference, chunks)
        del reference
        ids = Path(tmp) / "ids.json"
        ids.write_text(json.dumps(chunks))
        done = subprocess.run([str(args.llama_python), "-c", _LLAMA, str(gguf), str(ids)], capture_output=True,
                              text=True, timeout=3600)
        if done.returncode == 0:
            got = json.loads(done.stdout.strip().splitlines()[-1])
            result["llama.cpp"] = math.exp(got["nll"] / got["tokens"])
        else:
            print(f"llama.cpp failed: {done.stderr[-800:]}", file=sys.stderr)
    base = result.get("llama.cpp")
    print(f"{gguf.name}: {len(chunks)} windows of {args.window} tokens ({len(chunks) * (args.window - 1)} scored)")
    for name, ppl in result.items():
        print(f"  {name:34s} {ppl:8.4f}" + (f"  ({ppl / base - 1:+.2%} vs llama.cpp)" if base else ""))


if __name__ == "__main__":
    main()
