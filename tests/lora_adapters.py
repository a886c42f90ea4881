"""LoRA adapters for the real SmolLM2-135M-Instruct, built with ``peft`` (random A and B, seeded), and peft's own
answers to compare with: the merged model's greedy ``generate``.

``model_with_adapters(root)`` is a model folder (the real model's files linked) with ``adapters/terse`` (rank 8)
and ``adapters/verbose`` (rank 16); ``merged_greedy`` answers a prompt with the base weights plus one adapter
merged in (``merge_and_unload``), fp32, one prompt at a time.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from tests.real_model import smollm2_folder

ADAPTERS = {"terse": (8, 1), "verbose": (16, 2)}  # name -> (rank, seed)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base() -> object:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()


def build_adapter(out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for the real model: A and B drawn at random (``init_lora_weights=False``), seeded."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(_base(), config)  # type: ignore[arg-type]
    model.save_pretrained(out)
    return out


def model_with_adapters(root: Path) -> Path:
    """``root/smollm2``: the real model's files linked, plus ``adapters/terse`` and ``adapters/verbose``."""
    folder = root / "smollm2"
    if (folder / "adapters" / "verbose").is_dir():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in smollm2_folder().iterdir():
        if f.is_file() and not (folder / f.name).exists():
            os.symlink(f, folder / f.name)
    for name, (rank, seed) in ADAPTERS.items():
        build_adapter(folder / "adapters" / name, rank, seed)
    return folder


@cache
def _merged(adapter_dir: str | None) -> object:
    from peft import PeftModel

    base = _base()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()  # type: ignore[arg-type]


def merged_greedy(folder: Path, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """peft's answer: greedy ``generate`` of the base model with ``adapter`` merged in (None: the base)."""
    return list(_generate(str(folder / "adapters" / adapter) if adapter else None, tuple(prompt_ids), max_new_tokens))


@cache
def _generate(adapter_dir: str | None, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    model = _merged(adapter_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,  # type: ignore[attr-defined]
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(prompt_ids):].tolist())
