"""Seeded benchmark workloads whose prompts have exact token counts in the model's own tokenizer.

A prompt of N tokens is text (words of the synthetic models' corpus) cut so that the model's
``tokenizer.json`` -- read with ``tokenizers``, as the server's frontend reads it, special tokens (BOS)
included -- encodes it to exactly N ids; the same text can go over HTTP and the same ids over gRPC/OpenAI.
Output lengths are fixed per request (``ignore_eos``). Lengths are drawn from ``LengthDist`` objects and
arrival times from ``arrivals``; one ``random.Random(seed)`` draws, per request, the prompt length, the
output length, then the text, so a workload is reproduced exactly from its spec and seed.

A workload sent twice to one server would be answered from its prefix cache the second time (every prompt's
full blocks are cached by then): measured on the 110M model, 24 requests at 2 req/s right after a start had
TTFT p50 571-788 ms and ITL p99 594-683 ms, the same requests again 114-142 ms and 91-141 ms; with prefix
caching off all three passes measured like the first. So every pass and every tuning run sends
``Workload.fresh(k)``: the same lengths, output lengths and arrival times, prompts of new text (variant ``k``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer


class LengthDist(Protocol):
    """A distribution of token counts (``serving.bench.scenario`` builds them from YAML)."""

    def sample(self, rng: random.Random) -> int: ...
    def bounds(self) -> tuple[int, int]: ...


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
    tokenizer: Any = field(default=None, compare=False, repr=False)  # what ``fresh`` draws new prompts with
    variant: int = 0

    def fresh(self, variant: int) -> Workload:
        """This workload with prompts of new text, drawn from ``(seed, variant)``: each prompt keeps its token
        count (and each request its output length and arrival time), so no prefix is shared with another
        variant beyond chance. Variant 0 is the workload itself."""
        if variant == self.variant:
            return self
        if self.tokenizer is None:
            raise ValueError("this workload was built without its tokenizer: it cannot draw new prompts")
        rng = random.Random(f"{self.seed}/{variant}")
        reqs = []
        for r in self.requests:
            text, ids = prompt_of_length(self.tokenizer, r.prompt_len, rng)
            reqs.append(BenchRequest(r.index, text, tuple(ids), r.max_new_tokens))
        return replace(self, requests=tuple(reqs), variant=variant)

    def arrivals(self, rate: float | None, burstiness: float = 1.0) -> list[float]:
        """Arrival offsets in seconds: all 0 for ``rate`` None/0 (burst), else a seeded Poisson process at
        ``rate`` requests/s (``burstiness`` != 1: gamma-distributed gaps of the same mean, vLLM's
        ``--burstiness``; < 1 burstier, > 1 more regular). The first request arrives at 0."""
        if not rate:
            return [0.0] * len(self.requests)
        rng = random.Random(self.seed + 1)
        t, out = 0.0, []
        for _ in self.requests:
            out.append(t)
            t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness,
                                                                                  1.0 / (rate * burstiness))
        return out

    def summary(self) -> dict[str, Any]:
        p = [r.prompt_len for r in self.requests]
        o = [r.max_new_tokens for r in self.requests]
        return {"num_requests": len(p), "seed": self.seed, "prompt_tokens_total": sum(p),
                "prompt_len_min": min(p), "prompt_len_max": max(p), "prompt_len_mean": sum(p) / len(p),
                "output_tokens_total": sum(o), "output_len_mean": sum(o) / len(o),
                "output_len_min": min(o), "output_len_max": max(o)}


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a model folder (its ``tokenizer.json``) or of a ``tokenizer.json`` file."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json (prompts are generated from the model's tokenizer)")
    return Tokenizer.from_file(str(file))


def _words() -> tuple[str, ...]:
    # the test models' corpus: any tokenizer encodes these words
    from rollcore.corpus import WORDS

    return WORDS


def prompt_of_length(tokenizer: Tokenizer, target: int, rng: random.Random) -> tuple[str, list[int]]:
    """Text whose tokenization (special tokens included, as the server does it) has exactly ``target`` ids.

    Raises ``ValueError`` when no text has that many (``target`` below the special tokens' count)."""
    n_special = len(tokenizer.encode("").ids)  # BOS added by the post-processor
    if target < n_special:
        raise ValueError(f"a prompt of {target} tokens is impossible: this tokenizer adds {n_special} special "
                         f"token(s) to every prompt")
    if target == n_special:
        return "", list(tokenizer.encode("").ids)
    words = _words()
    for attempt in range(8):
        text = " ".join(rng.choice(words) for _ in range(target * 2 + 8 + 16 * attempt))
        body = tokenizer.encode(text).ids[n_special:]
        want = target - n_special
        # Cut the body, decode, re-tokenize; nudge the cut until the round trip lands exactly on target.
        cut = want
        for _ in range(64):
            piece = tokenizer.decode(body[:cut], skip_special_tokens=True)
            got = tokenizer.encode(piece).ids
            if len(got) == target:
                return piece, list(got)
            cut += target - len(got)
            cut = max(1, min(cut, len(body)))
    raise ValueError(f"no text of {target} tokens found in 8 attempts (this tokenizer merges the corpus words "
                     f"unpredictably)")


def build_workload(tokenizer: Tokenizer, num_requests: int, seed: int, prompt_len: LengthDist,
                   output_len: LengthDist) -> Workload:
    """``num_requests`` requests: per request a prompt length, an output length, then the prompt text."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        plen = prompt_len.sample(rng)
        out = output_len.sample(rng)
        text, ids = prompt_of_length(tokenizer, plen, rng)
        reqs.append(BenchRequest(i, text, tuple(ids), out))
    return Workload(tuple(reqs), seed, tokenizer)


def clip(value: float, lo: int, hi: int) -> int:
    """``value`` rounded to an integer in [lo, hi]."""
    return max(lo, min(hi, int(math.floor(value + 0.5))))
