"""Architectures off the verified list through a real server: with ``option.rolling_batch=auto`` the frontend
picks the engine pending the load-time self-check; the worker runs it and ``GET /models/{name}`` says how the
architecture was admitted (``"admitted"``: "verified list" or the self-check's summary). A model whose engine
path differs from transformers' forward is FAILED with the first difference.

Models: tiny random-weight OLMo-3 (sliding and full layers, window 16) and GLM-4 (both unlisted), and the
default tiny Llama (listed). The broken engine is real: a ``sitecustomize`` hook on the server's
``PYTHONPATH`` perturbs the paged attention's decode output in the workers, for GLM-4's modules only.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from handlers.synthetic_model import build_model
from tests.engine.test_families import generate_reference
from tests.integration.harness import DEFAULT_MODEL, REPO, ServerProcess, write_model
from tests.integration.test_families_http import text_prompts

PROPERTIES = {"option.rolling_batch": "auto", "option.block_size": "4", "option.num_kv_blocks": "200",
              "option.max_rolling_batch_prefill_tokens": "24"}
PENDING = "rolling engine, pending load-time self-check; {} is not on the verified list"
MAX_NEW = 24

BREAK_HOOK = '''
import importlib.machinery
import os
import sys


class _BreakEngineAttention:
    """Once handlers.engine.execution.forward.runner is imported, perturb its paged attention's decode output for
    models whose modeling module's name contains $ROLLSERVE_TEST_BREAK_ATTENTION."""

    def find_spec(self, name, path=None, target=None):
        if name != "handlers.engine.execution.forward.runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.paged_attention_forward

            def broken(mod, query, *args, **kwargs):
                out, weights = real(mod, query, *args, **kwargs)
                if os.environ["ROLLSERVE_TEST_BREAK_ATTENTION"] in type(mod).__module__ and query.shape[2] == 1:
                    out = out + 0.1
                return out, weights

            module.paged_attention_forward = broken

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("ROLLSERVE_TEST_BREAK_ATTENTION"):
    sys.meta_path.insert(0, _BreakEngineAttention())
'''


@pytest.fixture(scope="module")
def unlisted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("unlisted_http")
    return {f: build_model(root / f, f, "tiny") for f in ("olmo3", "glm4")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, unlisted: dict[str, Path]) -> Iterator[ServerProcess]:
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(BREAK_HOOK)
    path = os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])
    s = ServerProcess.start(tmp_path_factory.mktemp("self_check"), models={
        "olmo3": dict(PROPERTIES), "glm4-broken": dict(PROPERTIES),
        "llama": {"option.rolling_batch": "auto", "option.num_kv_blocks": "64"},
    }, sources={"olmo3": unlisted["olmo3"], "glm4-broken": unlisted["glm4"], "llama": DEFAULT_MODEL},
        env={"PYTHONPATH": path, "ROLLSERVE_TEST_BREAK_ATTENTION": "glm4"}, wait_ready=False, timeout_s=240)
    deadline = time.monotonic() + 240
    while any(s.describe(m).get("state") not in ("READY", "FAILED") for m in ("olmo3", "glm4-broken", "llama")):
        assert s.proc.poll() is None and time.monotonic() < deadline, s.log()
        time.sleep(0.2)
    yield s
    s.stop()


def test_unlisted_architecture_is_admitted_by_the_self_check(server: ServerProcess, unlisted: dict[str, Path]) -> None:
    info: dict[str, Any] = server.describe("olmo3")
    assert info["state"] == "READY" and info["batching"] == "rolling", info
    assert info["rolling_batch"]["effective"] == "scheduler"
    assert PENDING.format("Olmo3ForCausalLM (model_type=olmo3)") in info["rolling_batch"]["reason"]
    assert info["admitted"].startswith("load-time self-check (3 prompts, 4 decode steps each, crossing the "
                                       "16-token sliding window, max diff "), info["admitted"]
    from transformers import AutoTokenizer

    prompts = text_prompts()[2:]
    tokenizer = AutoTokenizer.from_pretrained(unlisted["olmo3"])
    refs = generate_reference(unlisted["olmo3"], [tokenizer(p).input_ids for p in prompts], MAX_NEW)
    params = {"max_new_tokens": MAX_NEW, "do_sample": False, "ignore_eos": True, "details": True}

    async def post_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(client.post(f"{server.url}/predictions/olmo3",
                                                           json={"inputs": p, "parameters": params})
                                               for p in prompts)))

    for i, r in enumerate(asyncio.run(post_all())):
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == refs[i], f"prompt {i} differs from generate"


def test_listed_architecture_is_admitted_by_the_list(server: ServerProcess) -> None:
    info = server.describe("llama")
    assert info["state"] == "READY" and info["admitted"] == "verified list"


def test_a_failed_self_check_fails_the_model_with_the_first_difference(server: ServerProcess) -> None:
    info = server.describe("glm4-broken")
    assert info["state"] == "FAILED", info
    assert ("Glm4ForCausalLM (model_type=glm4) is not on the verified list and failed the load-time self-check: "
            "prompt 1 (5 tokens) decode step 1 logits differ by ") in info["reason"], info["reason"]
    r = httpx.post(f"{server.url}/predictions/glm4-broken", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 503 and "failed the load-time self-check" in r.json()["error"]


def test_config_command_says_the_engine_is_pending_the_self_check(tmp_path: Path, unlisted: dict[str, Path]) -> None:
    model_dir = write_model(tmp_path, "olmo3", {"option.rolling_batch": "auto"}, unlisted["olmo3"])
    proc = subprocess.run([sys.executable, "-m", "serving", "config", str(model_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    i = lines.index("effective rolling_batch = scheduler  (rolling batching; requested auto)")
    assert lines[i + 1].startswith("  reason: option.rolling_batch=auto: "
                                   + PENDING.format("Olmo3ForCausalLM (model_type=olmo3)")), lines[i + 1]
