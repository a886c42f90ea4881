"""The seeded benchmark workload (issue 3): the same requests, in the same order, for every configuration.

* ``num_requests`` requests (64 by default);
* prompt lengths uniform in [8, 256] tokens (tokenizer's own ids, BOS included), built from text so that the
  same prompt can go over HTTP as a string and re-tokenize to exactly these ids (checked);
* output lengths: 75% uniform in [8, 32], 25% uniform in [128, 256] tokens, EOS ignored (fixed lengths);
* pass 1 ("burst"): every request arrives at t=0; pass 2 ("poisson"): arrivals of a Poisson process at
  ``rate`` requests/s (exponential gaps, seeded), first one at t=0.

    python benchmarks/workload.py [--model default|110m] [--num-requests 64] [--seed 0]   # prints a summary
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROMPT_MIN, PROMPT_MAX = 8, 256
SHORT_OUT, LONG_OUT = (8, 32), (128, 256)
LONG_FRACTION = 0.25


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str  # text that tokenizes to exactly ``prompt_token_ids``
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    requests: tuple[BenchRequest, ...]
    seed: int

    def arrivals(self, rate: float | None) -> list[float]:
        """Arrival offsets in seconds: all 0 for ``rate`` None/0 (burst), else a seeded Poisson process."""
        if not rate:
            return [0.0] * len(self.requests)
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in self.requests:
            out.append(t)
            t += rng.expovariate(rate)
        return out

    def summary(self) -> dict[str, Any]:
        p = [r.prompt_len for r in self.requests]
        o = [r.max_new_tokens for r in self.requests]
        return {"num_requests": len(p), "seed": self.seed, "prompt_tokens_total": sum(p),
                "prompt_len_min": min(p), "prompt_len_max": max(p), "prompt_len_mean": sum(p) / len(p),
                "output_tokens_total": sum(o), "output_len_mean": sum(o) / len(o),
                "num_long_outputs": sum(1 for x in o if x >= LONG_OUT[0])}


def _vocabulary_text(rng: random.Random, n_words: int) -> str:
    from handlers.synthetic_model import _WORDS

    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _prompt_of_length(tokenizer: Any, target: int, rng: random.Random) -> tuple[str, list[int]]:
    """Text whose tokenization (special tokens included, as the server does it) has ``target`` ids."""
    text = _vocabulary_text(rng, target * 2 + 8)
    ids = tokenizer(text)["input_ids"]
    n_special = len(tokenizer("")["input_ids"])  # BOS added by the post-processor
    body = ids[n_special:]
    want = target - n_special
    # Cut the body, decode, re-tokenize; nudge the cut until the round trip lands exactly on target.
    cut = want
    for _ in range(64):
        piece = tokenizer.decode(body[:cut], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        got = tokenizer(piece)["input_ids"]
        if len(got) == target:
            return piece, list(got)
        cut += target - len(got)
        cut = max(1, min(cut, len(body)))
    return piece, list(got)  # closest found (lengths may be off by a token or two)


def build_workload(tokenizer: Any, num_requests: int = 64, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        plen = rng.randint(PROMPT_MIN, PROMPT_MAX)
        lo, hi = LONG_OUT if rng.random() < LONG_FRACTION else SHORT_OUT
        out = rng.randint(lo, hi)
        text, ids = _prompt_of_length(tokenizer, plen, rng)
        reqs.append(BenchRequest(i, text, tuple(ids), out))
    return Workload(tuple(reqs), seed)


def main(argv: list[str] | None = None) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import AutoTokenizer

    from benchmarks.build_models import model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=2.0)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(model_dir(args.model))
    w = build_workload(tok, args.num_requests, args.seed)
    print(json.dumps(w.summary(), indent=1))
    print(json.dumps([{k: v for k, v in asdict(r).items() if k != "prompt_token_ids"} | {"prompt_len": r.prompt_len}
                      for r in w.requests[:3]], indent=1, ensure_ascii=False))
    print("poisson arrivals (first 8):", [round(t, 2) for t in w.arrivals(args.rate)[:8]])


if __name__ == "__main__":
    main()
