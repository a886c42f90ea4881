"""``handlers.engine.execution.forward.lean``: the lean forward of Llama-structured decoders gives bitwise transformers'
logits, is used only where it does, and the load-time probe refuses it when a model deviates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.engine.execution.forward.runner import ModelRunner, StepInputs
from handlers.synthetic_model import build_model

BS = 16


def runner_for(model_dir: Path, dtype: torch.dtype = torch.float32, **kw: object) -> ModelRunner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights other than the initial ones, so that where they multiply matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return ModelRunner(model, 16, BS, prepack_weights="hybrid", **kw)  # type: ignore[arg-type]


def mixed_steps() -> list[StepInputs]:
    """Two sequences prefilled in one step (a 7-token and a 20-token prompt), then two steps where the
    first decodes while the second gets a 3-token chunk, then both decode."""
    a, b = [11, 12, 13, 14, 15, 16, 17], list(range(40, 60))
    ta, tb = [0, 1], [4, 5, 6]

    def slots(table: list[int], start: int, n: int) -> list[int]:
        return [table[p // BS] * BS + p % BS for p in range(start, start + n)]

    return [
        StepInputs(a + b, list(range(7)) + list(range(20)), slots(ta, 0, 7) + slots(tb, 0, 20),
                   [(0, 0, 7, ta[:1]), (7, 0, 20, tb[:2])], [6, 26]),
        StepInputs([99, 61, 62, 63], [7, 20, 21, 22], slots(ta, 7, 1) + slots(tb, 20, 3),
                   [(0, 7, 1, ta[:1]), (1, 20, 3, tb[:2])], [0, 3]),
        StepInputs([98, 64], [8, 23], slots(ta, 8, 1) + slots(tb, 23, 1), [(0, 8, 1, ta[:1]), (1, 23, 1, tb[:2])],
                   [0, 1]),
    ]


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("qwen2", torch.float32),
                                             ("llama", torch.bfloat16)])
def test_the_lean_forward_gives_transformers_logits_bit_for_bit(tmp_path: Path, arch: str, dtype: torch.dtype
                                                                ) -> None:
    lean_runner = runner_for(build_model(tmp_path / arch, arch, "tiny"), dtype)
    assert lean_runner.lean is not None
    assert (lean_runner.lean.fused is not None) == (dtype == torch.float32)  # the C element-wise steps: fp32, CPU
    lean_runner.lean.fused = None  # the exact forward; the fused one is checked against it below
    plain_runner = runner_for(tmp_path / arch, dtype, lean=False)
    assert plain_runner.lean is None
    for step in mixed_steps():
        got, want = lean_runner.forward(step), plain_runner.forward(step)
        assert got.shape == want.shape == (len(step.keep), lean_runner.model.config.vocab_size)
        assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_fused_element_wise_steps_stay_close_to_the_exact_forward(tmp_path: Path, arch: str) -> None:
    """Norms, residual adds and silu * up in C: the same logits within a few float32 roundings per layer, the
    same greedy tokens."""
    fused = runner_for(build_model(tmp_path / arch, arch, "tiny"))
    exact = runner_for(tmp_path / arch)
    assert fused.lean is not None and fused.lean.fused is not None and exact.lean is not None
    exact.lean.fused = None
    for step in mixed_steps():
        got, want = fused.forward(step), exact.forward(step)
        assert not torch.equal(got, want)  # the C arithmetic did run (its exp and sums round differently)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_probe_turns_off_fused_steps_that_compute_something_else(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from handlers.engine.execution.kernels.native import ElementwiseKernels

    original = ElementwiseKernels.silu_mul
    monkeypatch.setattr(ElementwiseKernels, "silu_mul", lambda self, g, u: original(self, g, u) * 1.01)
    runner = runner_for(build_model(tmp_path / "llama", "llama", "tiny"))
    assert runner.lean is not None and runner.lean.fused is None


@pytest.mark.parametrize("arch", ["qwen2-swa", "mistral", "gemma", "qwen3", "phi3"])
def test_families_the_lean_forward_does_not_reproduce_keep_transformers_forward(tmp_path: Path, arch: str) -> None:
    assert runner_for(build_model(tmp_path / arch, arch, "tiny")).lean is None


def test_the_probe_refuses_the_lean_forward_when_a_model_deviates(tmp_path: Path) -> None:
    """A Llama whose last layer's norm computes something else (same class, so the structure check passes):
    the probe step's logits differ and the runner keeps transformers' forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "llama", "llama", "tiny"),
                                                 dtype=torch.float32)
    norm = model.model.layers[-1].post_attention_layernorm
    norm.variance_epsilon = 1e-6
    original = norm.forward
    norm.forward = lambda x: original(x) * 1.001  # type: ignore[method-assign]
    assert ModelRunner(model, 16, BS).lean is None
