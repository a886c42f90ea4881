"""Every tensor the engine allocates lives on its model's device: the KV pool, the step's inputs and metadata,
the logits. Two checks that need no GPU: the engine steps on CPU while torch's default device is ``meta`` (an
allocation that names no device lands on ``meta`` and breaks the step), and the KV pool and step tensors built
for the ``meta`` device stay there (where no forward is needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.forward.paged_attention import KVPool, SeqSpan, StepMetadata, on_device
from handlers.engine.execution.forward.runner import StepInputs
from handlers.synthetic_model import build_model
from rollcore.types import SamplingParams
from tests.engine.conftest import make_prompts


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("placement") / "gemma2", "gemma2", "tiny")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # the lean forward; transformers' with windows and soft-caps
@pytest.mark.parametrize("attention_kernel", ["native", "torch"])
def test_steps_allocate_nothing_off_the_model_device(model_dirs: dict[str, Path], gemma2_dir: Path, arch: str,
                                                     attention_kernel: str) -> None:
    folder = gemma2_dir if arch == "gemma2" else model_dirs[arch]
    engine = LLMEngine.from_options(folder, {"num_kv_blocks": "64", "block_size": "4",
                                             "attention_kernel": attention_kernel,
                                             "max_rolling_batch_prefill_tokens": "40"})
    prompts = make_prompts(5, seed=3, shared_prefix=6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, top_k=5, top_p=0.9,
                             repetition_penalty=1.1, seed=1, logprobs=2)  # the per-request sampling path
    for i, p in enumerate(prompts[:3]):
        engine.add(f"r{i}", p, sampled if i == 1 else params)
    produced = 0
    torch.set_default_device("meta")
    try:
        steps = 0
        while engine.has_work():
            if steps == 2:  # arrivals mid-run: prefill chunks beside decodes, prefix-cache hits
                for i, p in enumerate(prompts[3:], start=3):
                    engine.add(f"r{i}", p, params)
            produced += len(engine.step())
            steps += 1
    finally:
        torch.set_default_device(None)
    assert produced == 5 * 10
    assert all(t.device.type == "cpu" for t in engine.runner.pool.keys + engine.runner.pool.values)


def test_pool_and_step_tensors_follow_the_device() -> None:
    device = torch.device("meta")
    pool = KVPool(2, 32, 2, 8, torch.bfloat16, device=device)
    assert {t.device for t in pool.keys + pool.values} == {device}
    assert pool.keys[0].shape == (2, 32, 8) and pool.keys[0].dtype == torch.bfloat16
    inputs = StepInputs([1, 2, 3, 4], [0, 1, 2, 3], [0, 1, 2, 3], [(0, 0, 3, [0]), (3, 5, 1, [3, 1])], [2, 3])
    slots = on_device(torch.tensor(inputs.slots), device)
    spans = tuple(SeqSpan(q0, start, n, tuple(table)) for q0, start, n, table in inputs.seqs)
    meta = StepMetadata(pool, slots, spans, 4)
    plan = meta.decode_plan(0)
    assert plan is not None and plan.meta.device == device and plan.tables.device == device
    assert plan.rest[0].mask is None and plan.rest[0].causal  # the prefill of the first sequence
    windowed = meta.views(2)[0]
    assert windowed.mask is not None and windowed.mask.device == device
    scattered = StepMetadata(pool, slots, (SeqSpan(0, 0, 6, (3, 1)),), 4).views(0)[0]
    assert scattered.kv_index is not None and scattered.kv_index.device == device
