"""Fixtures: tiny random-init models (built once per session) and greedy references from generate()."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from handlers.synthetic_model import build_model


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, arch, "tiny") for arch in ("llama", "qwen2", "gpt2")}


def make_prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """Token-id prompts of varied lengths (ids 5..500), optionally sharing their first tokens."""
    rng = random.Random(seed)
    prefix = [rng.randint(5, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randint(5, 500) for _ in range(rng.randint(3, 45))] for _ in range(n)]


_REFS: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def reference_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` new tokens for one prompt alone (memoised)."""

    key = (str(model_dir), tuple(prompt), max_new_tokens)
    if key not in _REFS:
        model = _reference_model(model_dir)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        _REFS[key] = out[0, len(prompt):].tolist()
    return _REFS[key]


_MODELS: dict[str, torch.nn.Module] = {}


def _reference_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if str(model_dir) not in _MODELS:
        _MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[str(model_dir)]


def greedy_together(engine: object, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Every prompt added at once (their rows share every step) and run to ``max_new_tokens`` ignoring EOS: each
    one's generated ids, in order."""
    from rollcore.types import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))  # type: ignore[attr-defined]
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():  # type: ignore[attr-defined]
        for delta in engine.step():  # type: ignore[attr-defined]
            got[delta.request_id] += [t.id for t in delta.tokens]
    return [got[str(i)] for i in range(len(prompts))]
