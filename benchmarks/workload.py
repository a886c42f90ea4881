"""The seeded benchmark workload: the same requests, in the same order, for every configuration.

The generator is ``serving.bench.workload`` (what ``serving bench`` runs); this module fixes its distributions.

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
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from serving.bench import workload as _w  # noqa: E402
from serving.bench.scenario import Mixture, Uniform  # noqa: E402
from serving.bench.workload import BenchRequest, Workload  # noqa: E402

__all__ = ["BenchRequest", "Workload", "build_workload", "PROMPT_LEN", "OUTPUT_LEN"]

PROMPT_MIN, PROMPT_MAX = 8, 256
SHORT_OUT, LONG_OUT = (8, 32), (128, 256)
LONG_FRACTION = 0.25
# the same distributions as serving's preset bench-default (serving/bench/presets/bench-default.yaml)
PROMPT_LEN = Uniform(PROMPT_MIN, PROMPT_MAX)
OUTPUT_LEN = Mixture(((LONG_FRACTION, Uniform(*LONG_OUT)), (1 - LONG_FRACTION, Uniform(*SHORT_OUT))))


def build_workload(tokenizer: Any, num_requests: int = 64, seed: int = 0) -> Workload:
    """The benchmark's workload. ``tokenizer``: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer
    (its ``backend_tokenizer`` is used)."""
    return _w.build_workload(getattr(tokenizer, "backend_tokenizer", tokenizer), num_requests, seed, PROMPT_LEN,
                             OUTPUT_LEN)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.build_models import model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=2.0)
    args = ap.parse_args(argv)
    w = build_workload(_w.load_tokenizer(model_dir(args.model)), args.num_requests, args.seed)
    print(json.dumps(w.summary(), indent=1))
    print(json.dumps([{k: v for k, v in asdict(r).items() if k != "prompt_token_ids"} | {"prompt_len": r.prompt_len}
                      for r in w.requests[:3]], indent=1, ensure_ascii=False))
    print("poisson arrivals (first 8):", [round(t, 2) for t in w.arrivals(args.rate)[:8]])


if __name__ == "__main__":
    main()
