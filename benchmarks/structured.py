"""Structured output on the real SmolLM2-135M-Instruct: what constraints cost a burst, and whether they hold.

Serves the model (converted from its GGUF once, ``tests.real_model.smollm2_folder``) with the rolling engine and,
alternating ``--rounds`` times:
- ``free``: 100 free-text chat requests sent at once (50 topics x 2 questions, greedy, at most 64 tokens);
- ``mixed``: 50 ``json_schema`` requests (five schemas: nested objects, enums, bounded arrays, required fields,
  numbers; at most 256 tokens) and the first 50 free requests of ``free``, all at once;
- ``control``: ``mixed`` without the constraints, each of its 50 JSON prompts generating exactly as many tokens as
  its constrained answer had in ``mixed`` (``ignore_eos``): the same prompts and token counts, so the ratio
  mixed/control is what the constraints themselves cost, apart from the longer answers they ask for.
Prints per run the completion tokens, wall time, tok/s and the server's CPU-seconds, then the medians (min-max) and
the ratios mixed/free (the acceptance figure) and mixed/control. Checks: every constrained answer parses and
validates (``jsonschema``), every free answer of ``mixed`` equals the same request's answer in ``free`` (greedy).
Then, once: 20 ``tool_choice="required"`` and 20 named-function requests, each streamed and not (arguments
validated against the function's schema, streamed calls equal to the whole ones), 20 regex and 20 choice requests.

    taskset -c 0,1 .venv/bin/python benchmarks/structured.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import jsonschema  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402

from serving.bench.launch import LocalServer  # noqa: E402
from tests.real_model import smollm2_folder  # noqa: E402

TOPICS = ["volcanoes", "honey bees", "the moon", "tea", "rainbows", "penguins", "bicycles", "chess", "coffee",
          "glaciers", "owls", "bread", "the ocean", "trains", "music", "paper", "salt", "deserts", "whales", "rice",
          "clocks", "lightning", "bananas", "maps", "snow", "dolphins", "bridges", "cheese", "stars", "forests",
          "elephants", "soap", "kites", "tomatoes", "rivers", "bats", "glass", "wind", "carrots", "castles", "ants",
          "books", "sand", "frogs", "candles", "apples", "clouds", "horses", "mountains", "bees wax"]
FREE = [f"Tell me one fact about {t}." for t in TOPICS] + [f"Explain {t} in one sentence." for t in TOPICS]
S = {"type": "string", "maxLength": 30}
SCHEMAS = [
    ("Invent a person. Answer in JSON.", {"type": "object", "properties": {
        "name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German", "Spanish"]}, "minItems": 1,
                      "maxItems": 2},
        "address": {"type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "languages", "address"], "additionalProperties": False}),
    ("Describe a product for sale as JSON.", {"type": "object", "properties": {
        "name": S, "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "tags": {"type": "array", "items": S, "maxItems": 3}, "in_stock": {"type": "boolean"}},
        "required": ["name", "price", "tags", "in_stock"], "additionalProperties": False}),
    ("Make up a meeting as JSON.", {"type": "object", "properties": {
        "title": S, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {"name": S}, "required": ["name"],
                                                 "additionalProperties": False}, "minItems": 1, "maxItems": 2}},
        "required": ["title", "date", "attendees"], "additionalProperties": False}),
    ("Review a film you like, as JSON.", {"type": "object", "properties": {
        "film": S, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "mixed", "negative"]}, "summary": {"type": "string", "maxLength": 60}},
        "required": ["film", "rating", "sentiment", "summary"], "additionalProperties": False}),
    ("Write a recipe as JSON.", {"type": "object", "properties": {
        "dish": S, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}, "vegetarian": {"type": "boolean"}},
        "required": ["dish", "servings", "ingredients", "vegetarian"], "additionalProperties": False}),
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": S, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHT = {"type": "function", "function": {"name": "book_flight", "description": "Book a flight",
                                           "parameters": {"type": "object", "properties": {
                                               "origin": S, "destination": S,
                                               "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                                               "required": ["origin", "destination", "passengers"],
                                               "additionalProperties": False}}}
FUNCTION_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FLIGHT)}
CITIES = ["Madrid", "Oslo", "Lima", "Cairo", "Tokyo", "Denver", "Rome", "Quito", "Perth", "Dakar"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of a process and its descendants (the frontend and its workers)."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def chat(client: openai.OpenAI, question: str, **kw: Any) -> Any:
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          temperature=0, **kw)


def burst(client: openai.OpenAI, jobs: list[tuple[str, Any]], pid: int) -> tuple[dict[str, float], list[Any]]:
    def one(job: tuple[str, Any]) -> Any:
        kind, item = job
        if kind == "free":
            return chat(client, item, max_tokens=64)
        if kind == "forced":  # (prompt, tokens): a free answer of exactly that many tokens
            return chat(client, item[0], max_tokens=item[1], extra_body={"ignore_eos": True})
        question, schema = item
        return chat(client, question, max_tokens=256, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})

    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    tokens = sum(a.usage.completion_tokens for a in answers)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "cpu_s": cpu_seconds(pid) - cpu0}, answers


def check_mixed(jobs: list[tuple[str, Any]], answers: list[Any], free_answers: dict[str, str]) -> tuple[int, int]:
    """(constrained answers that validate, free answers equal to their ``free`` run's); raises on a bad one."""
    valid = same = 0
    for (kind, item), a in zip(jobs, answers, strict=True):
        text = a.choices[0].message.content
        if kind == "json":
            jsonschema.validate(json.loads(text), item[1])
            valid += 1
        else:
            same += text == free_answers[item]
    return valid, same


def tool_checks(client: openai.OpenAI) -> None:
    for label, choice in (("required", "required"),
                          ("named", {"type": "function", "function": {"name": "get_weather"}})):
        ok = 0
        for i in range(20):
            question = (f"What is the weather in {CITIES[i % 10]}?" if i % 2 == 0 else
                        f"Book a flight from {CITIES[i % 10]} to {CITIES[(i + 3) % 10]} for {1 + i % 4} people.")
            whole = chat(client, question, max_tokens=120, tools=[WEATHER, FLIGHT], tool_choice=choice)
            calls = whole.choices[0].message.tool_calls or []
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), FUNCTION_SCHEMAS[call.function.name])
            streamed: dict[int, list[str]] = {}
            for chunk in chat(client, question, max_tokens=120, tools=[WEATHER, FLIGHT], tool_choice=choice,
                              stream=True):
                for part in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
                    entry = streamed.setdefault(part.index, ["", ""])
                    entry[0] += part.function.name or ""
                    entry[1] += part.function.arguments or ""
            assert calls and [tuple(v) for _, v in sorted(streamed.items())] == [
                (c.function.name, c.function.arguments) for c in calls], (question, calls, streamed)
            ok += 1
        print(f"tool_choice {label}: {ok}/20 requests, every call's arguments validate, streamed calls equal")
    phones = [chat(client, f"Give me the phone number of shop {i}.", max_tokens=20,
                   extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}).choices[0].message.content for i in range(20)]
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", p) for p in phones), phones
    choices = ["yes", "no", "not sure"]
    picks = [chat(client, f"Is {t} a kind of food?", max_tokens=5, extra_body={"guided_choice": choices})
             .choices[0].message.content for t in TOPICS[:20]]
    assert all(p in choices for p in picks), picks
    print(f"regex: 20/20 match; choice: 20/20 in the list ({', '.join(sorted(set(picks)))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="option.max_rolling_batch_size")
    args = ap.parse_args()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags")[0].strip())
    print(f"affinity: {sorted(os.sched_getaffinity(0))}")
    props = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": str(args.batch),
             "option.max_model_len": "2048", "option.kv_cache_populate": "lazy"}
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer.start(smollm2_folder(), Path(tmp), name="smollm2", properties=props,
                                   folder_properties=False)
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.tokens.get("inference", "none"),
                                   max_retries=0, timeout=900)
            pid = server.proc.proc.pid
            chat(client, "warm up", max_tokens=4)
            free_jobs: list[tuple[str, Any]] = [("free", q) for q in FREE]
            mixed_jobs: list[tuple[str, Any]] = [("json", SCHEMAS[i % 5]) for i in range(50)] + free_jobs[:50]
            mixed_jobs = [job for pair in zip(mixed_jobs[:50], mixed_jobs[50:], strict=True) for job in pair]
            runs: dict[str, list[dict[str, float]]] = {"free": [], "mixed": [], "control": []}
            lengths: list[int] = []
            for r in range(args.rounds):
                for label in ("free", "mixed", "control"):
                    jobs = {"free": free_jobs, "mixed": mixed_jobs}.get(label) or [
                        ("forced", (item[0], n)) if kind == "json" else (kind, item)
                        for (kind, item), n in zip(mixed_jobs, lengths, strict=True)]
                    print(f"round {r + 1} {label}: load {os.getloadavg()[0]:.2f}", flush=True)
                    figures, answers = burst(client, jobs, pid)
                    runs[label].append(figures)
                    if label == "mixed":
                        lengths = [a.usage.completion_tokens for a in answers]
                    if label == "free":
                        free_answers = {q: a.choices[0].message.content for (_, q), a in zip(jobs, answers,
                                                                                             strict=True)}
                    elif label == "mixed":
                        valid, same = check_mixed(jobs, answers, free_answers)
                        figures["valid"], figures["same"] = valid, same
                    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in figures.items()), flush=True)
            med = {k: statistics.median(f["tok_s"] for f in v) for k, v in runs.items()}
            for k, v in runs.items():
                rates = [f["tok_s"] for f in v]
                cpu = statistics.median(f["cpu_s"] for f in v)
                print(f"{k}: {med[k]:.1f} tok/s median ({min(rates):.1f}-{max(rates):.1f}), CPU {cpu:.1f} s median")
            print(f"mixed/free throughput: {med['mixed'] / med['free']:.2f} (target >= 0.8); mixed/control (same "
                  f"prompts and token counts, no constraint): {med['mixed'] / med['control']:.2f}")
            print(f"constrained answers valid: {sum(f['valid'] for f in runs['mixed']):.0f}/{50 * args.rounds}; "
                  f"free answers equal alone: {sum(f['same'] for f in runs['mixed']):.0f}/{50 * args.rounds}")
            tool_checks(client)
        except BaseException:
            print(server.proc.tail(80))
            raise
        finally:
            server.stop()


if __name__ == "__main__":
    main()
