"""LoRA adapters with tensor parallelism: the tiny Llama on 2 ranks (its heads and MLP split in two) with two
peft adapters (random A and B, seeded; one from the model folder, one registered at run time) in one slot, so
they wait, swap and refill the slot on both ranks: every request, base or adapted, equals peft's merged model's
greedy ``generate`` token for token, as on one rank (test_lora.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams
from tests.engine.conftest import make_prompts

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 10


def build_adapter(base_dir: Path, out: Path, rank: int, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0,
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def folders(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama's files linked into a folder with ``adapters/left`` (rank 4); ``right`` (rank 8) apart."""
    base = model_dirs["llama"]
    root = tmp_path_factory.mktemp("lora-tp")
    folder = root / "tiny"
    folder.mkdir()
    for f in base.iterdir():
        if f.is_file():
            os.symlink(f, folder / f.name)
    build_adapter(base, folder / "adapters" / "left", 4, 1)
    return folder, build_adapter(base, root / "right", 8, 2)


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    """peft's answer: the base model with ``adapter`` merged in (``merge_and_unload``), greedy, alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()  # type: ignore[assignment]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,  # type: ignore[operator]
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return list(out[0, len(prompt):].tolist())


def test_tp2_adapters_equal_peft_merged_greedy(folders: tuple[Path, Path], model_dirs: dict[str, Path]) -> None:
    folder, right = folders
    engine = LLMEngine.from_options(folder, {"tensor_parallel_degree": "2", "enable_lora": "true", "max_loras": "1",
                                             "max_lora_rank": "8", "num_kv_blocks": "64"})
    try:
        assert engine.tp_group is not None and engine.tp_group.world_size == 2
        engine.set_runtime_adapters({"right": str(right)})
        prompts = make_prompts(3, seed=5)
        adapters: dict[str, str | None] = {}
        for i, prompt in enumerate(prompts):
            for adapter in (None, "left", "right"):
                rid = f"{adapter or 'base'}-{i}"
                adapters[rid] = adapter
                engine.add(rid, prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, adapter=adapter))
        got: dict[str, list[int]] = {rid: [] for rid in adapters}
        while engine.has_work():
            for d in engine.step():
                got[d.request_id].extend(t.id for t in d.tokens)
    finally:
        engine.close()
    where = {None: None, "left": folder / "adapters" / "left", "right": right}
    for rid, adapter in adapters.items():
        prompt = prompts[int(rid.rsplit("-", 1)[1])]
        assert got[rid] == merged_greedy(model_dirs["llama"], where[adapter], prompt), rid
    assert len({tuple(got[f"{a}-0"]) for a in ("base", "left", "right")}) == 3  # each adapter changes the answer
