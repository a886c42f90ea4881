"""A seeded chat workload of real English text, and its streamed client (``/v1/chat/completions``), for
``compare.py --model smollm2`` (a chat model: its natural answers, not fixed lengths).

* ``num_requests`` requests (32 by default), each one user message: 1-3 consecutive paragraphs of one licence
  text in ``/usr/share/common-licenses`` (plain ASCII English, the same files on every Debian/Ubuntu machine;
  ``prompts_sha256`` in the summary tells whether two machines sent the same text), then an instruction
  (summarise, list, explain, rewrite, quote ...). Seeded: the same seed sends the same messages.
* Greedy (``temperature`` 0), natural EOS (no ``ignore_eos``), ``max_tokens`` capped (256).
* Client: the same request body for rollserve and vLLM (``stream: true``, ``stream_options.include_usage``).
  A chunk whose delta has content is a token arrival (TTFT, ITL); role-only and finish-only chunks are not.
  Output tokens are the last chunk's ``usage.completion_tokens`` (what each server says it generated, EOS
  included by both), not the chunk count, since a chunk may carry several tokens.

    python benchmarks/chat_workload.py [--num-requests 32] [--seed 0]   # prints a summary and two messages
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from serving.bench.clients import _http  # noqa: E402
from serving.bench.run_metrics import Rec  # noqa: E402
from serving.bench.workload import BenchRequest, Workload  # noqa: E402

TEXTS = Path("/usr/share/common-licenses")
MAX_TOKENS = 256
PARAGRAPH_CHARS = (200, 1200)
INSTRUCTIONS = (
    "Summarise the text above in three sentences.",
    "List the main points of the text above.",
    "Explain the text above to a beginner.",
    "Rewrite the first paragraph in plain words.",
    "Quote the sentence of the text above that says what a user is allowed to do.",
    "Quote the sentence of the text above that sets a condition.",
    "What does the text above forbid? Answer briefly.",
    "Give the text above a short title and explain your choice.",
)


def paragraphs() -> list[list[str]]:
    """Prose paragraphs (whitespace folded) of each licence file, in file-name order; symlinks (GPL -> GPL-3)
    skipped. Kept: ASCII, 200-1200 characters, mostly letters (no headings, no code)."""
    out = []
    for f in sorted(p for p in TEXTS.iterdir() if p.is_file() and not p.is_symlink()):
        ps = [" ".join(p.split()) for p in re.split(r"\n\s*\n", f.read_text(encoding="ascii", errors="replace"))]
        keep = [p for p in ps if PARAGRAPH_CHARS[0] <= len(p) <= PARAGRAPH_CHARS[1] and p.isascii()
                and sum(c.isalpha() for c in p) > 0.7 * len(p)]
        if keep:
            out.append(keep)
    if not out:
        raise FileNotFoundError(f"{TEXTS}: no English paragraphs found (the chat workload's text)")
    return out


@dataclass(frozen=True)
class ChatWorkload(Workload):
    """Requests whose ``prompt`` is the user message and ``prompt_token_ids`` its chat-template rendering."""

    def summary(self) -> dict[str, Any]:
        p = [r.prompt_len for r in self.requests]
        digest = hashlib.sha256("\0".join(r.prompt for r in self.requests).encode()).hexdigest()[:16]
        return {"kind": "chat", "num_requests": len(p), "seed": self.seed, "prompt_tokens_total": sum(p),
                "prompt_len_min": min(p), "prompt_len_max": max(p), "prompt_len_mean": sum(p) / len(p),
                "max_tokens": max(r.max_new_tokens for r in self.requests), "text": str(TEXTS),
                "prompts_sha256": digest}


def build_chat_workload(tokenizer: Any, num_requests: int = 32, seed: int = 0,
                        max_tokens: int = MAX_TOKENS) -> ChatWorkload:
    """``tokenizer``: the model's transformers tokenizer (its chat template counts the prompt tokens)."""
    files, rng = paragraphs(), random.Random(seed)
    reqs = []
    for i in range(num_requests):
        ps = rng.choice(files)
        start = rng.randrange(len(ps))
        text = "\n\n".join(ps[start:start + rng.randint(1, 3)]) + "\n\n" + rng.choice(INSTRUCTIONS)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        reqs.append(BenchRequest(i, text, tuple(ids), max_tokens))
    return ChatWorkload(tuple(reqs), seed)


# ------------------------------------------------------------------------------------------- client
def _chat_line(line: str, rec: Rec, t: float) -> bool:
    """One SSE line of a chat stream: a content chunk (a token arrival), usage, an error, or ``[DONE]``."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    obj = json.loads(data)
    if "error" in obj:
        rec.error = f"stream error: {json.dumps(obj['error'])[:200]}"
    if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ()):
        rec.token_times.append(t)
    if obj.get("usage"):
        rec.n_out = obj["usage"]["completion_tokens"]
    return False


def run_chat(url: str, model: str, requests: tuple[BenchRequest, ...], arrivals: list[float],
             timeout_s: float = 1800.0) -> list[Rec]:
    """Send each request's ``prompt`` as one user message at its arrival (offsets in s from now), streamed."""
    import httpx

    async def one(client: Any, req: BenchRequest, rec: Rec) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": req.prompt}],
                "max_tokens": req.max_new_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        await _http(client, f"{url}/v1/chat/completions", body, {}, rec, True, lambda _obj: 0, _chat_line)

    async def main() -> list[Rec]:
        t0 = time.perf_counter() + 0.05
        recs = [Rec(t0 + a) for a in arrivals]
        limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            await asyncio.gather(*(one(client, r, rec) for r, rec in zip(requests, recs, strict=True)))
        return recs

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    from tests.real_model import smollm2_folder

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    w = build_chat_workload(AutoTokenizer.from_pretrained(smollm2_folder()), args.num_requests, args.seed)
    print(json.dumps(w.summary(), indent=1))
    for r in w.requests[:2]:
        print(f"\n--- request {r.index} ({r.prompt_len} prompt tokens)\n{r.prompt}")


if __name__ == "__main__":
    main()
