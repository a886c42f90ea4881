"""What a sampled token becomes: one request's text, its stop checks and the delta that carries them out.

Design note: the engine (``handlers.engine.engine``) keeps the batch-wide bookkeeping -- the scheduler, counters,
LoRA slots -- and hands each sampled token of a request here. ``emit_token`` appends it to the sequence, releases
the text the detokenizer may release, feeds a grammar (a held-back one watches for its trigger first), decides
whether the request finished (EOS, a stop token or string, a complete grammar, the length limits) and builds the
``TokenDelta``; the first delta of a request carries its prompt's token counts and scores. A stop token (EOS or
``stop_token_ids``) ends the text without adding its own, as vLLM does.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from handlers.engine.core.detokenizer import IncrementalDetokenizer
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.speculative import NgramDrafter
from handlers.engine.execution.decoding.grammar_trigger import Trigger
from handlers.engine.execution.decoding.sampling import RequestSampler, SampledToken, bad_words_ids
from rollcore.types import FinishReason, TokenDelta, TokenInfo

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineRequest:
    """Engine-side companions of a sequence: sampler, detokenizer, whether its first delta went out."""

    seq: Sequence
    sampler: RequestSampler
    detokenizer: IncrementalDetokenizer
    eos_ids: frozenset[int]
    drafter: NgramDrafter | None = None  # speculative decoding's guesses (plain greedy requests only)
    # structured output: the grammar's llguidance matcher (handlers.engine.execution.decoding.grammar)
    matcher: Any = None
    trigger: Trigger | None = None  # a grammar held back until the answer writes its trigger (tool calls)
    prompt_scores: list[TokenInfo | None] | None = None  # prompt_logprobs: one entry per prompt position
    sent_first: bool = False
    lora_slot: int = -1  # the slot of its LoRA adapter while it holds one (-1: the base model)


def new_request(seq: Sequence, tokenizer: Any, backend_tokenizer: Any, eos_token_ids: frozenset[int],
                seed_source: random.Random, lookup: tuple[int, int] | None) -> EngineRequest:
    """The companions of a new sequence. ``lookup``: the n-gram sizes of speculative decoding when it is on (a
    plain greedy request without a grammar then gets a drafter)."""
    params = seq.params
    eos = frozenset() if params.ignore_eos else eos_token_ids
    sampler = RequestSampler(params, seed_source, seq.num_prompt_tokens, eos | frozenset(params.stop_token_ids),
                             bad_words_ids(tokenizer, params.bad_words))
    drafter = None
    if lookup is not None and sampler.plain_greedy and params.grammar is None:
        drafter = NgramDrafter(*lookup)
    detokenizer = IncrementalDetokenizer(backend_tokenizer, seq.prompt_token_ids, params.stop,
                                         params.skip_special_tokens, params.include_stop_str_in_output)
    req = EngineRequest(seq, sampler, detokenizer, eos, drafter)
    if params.prompt_logprobs is not None:
        req.prompt_scores = [None] * seq.num_prompt_tokens
        first = seq.prompt_token_ids[0]
        req.prompt_scores[0] = TokenInfo(first, tokenizer.decode([first]))  # nothing before it: no score
    return req


def watch_trigger(req: EngineRequest, token: int) -> bool:
    """A held-back grammar sees ``token``; from its trigger on it constrains the answer. True: the grammar
    is complete already (the answer ends, as with any grammar)."""
    assert req.trigger is not None
    taken = req.trigger.push(token)
    if taken is None:
        req.trigger = None
    elif taken:
        req.matcher, req.trigger = req.trigger.matcher, None
        return bool(req.matcher.is_stopped())
    return False


def emit_token(req: EngineRequest, sampled: SampledToken, max_model_len: int) -> TokenDelta:
    """Append ``sampled`` to the request's sequence and return its delta; a finished request's sequence has its
    ``finish_reason`` set (the engine then frees it)."""
    seq = req.seq
    token = sampled.token_id
    seq.append_token(token)
    stop_token = token in req.eos_ids or token in seq.params.stop_token_ids
    detok = req.detokenizer.push(token, stop_token=stop_token)
    text = detok.released
    finish: FinishReason | None = None
    complete = False
    if req.trigger is not None and not stop_token:
        complete = watch_trigger(req, token)
    elif req.matcher is not None and not stop_token:
        if not req.matcher.consume_token(token):  # the mask allowed it: only an llguidance fault gets here
            logger.error("request %s: the grammar refused token %d it allowed: %s", seq.request_id, token,
                         req.matcher.get_error())
        complete = req.matcher.is_stopped()  # a grammar that cannot grow ends the answer, as a stop sequence
    if token in req.eos_ids:
        finish = FinishReason.EOS
    elif token in seq.params.stop_token_ids or detok.stopped or complete:
        finish = FinishReason.STOP
    elif seq.num_output_tokens >= seq.params.max_new_tokens or seq.num_tokens >= max_model_len:
        finish = FinishReason.LENGTH
    piece = detok.piece
    if finish is not None and not detok.stopped:
        released, unpieced = req.detokenizer.flush()
        text += released
        piece += unpieced  # a character the last tokens left unfinished: its U+FFFD is the last token's text
    prompt_tokens = None
    prompt_scores = None
    cached_tokens = None
    if not req.sent_first:
        req.sent_first = True
        prompt_tokens = seq.num_prompt_tokens
        cached_tokens = seq.num_cached_prompt_tokens
        if req.prompt_scores is not None:
            prompt_scores = tuple(t for t in req.prompt_scores if t is not None)
    if finish is not None:
        seq.finish_reason = finish
    info = TokenInfo(token, piece, sampled.logprob, sampled.top_logprobs)
    return TokenDelta(seq.request_id, (info,), text, finish, prompt_tokens, prompt_logprobs=prompt_scores,
                      cached_tokens=cached_tokens)
