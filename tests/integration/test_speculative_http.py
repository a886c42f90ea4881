"""Speculative decoding through the server: a model with ``option.speculative_draft=ngram`` answers concurrent LMI
requests with generate's tokens, streams (LMI jsonlines, OpenAI SSE) carry every token of the steps that emit
several, and the Prometheus counters of guessed and confirmed tokens move."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from handlers.synthetic_model import build_model
from tests.engine.test_families import generate_reference
from tests.integration.harness import ServerProcess
from tests.integration.test_families_http import text_prompts

MAX_NEW = 40
PROPERTIES = {"option.entryPoint": "rolling", "option.rolling_batch": "scheduler", "option.num_kv_blocks": "256",
              "option.speculative_draft": "ngram", "option.num_speculative_tokens": "4",
              "option.speculative_max_batch_size": "8"}


def _counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.mgmt + "/metrics", headers=server.mgmt_headers, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels.get("model") == "spec")


async def _post_all(url: str, prompts: list[str]) -> list[httpx.Response]:
    params = {"max_new_tokens": MAX_NEW, "do_sample": False, "ignore_eos": True, "details": True}
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(client.post(url, json={"inputs": p, "parameters": params})
                                           for p in prompts)))


def test_speculative_model_through_http(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = build_model(tmp_path / "weights", "llama", "tiny")
    server = ServerProcess.start(tmp_path / "server", models={"spec": PROPERTIES}, sources={"spec": model_dir},
                                 timeout_s=240)
    try:
        prompts = text_prompts()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        refs = generate_reference(model_dir, [tokenizer(p).input_ids for p in prompts], MAX_NEW)
        answers = asyncio.run(_post_all(f"{server.url}/predictions/spec", prompts))
        for i, r in enumerate(answers):
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            assert [t["id"] for t in body["details"]["tokens"]] == refs[i], f"prompt {i}"
            assert body["details"]["finish_reason"] == "length"
        drafted = _counter(server, "rollserve_spec_decode_num_draft_tokens_total")
        accepted = _counter(server, "rollserve_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= drafted

        # LMI jsonlines: one line per token, with its own text, also for the steps that emitted several
        lmi = {"inputs": prompts[3], "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "details": True}}
        whole = answers[3].json()
        with httpx.stream("POST", f"{server.url}/predictions/spec", json={**lmi, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            lines = [json.loads(line) for line in s.iter_lines() if line.strip()]
        assert [line["token"]["id"] for line in lines] == refs[3]
        assert "".join(line["token"]["text"] for line in lines) == whole["generated_text"]

        # OpenAI completions: the streamed text equals the whole answer's
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        kwargs: dict[str, Any] = {"model": "spec", "prompt": prompts[4], "max_tokens": MAX_NEW, "temperature": 0}
        full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
        chunks = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert full.usage is not None and full.usage.completion_tokens == MAX_NEW
        assert _counter(server, "rollserve_spec_decode_num_accepted_tokens_total") > accepted
    finally:
        server.stop()
