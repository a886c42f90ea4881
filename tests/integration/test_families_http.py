"""The family matrix through the HTTP server: one family per decoder path answers five concurrent LMI
requests (prompts of different lengths, longer than the sliding window) with exactly the tokens of
transformers' ``generate``; refused families leave the model FAILED with the reason.

Every family is checked for exactness in process (``tests/engine/test_families.py``, through the same
``LLMEngine.from_options`` a worker calls); what HTTP adds (the worker process, IPC, batching, detokenizing)
does not depend on the family, so the server runs one family of each forward the engine has: the lean
Llama decoder, sliding windows and soft-caps, attention sinks with experts, multi-query Falcon, learned
positions, a parallel block with partial rotary.

Models are tiny random-weight ones built from each family's config (window 16, small soft-caps); the server
runs them with ``option.rolling_batch=scheduler``, 4-token blocks and a 24-token prefill budget so chunked
prefill crosses the window boundary. Families are served a group per server to bound the worker count.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from handlers.synthetic_model import build_model
from rollcore.corpus import WORDS
from serving.frontends.http.djl import model_entry
from tests.engine.test_families import EXACT, REFUSED, generate_reference
from tests.integration.harness import ServerProcess

MAX_NEW = 24  # contexts of 26-54 tokens: past the 16-token test window and across several KV blocks
SERVED = ["llama", "gemma2", "qwen2-swa", "gpt_oss", "falcon-40b", "gpt2", "phi"]
PROPERTIES = {"option.entryPoint": "rolling", "option.rolling_batch": "scheduler", "option.block_size": "4",
              "option.max_rolling_batch_prefill_tokens": "24", "option.num_kv_blocks": "200"}


def text_prompts(seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    words = [w for w in WORDS if w.isascii()]
    return [" ".join(rng.choice(words) for _ in range(n)) for n in (2, 6, 12, 20, 30)]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_models")
    return {f: build_model(root / f, f, "tiny") for f in [*SERVED, *REFUSED]}


async def _post_all(url: str, prompts: list[str]) -> list[httpx.Response]:
    params = {"max_new_tokens": MAX_NEW, "do_sample": False, "ignore_eos": True, "details": True}
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(client.post(url, json={"inputs": p, "parameters": params})
                                           for p in prompts)))


def test_served_families_are_served_exactly_in_process() -> None:
    assert set(SERVED) <= set(EXACT)


@pytest.mark.parametrize("group", [SERVED], ids=["+".join(SERVED)])  # the id names the families (support matrix)
def test_families_through_http_equal_generate(tmp_path: Path, family_models: dict[str, Path],
                                              group: list[str]) -> None:
    from transformers import AutoTokenizer

    prompts = text_prompts()
    server = ServerProcess.start(tmp_path, models={f: dict(PROPERTIES) for f in group},
                                 sources={f: family_models[f] for f in group}, timeout_s=300)
    try:
        for family in group:
            tokenizer = AutoTokenizer.from_pretrained(family_models[family])
            ids = [tokenizer(p).input_ids for p in prompts]
            assert max(len(i) for i in ids) > 16 and len({len(i) for i in ids}) == 5
            refs = generate_reference(family_models[family], ids, MAX_NEW)
            answers = asyncio.run(_post_all(f"{server.url}/predictions/{family}", prompts))
            for i, r in enumerate(answers):
                assert r.status_code == 200, (family, r.text)
                body: dict[str, Any] = r.json()
                got = [t["id"] for t in body["details"]["tokens"]]
                assert got == refs[i], f"{family}: prompt {i} ({len(ids[i])} tokens) differs from generate"
                assert body["details"]["finish_reason"] == "length"
    finally:
        server.stop()


def test_refused_families_fail_with_the_reason(tmp_path: Path, family_models: dict[str, Path]) -> None:
    server = ServerProcess.start(tmp_path, models={f: dict(PROPERTIES) for f in REFUSED},
                                 sources={f: family_models[f] for f in REFUSED}, wait_ready=False, timeout_s=300)
    try:
        for family, feature in REFUSED.items():
            desc = _wait_settled(server, family)
            assert desc["state"] == "FAILED", desc
            assert feature in str(desc), desc
    finally:
        server.stop()


def _wait_settled(server: ServerProcess, model: str, timeout_s: float = 240) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers, timeout=10)
        if r.status_code == 200 and model_entry(r.json()).get("state") in ("FAILED", "READY"):
            return model_entry(r.json())
        time.sleep(0.2)
    raise AssertionError(f"{model} did not settle:\n{server.log()[-3000:]}")
