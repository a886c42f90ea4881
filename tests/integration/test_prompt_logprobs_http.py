"""Prompt log-probabilities over HTTP on the real SmolLM2-135M-Instruct: lm-evaluation-harness's ``local-completions``
loglikelihood requests (echo + logprobs) against the server give transformers' own per-item loglikelihoods; OpenAI's
echo with max_tokens 0, vLLM's ``prompt_logprobs`` (completions and chat), LMI's and TGI's ``decoder_input_details``
all score the prompt with the same values, on the rolling engine and on dynamic batching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.harness import ServerProcess
from tests.real_model import smollm2_folder

QUESTIONS = [  # a loglikelihood task: which continuation the model finds likelier
    {"question": "The capital of France is", "choices": ["Paris", "London", "a large river"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
    {"question": "The sun rises in the", "choices": ["east", "west", "morning after a long night"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
    {"question": "A cat says", "choices": ["meow", "moo", "hello there, how are you today?"], "answer": 0},
]
TASK = """task: rollserve_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def folder() -> Path:
    return smollm2_folder()


@pytest.fixture(scope="module")
def server(smollm2_server: ServerProcess) -> ServerProcess:
    return smollm2_server


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    """``scores(ids)``: transformers' fp32 log-probability of each token after the first, given those before."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def scores(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    return scores


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Any:
    return AutoTokenizer.from_pretrained(folder)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.inference_headers, timeout=300)


def test_lm_eval_loglikelihoods_equal_transformers(server: ServerProcess, folder: Path, reference: Any,
                                                   tokenizer: Any, tmp_path: Path) -> None:
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "capitals.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    env = {**os.environ, "OPENAI_API_KEY": server.tokens["inference"], "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"model=smollm2,base_url={server.url}/v1/completions,tokenizer={folder},num_concurrent=2,max_retries=1",
         "--tasks", "rollserve_capitals", "--include_path", str(tasks), "--log_samples", "--output_path", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    samples = [json.loads(line) for f in out.rglob("samples_rollserve_capitals_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]  # lm_eval's target delimiter: one space
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            n_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            want = sum(reference(whole)[n_context - 1:])
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), (context, continuation)
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)


def test_echo_with_no_new_tokens_scores_the_prompt(server: ServerProcess, reference: Any, tokenizer: Any) -> None:
    prompt = "The quick brown fox jumps over the lazy dog because it wanted to see the other side."
    ids = tokenizer(prompt)["input_ids"]
    want = reference(ids)
    for model in ("smollm2", "dyn"):
        r = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 0
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        for k, top in enumerate(lp["top_logprobs"][1:]):
            assert lp["tokens"][k + 1] in top and len(top) in (2, 3)  # two alternatives plus the prompt's own
        # echo with generated tokens: the prompt's, then the answer's
        r = post(server, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 3, "echo": True,
                                             "logprobs": 0, "temperature": 0, "ignore_eos": True})
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 3
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    r = post(server, "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "'max_tokens' may be 0 only with 'echo'" in r.text


def test_prompt_logprobs_on_every_api(server: ServerProcess, reference: Any, tokenizer: Any) -> None:
    prompt = "Rivers flow into the sea, and the sea is salty."
    ids = tokenizer(prompt)["input_ids"]
    want = reference(ids)
    for model in ("smollm2", "dyn"):
        r = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                             "prompt_logprobs": 1})
        scored = r.json()["choices"][0]["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        for k, entry in enumerate(scored[1:]):
            assert entry[str(ids[k + 1])]["logprob"] == pytest.approx(want[k], abs=1e-4)
            assert len(entry) in (1, 2) and any(v["rank"] == 1 for v in entry.values())
        r = post(server, "/v1/chat/completions", {"model": model, "max_tokens": 2, "prompt_logprobs": 0,
                                                  "messages": [{"role": "user", "content": prompt}]})
        chat = r.json()["prompt_logprobs"]
        assert chat[0] is None and all(len(e) == 1 for e in chat[1:]) and len(chat) > len(ids)
        for route, key in ((f"/generate?model_name={model}", "logprob"), (f"/predictions/{model}", "log_prob")):
            r = post(server, route, {"inputs": prompt, "parameters": {"max_new_tokens": 2, "details": True,
                                                                      "decoder_input_details": True}})
            assert r.status_code == 200, r.text
            answer = r.json()
            prefill = (answer[0] if isinstance(answer, list) else answer)["details"]["prefill"]
            assert [t["id"] for t in prefill] == ids and prefill[0][key] is None
            assert [t[key] for t in prefill[1:]] == pytest.approx(want, abs=1e-4)


def test_seed_as_string_truncation_bad_words_and_beams(server: ServerProcess, tokenizer: Any) -> None:
    """DJL's and vLLM's request shapes: a seed written as digits is the same seed; truncate_prompt_tokens keeps the
    prompt's last tokens; bad_words on OpenAI; num_beams runs on dynamic batching and is refused by name on the
    rolling engine."""
    sampled = {"max_new_tokens": 8, "do_sample": True, "temperature": 1.0}
    for model in ("smollm2", "dyn"):
        as_int = post(server, f"/predictions/{model}", {"inputs": "Once upon a time", "parameters": {**sampled,
                                                                                                   "seed": 7}})
        as_text = post(server, f"/predictions/{model}", {"inputs": "Once upon a time", "parameters": {**sampled,
                                                                                                    "seed": "7"}})
        assert as_int.status_code == as_text.status_code == 200 and as_int.json() == as_text.json()
    r = post(server, "/predictions/dyn", {"inputs": "x", "parameters": {"seed": "-1"}})
    assert r.status_code == 400 and "parameter 'seed'" in r.text
    prompt = "Ignore this part entirely. The capital of France is"
    tail = tokenizer(prompt)["input_ids"][-5:]
    for model in ("smollm2", "dyn"):
        cut = post(server, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                               "truncate_prompt_tokens": 5})
        alone = post(server, "/v1/completions", {"model": model, "prompt": tail, "max_tokens": 4, "temperature": 0})
        assert cut.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        assert cut.json()["usage"]["prompt_tokens"] == 5
        ask = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 12, "temperature": 0}
        assert "Paris" in post(server, "/v1/chat/completions", ask).json()["choices"][0]["message"]["content"]
        banned = post(server, "/v1/chat/completions", {**ask, "bad_words": ["Paris"]}).json()
        assert "Paris" not in banned["choices"][0]["message"]["content"]
    beams = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "num_beams": 3}}
    assert post(server, "/predictions/dyn", beams).status_code == 200
    r = post(server, "/predictions/smollm2", beams)
    assert r.status_code == 400 and "'num_beams' > 1" in r.json()["error"]


def test_best_of_keeps_the_likeliest_candidates(server: ServerProcess) -> None:
    """best_of 5, n 2: the two answers are the two of the five seeded candidates (seed + j each, the same as n 5)
    with the highest cumulative log-probability, in that order."""
    body = {"model": "smollm2", "prompt": "My favourite animal is", "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "logprobs": 0}
    every = post(server, "/v1/completions", {**body, "n": 5}).json()["choices"]
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert len({c["text"] for c in every}) > 2  # the candidates differ: the choice means something
    best = post(server, "/v1/completions", {**body, "n": 2, "best_of": 5}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in best["choices"])
    r = post(server, "/v1/completions", {**body, "n": 2, "best_of": 5, "stream": True})
    assert r.status_code == 400 and "'best_of' > 'n' cannot stream" in r.json()["error"]


def test_tgi_best_of_answers_the_likeliest_candidate(server: ServerProcess) -> None:
    """TGI's (and DJL's) best_of: the answer is the likeliest of the sampled candidates, the others in
    details.best_of_sequences (likeliest first), on the TGI and LMI routes; greedy and streamed requests are refused
    by name."""
    params = {"max_new_tokens": 6, "do_sample": True, "temperature": 1.0, "seed": 11, "details": True}
    for model in ("smollm2", "dyn"):
        route = f"/generate?model_name={model}"
        alone = [post(server, route, {"inputs": "My favourite animal is", "parameters": {**params, "seed": 11 + j}})
                 .json() for j in range(4)]
        score = [sum(t["logprob"] for t in a["details"]["tokens"]) for a in alone]
        r = post(server, route, {"inputs": "My favourite animal is", "parameters": {**params, "best_of": 4}})
        assert r.status_code == 200, r.text
        best = r.json()
        ranked = sorted(range(4), key=lambda j: -score[j])
        assert best["generated_text"] == alone[ranked[0]]["generated_text"]
        assert [s["generated_text"] for s in best["details"]["best_of_sequences"]] == [
            alone[j]["generated_text"] for j in ranked[1:]]
        lmi = post(server, f"/predictions/{model}", {"inputs": "My favourite animal is",
                                                     "parameters": {**params, "best_of": 4}}).json()
        assert lmi["generated_text"] == best["generated_text"]
        assert [s["generated_text"] for s in lmi["details"]["best_of_sequences"]] == [
            s["generated_text"] for s in best["details"]["best_of_sequences"]]
    greedy = post(server, "/generate?model_name=dyn", {"inputs": "x", "parameters": {"best_of": 2}})
    assert greedy.status_code == 422 and "'best_of' > 1 needs sampling" in greedy.json()["error"]
    streamed = post(server, "/predictions/smollm2", {"inputs": "x", "stream": True,
                                                     "parameters": {**params, "best_of": 2}})
    assert streamed.status_code == 400 and "'best_of' > 1 cannot stream" in streamed.json()["error"]
