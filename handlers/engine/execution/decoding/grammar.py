"""Constrained decoding in the engine: grammars compiled against the model's tokenizer, per-row token masks.

Design note: a request's ``SamplingParams.grammar`` (llguidance's serialized grammar, built and checked by
``serving.requests.structured``) becomes an ``LLMatcher`` beside its sequence. Building a matcher can take from a
millisecond to about a second for a large schema, so ``GrammarCompiler`` builds it on its own thread (llguidance
releases the GIL) while the step loop goes on; the engine holds the request back until its matcher is ready,
so a slow schema delays only its own request. Built matchers are kept by the grammar's SHA-256 digest and each
request gets a copy of a fresh one (``deep_copy``), so the same schema is compiled once.

Every step, ``masks`` computes the allowed tokens of all constrained rows in one llguidance call (threads,
GIL released) into a bitmask and unpacks it to a boolean [rows, V] tensor the sampler applies before its
processors: constrained and free rows share the step. A matcher advances with each token its request emits;
tokens are never taken back (constrained rows do not speculate), so preemption, which recomputes the KV of
the tokens but keeps them, leaves the grammar state right.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Generic, TypeVar

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer

from handlers.engine.execution.decoding.grammar_trigger import Trigger

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 64
T = TypeVar("T")
_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarError(Exception):
    """The grammar cannot be compiled against this model's tokenizer (its message says why)."""


class GrammarCompiler:
    """Builds matchers for one model's tokenizer off the step loop, each grammar once."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None  # built on first use (about 0.3 s for a 50k vocabulary)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._built: OrderedDict[str, Future[LLMatcher]] = OrderedDict()
        self.executor = LLExecutor()

    def matcher(self, grammar: str) -> Future[LLMatcher]:
        """A future of a fresh matcher of ``grammar`` (done at once when the grammar was built before)."""
        key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
        template = self._built.get(key)
        if template is None:
            template = self._pool.submit(self._build, grammar)
            self._built[key] = template
            while len(self._built) > CACHED_GRAMMARS:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(key)
        copy: Future[LLMatcher] = Future()

        def done(built: Future[LLMatcher]) -> None:
            exc = built.exception()
            if exc is not None:
                copy.set_exception(exc)
            else:
                copy.set_result(built.result().deep_copy())

        template.add_done_callback(done)
        return copy

    def _build(self, grammar: str) -> LLMatcher:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos)
        matcher = LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def masks(executor: LLExecutor, matchers: Sequence[LLMatcher], vocab_size: int) -> torch.Tensor:
    """Allowed next tokens of each matcher: a boolean [len(matchers), vocab_size] tensor."""
    words = (vocab_size + 31) // 32
    bits = torch.empty((len(matchers), words), dtype=torch.int32)
    executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4,
                                     len(matchers))
    allowed = (bits.unsqueeze(-1) >> _SHIFTS) & 1  # bit j of word w is token 32 w + j
    return allowed.reshape(len(matchers), words * 32)[:, :vocab_size].bool()


class GrammarLogitsProcessor:
    """transformers' logits-processor protocol over one ``generate`` call's rows (the dynamic handler): each call
    first advances every row's matcher with the token the previous call chose, then masks the constrained rows.
    ``matchers[i]`` is row i's matcher, None for a free row, or a ``Trigger`` for a row whose grammar applies
    from its trigger on."""

    def __init__(self, executor: LLExecutor, matchers: Sequence[LLMatcher | Trigger | None], vocab_size: int) -> None:
        self.executor = executor
        self.matchers = list(matchers)
        self.vocab_size = vocab_size
        self.started = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.started:
            for i, m in enumerate(self.matchers):
                token = int(input_ids[i, -1])
                if isinstance(m, Trigger):
                    taken = m.push(token)
                    self.matchers[i] = None if taken is None else m.matcher if taken else m
                elif m is not None and not m.is_stopped():  # a finished row is fed padding from here on
                    m.consume_token(token)
        self.started = True
        at = [i for i, m in enumerate(self.matchers) if m is not None and not isinstance(m, Trigger)]
        if not at:
            return scores
        allowed = masks(self.executor, [self.matchers[i] for i in at], self.vocab_size).to(scores.device)
        width = min(scores.shape[-1], self.vocab_size)
        rows = scores[at]
        rows[:, :width] = rows[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
        rows[:, width:] = float("-inf")
        scores[at] = rows
        return scores


class PendingGrammars(Generic[T]):
    """Requests whose grammar is being compiled: they wait here, outside the scheduler, so a slow schema delays
    only its own request. The compiler is built with the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._args = (tokenizer, vocab_size, frozenset(eos_token_ids))
        self.compiler: GrammarCompiler | None = None
        self._waiting: dict[str, tuple[T, Future[LLMatcher]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, request_id: str, item: T, grammar: str) -> None:
        if self.compiler is None:
            self.compiler = GrammarCompiler(*self._args)
        self._waiting[request_id] = (item, self.compiler.matcher(grammar))

    def discard(self, request_id: str) -> bool:
        """Forget a waiting request; False when it was not waiting."""
        return self._waiting.pop(request_id, None) is not None

    def ready(self, wait_s: float) -> tuple[list[tuple[str, T, LLMatcher]], list[tuple[str, BaseException]]]:
        """The requests whose grammar is built (id, item, matcher) and those whose build failed (id, error),
        after waiting up to ``wait_s`` for a first one (0: do not wait)."""
        if wait_s > 0:
            wait([f for _, f in self._waiting.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        built, failed = [], []
        for rid, (item, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[rid]
            exc = future.exception()
            if exc is None:
                built.append((rid, item, future.result()))
            else:
                failed.append((rid, exc))
        return built, failed

    def masks(self, matchers: Sequence[LLMatcher]) -> torch.Tensor:
        assert self.compiler is not None  # a matcher exists only once the compiler does
        return masks(self.compiler.executor, matchers, self._args[1])

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
