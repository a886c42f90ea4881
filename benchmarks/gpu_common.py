"""What gpu_check.py's sections share: the device and smoke flag its main sets, the table lines it prints and
keeps for ``--out``, and random Llama models built on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from handlers.synthetic_model import build_tokenizer

# set by gpu_check.py's main before any section runs; the sections read them as ``gpu_common.DEV`` / ``.SMOKE``
DEV = torch.device("cuda", 0)
SMOKE = False  # --smoke: tiny models, few requests, on any device (a dry run of the script on CPU)
LINES: list[str] = []


def emit(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def release() -> None:
    """Hand cached device memory back (the next section, or the server's worker, measures what is free)."""
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def build_random(folder: Path, config: Any, tokenizer_vocab: int = 4096) -> None:
    """A random-initialised bf16 model written to ``folder`` (built on the GPU: seconds, not minutes); its
    vocabulary is its tokenizer's, so that every generated token has text to stream."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config.vocab_size = build_tokenizer(folder, tokenizer_vocab, 0)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    del model


def llama_config(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                       max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False)
