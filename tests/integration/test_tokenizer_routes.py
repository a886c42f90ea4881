"""The routes clients assume, on the real SmolLM2-135M-Instruct (``smollm2_server``: ``smollm2`` and ``dyn`` share
its tokenizer): vLLM's /tokenize and /detokenize equal the ``tokenizers`` library on the model's tokenizer.json,
/tokenize with messages counts the chat answer's usage.prompt_tokens, /tokenizer_info and the remote tokenizer of
lm-evaluation-harness give the loglikelihoods of its local tokenizer, OpenAI's /v1/models/{id} through the
``openai`` SDK, /invocations with OpenAI completions and chat bodies (the ``openai`` package's types), unknown fields
named at any depth, and llama.cpp's ``response_format: {"type": "json_object", "schema": ...}`` honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer

from tests.integration.harness import ServerProcess
from tests.integration.test_prompt_logprobs_http import QUESTIONS, TASK
from tests.real_model import smollm2_folder

MSGS = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(smollm2_server: ServerProcess) -> ServerProcess:
    return smollm2_server


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_folder() / "tokenizer.json"))


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.inference_headers, timeout=300)


def test_tokenize_and_detokenize_equal_the_tokenizers_library(server: ServerProcess, tokenizer: Tokenizer) -> None:
    text = "Hello, world! Tokenizers split text like thïs into pieces."
    for special in (True, False):
        r = post(server, "/tokenize", {"model": "smollm2", "prompt": text, "add_special_tokens": special,
                                       "return_token_strs": True})
        assert r.status_code == 200, r.text
        want = tokenizer.encode(text, add_special_tokens=special)
        assert r.json() == {"count": len(want.ids), "max_model_len": 2048, "tokens": want.ids,
                            "token_strs": want.tokens}
        back = post(server, "/detokenize", {"model": "smollm2", "tokens": want.ids})
        assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(want.ids,
                                                                                     skip_special_tokens=False)}
    assert post(server, "/detokenize", {"tokens": want.ids}).json()["prompt"] == text  # one shared tokenizer
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = post(server, "/detokenize", {"model": "smollm2", "tokens": [1, size]})
    assert bad.status_code == 400 and bad.json()["error"].startswith("'tokens[1]' is")


def test_tokenize_messages_counts_the_chat_prompt(server: ServerProcess) -> None:
    counted = post(server, "/tokenize", {"model": "smollm2", "messages": MSGS})
    assert counted.status_code == 200, counted.text
    chat = post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    usage = ChatCompletion.model_validate(chat.json()).usage
    assert usage is not None and counted.json()["count"] == usage.prompt_tokens
    without = post(server, "/tokenize", {"model": "smollm2", "messages": MSGS, "add_generation_prompt": False})
    assert without.json()["tokens"] == counted.json()["tokens"][:without.json()["count"]]
    assert without.json()["count"] < counted.json()["count"]


def test_models_retrieve_with_the_openai_sdk(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.tokens["inference"])
    model = client.models.retrieve("smollm2")
    assert (model.id, model.object, model.owned_by) == ("smollm2", "model", "rollserve")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.status_code == 404 and "no-such-model" in err.value.message


def test_invocations_answer_openai_completions_and_chat(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    via_lmi = post(server, "/invocations?model_name=smollm2", body)
    direct = post(server, "/v1/completions", {**body, "model": "smollm2"})
    assert via_lmi.status_code == 200 and direct.status_code == 200, (via_lmi.text, direct.text)
    one, two = Completion.model_validate(via_lmi.json()), Completion.model_validate(direct.json())
    assert (one.object, one.model, one.choices[0].text, one.usage) == (two.object, two.model, two.choices[0].text,
                                                                       two.usage)
    chat = post(server, "/invocations?model_name=smollm2", {"messages": MSGS, "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text
    answer = ChatCompletion.model_validate(chat.json())
    with httpx.stream("POST", f"{server.url}/invocations?model_name=smollm2", headers=server.inference_headers,
                      json={"messages": MSGS, "max_tokens": 4, "temperature": 0, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(x)) for x in lines[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    streamed = post(server, "/invocations?model_name=smollm2", {**body, "stream": True})
    assert streamed.text.strip().endswith("data: [DONE]")


def test_unknown_fields_are_named_at_any_depth(server: ServerProcess) -> None:
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi", "foo": 1}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                        "bar": 2}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "baz": 3}}],
            "tool_choice": "none"}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert set(r.headers["x-ignored-parameters"].split(", ")) == {
        "messages.0.foo", "response_format.json_schema.bar", "tools.0.function.baz"}


def test_unknown_nested_fields_are_refused_under_strict_parameters(tmp_path: Path) -> None:
    srv = ServerProcess.start(tmp_path, models={"strict": {"option.entryPoint": "huggingface",
                                                           "option.strict_parameters": "true"}}, timeout_s=240)
    try:
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "foo": 1}],
                                               "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"] == "unknown fields: messages.0.foo"
        r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream_options": {"x": 1}})
        assert r.status_code == 400 and r.json()["error"] == "unknown fields: stream_options.x"
        r = post(srv, "/tokenize", {"prompt": "Hi", "colour": 1})
        assert r.status_code == 400 and r.json()["error"] == "unknown fields: colour"
    finally:
        srv.stop()


def test_json_object_with_a_schema_is_honoured(server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    r = post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "max_tokens": 40,
                                              "temperature": 0, "response_format": {"type": "json_object",
                                                                                    "schema": schema}})
    assert r.status_code == 200, r.text
    assert "x-ignored-parameters" not in r.headers
    content = ChatCompletion.model_validate(r.json()).choices[0].message.content
    jsonschema.validate(json.loads(content or ""), schema)


def test_lm_eval_remote_tokenizer_gives_the_local_tokenizers_loglikelihoods(server: ServerProcess,
                                                                             tmp_path: Path) -> None:
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "capitals.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "OPENAI_API_KEY": server.tokens["inference"], "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for name, tokenizer_args in (("local", f"tokenizer={smollm2_folder()}"),
                                 ("remote", f"tokenizer_backend=remote,auth_token={server.tokens['inference']}")):
        out = tmp_path / name
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model=smollm2,base_url={server.url}/v1/completions,{tokenizer_args},num_concurrent=2,max_retries=1",
             "--tasks", "rollserve_capitals", "--include_path", str(tasks), "--log_samples", "--output_path",
             str(out)], env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-4000:]
        samples = [json.loads(line) for f in out.rglob("samples_rollserve_capitals_*.jsonl")
                   for line in f.read_text().splitlines()]
        results[name] = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}
    assert len(results["remote"]) == len(QUESTIONS)
    assert results["remote"].keys() == results["local"].keys()
    # a token more or less moves a sum by whole units; batch mates move it by float rounding (~1e-6 of it)
    for doc, scores in results["local"].items():
        assert results["remote"][doc] == pytest.approx(scores, rel=1e-5, abs=1e-5), doc
