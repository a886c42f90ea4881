"""The load-time self-check: architectures off the verified list are admitted when the engine's logits equal
transformers' own forward, and refused, naming the first difference, when they do not.

Tiny random-weight models of two families transformers 5 serves through its attention interface but the
list lacks (``handlers.synthetic_model.UNLISTED_FAMILIES``: OLMo-3 with sliding and full layers, window 16;
GLM-4), run with the family matrix's options. The refusals come from the real probe on a deliberately broken
engine: its paged attention perturbed on decode steps, or its sliding window dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.forward import runner as runner_module
from handlers.engine.execution.self_check import DECODE_STEPS, PROMPT_LENGTHS, probe_sequences
from handlers.engine.planning.families import (
    ADMITTED_BY_LIST,
    PENDING_SELF_CHECK,
    SUPPORTED,
    UnsupportedModel,
    admission,
    unsupported_reason,
)
from handlers.synthetic_model import FAMILIES, TEST_SLIDING_WINDOW, UNLISTED_FAMILIES, build_model
from tests.engine.test_families import ENGINE_OPTIONS, family_prompts, generate_reference, run_together

ARCH = {"olmo3": "Olmo3ForCausalLM (model_type=olmo3)", "glm4": "Glm4ForCausalLM (model_type=glm4)"}
FAILED = "is not on the verified list and failed the load-time self-check: "


@pytest.fixture(scope="module")
def unlisted_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("unlisted")
    return {f: build_model(root / f, f, "tiny") for f in UNLISTED_FAMILIES}


def test_the_unlisted_families_are_off_the_list_but_pass_the_screen() -> None:
    for family, make in UNLISTED_FAMILIES.items():
        model_type = make({"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "inter": 128}, 64)[0]
        assert model_type not in SUPPORTED and family not in FAMILIES
        config = {"model_type": model_type, "architectures": [ARCH[family].split(" ")[0]]}
        assert unsupported_reason(config) is None
        assert admission(config) == PENDING_SELF_CHECK
    assert admission({"model_type": "llama"}) == ADMITTED_BY_LIST


@pytest.mark.parametrize("family", sorted(UNLISTED_FAMILIES))
def test_unlisted_family_is_admitted_by_the_self_check_and_equals_generate(
        unlisted_dirs: dict[str, Path], family: str) -> None:
    model_dir = unlisted_dirs[family]
    prompts = family_prompts()
    refs = generate_reference(model_dir, prompts)
    engine = LLMEngine.from_options(model_dir, ENGINE_OPTIONS)
    assert engine.admitted.startswith(f"load-time self-check ({len(PROMPT_LENGTHS)} prompts, {DECODE_STEPS} decode "
                                      "steps each")
    assert ("crossing the 16-token sliding window" in engine.admitted) is (family == "olmo3")
    first = run_together(engine, prompts, "a")
    second = run_together(engine, prompts, "b")  # the prefix cache: the probe left no stale state behind
    for i, p in enumerate(prompts):
        assert first[i] == refs[i], f"{family}: prompt {i} ({len(p)} tokens) differs from generate"
        assert second[i] == refs[i], f"{family}: prompt {i} ({len(p)} tokens) differs on prefix-cache hits"
    assert engine.stats()["kv_blocks_used"] == 0


def test_verified_family_is_admitted_by_the_list(tmp_path: Path) -> None:
    engine = LLMEngine.from_options(build_model(tmp_path / "llama", "llama", "tiny"), ENGINE_OPTIONS)
    assert engine.admitted == ADMITTED_BY_LIST


def _broken_attention(monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """Swap the engine's paged attention (as the runner registers it) for a broken one."""
    real = runner_module.paged_attention_forward

    def broken(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if change == "window":
            kwargs["sliding_window"] = None
        out, weights = real(module, query, key, value, attention_mask, **kwargs)
        if change == "decode" and getattr(module, "layer_idx", None) == 1 and query.shape[2] == 1:
            out = out + 0.1  # not a scale: GLM-4 normalizes the attention output (a scale would cancel)
        return out, weights

    monkeypatch.setattr(runner_module, "paged_attention_forward", broken)


@pytest.mark.parametrize("family", sorted(UNLISTED_FAMILIES))
def test_a_difference_on_decode_steps_refuses_the_model_naming_it(
        unlisted_dirs: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _broken_attention(monkeypatch, "decode")
    with pytest.raises(UnsupportedModel) as info:
        LLMEngine.from_options(unlisted_dirs[family], ENGINE_OPTIONS)
    message = str(info.value)
    assert message.startswith(f"{ARCH[family]} {FAILED}prompt 1 ({PROMPT_LENGTHS[0]} tokens) decode step 1 "), message
    diff, tol = message.split("logits differ by ")[1].split(" (tolerance ")
    assert float(diff) > float(tol.rstrip(")")) > 0


def test_a_dropped_sliding_window_is_found_by_the_prompt_that_crosses_it(
        unlisted_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Short prompts cannot tell; the one longer than the window fails in its second prefill chunk."""
    _broken_attention(monkeypatch, "window")
    with pytest.raises(UnsupportedModel) as info:
        LLMEngine.from_options(unlisted_dirs["olmo3"], ENGINE_OPTIONS)
    long = TEST_SLIDING_WINDOW + 12
    assert str(info.value).startswith(f"{ARCH['olmo3']} {FAILED}prompt 3 ({long} tokens) prefill (through "
                                      f"position {long - 1}) logits differ by "), str(info.value)


def test_probe_sequences_cross_the_window_within_max_model_len() -> None:
    seqs, crossed = probe_sequences(512, 2048, 640, 24, 16)
    assert [len(s.prompt) for s in seqs] == [5, 12, 28] and crossed == 16
    assert all(len(s.decode) == DECODE_STEPS and sum(s.chunks) == len(s.prompt) and len(s.chunks) >= 2 for s in seqs)
    assert seqs == probe_sequences(512, 2048, 640, 24, 16)[0]  # seeded
    assert all(0 <= t < 512 for s in seqs for t in s.prompt + s.decode)
    # the window cannot be exceeded within max_model_len: nothing to cross, prompts capped to fit
    seqs, crossed = probe_sequences(512, 16, 640, 24, 16)
    assert crossed == 0 and max(len(s.prompt) for s in seqs) + DECODE_STEPS <= 16
    # a long window is crossed when max_model_len allows it, the prefill chunked by the step budget
    seqs, crossed = probe_sequences(512, 8192, 1 << 20, 2048, 4096)
    assert crossed == 4096 and len(seqs[-1].prompt) == 4108 and seqs[-1].chunks == [2048, 2048, 12]
