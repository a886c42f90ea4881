"""``LLMEngine``: continuous batching over a transformers model, one step at a time.

Design note: the step reads like the algorithm -- schedule, run the model on the flat batch, commit the
computed KV, sample, detokenize, check stop conditions, emit deltas. Policy (scheduler, allocator) is pure
Python; the runner and sampler hold the torch work. Everything runs on the worker's engine thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from handlers.engine.build import kv_bytes_per_token, load_for_engine, plan_for_loaded_model
from handlers.engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from handlers.engine.core.sequence import Sequence
from handlers.engine.emission import EngineRequest, emit_token, new_request
from handlers.engine.execution.decoding.drafts import check_drafts
from handlers.engine.execution.decoding.grammar import PendingGrammars
from handlers.engine.execution.decoding.grammar_trigger import Trigger
from handlers.engine.execution.decoding.sampling import SampledToken, sample_batch, score_prompt_rows
from handlers.engine.execution.forward.lora import AdapterError, AdapterQueue, check_adapter, enable_lora
from handlers.engine.execution.forward.pooling import POOLINGS, EmbeddingPool
from handlers.engine.execution.forward.runner import ModelRunner
from handlers.engine.execution.parallel.ranks import TensorParallelGroup
from handlers.engine.execution.self_check import probe_unverified, verify
from handlers.engine.execution.weights.loading import eos_token_ids
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.families import ADMITTED_BY_LIST
from handlers.engine.planning.memory import MemoryPlan
from handlers.engine.step_timing import time_steps
from rollcore.errors import InvalidRequest
from rollcore.step_cost import StepCost
from rollcore.types import FinishReason, SamplingParams, TokenDelta, TokenInfo

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation engine. Not thread-safe: call it from one thread."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: EngineConfig | None = None,
                 available_bytes: int | None = None, tp_group: TensorParallelGroup | None = None,
                 num_kv_heads: int | None = None, memory_plan: MemoryPlan | None = None,
                 adapters: Mapping[str, Path] | None = None) -> None:
        """``memory_plan``: the preflight's (``from_options``); without one, the KV cache is planned for the
        already-loaded ``model`` from ``available_bytes`` (default: measured now, on the model's device).
        ``adapters``: LoRA adapter folders by name (with ``config.enable_lora``)."""
        config = config or EngineConfig()
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self._backend_tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        per_token = kv_bytes_per_token(model, num_kv_heads)
        if memory_plan is None:  # the caller loaded the model: its weights are in memory already
            memory_plan = plan_for_loaded_model(model, config, per_token, available_bytes)
        self.memory_plan = memory_plan.for_bytes_per_token(per_token)
        self.max_model_len = self.memory_plan.max_model_len
        num_blocks = self.memory_plan.num_kv_blocks
        self.tp_group = tp_group
        if tp_group is not None:  # every rank must build the same pool: rank 0 decides
            num_blocks = tp_group.broadcast_int(num_blocks)
        # an architecture off the verified list: transformers' own logits now, before the runner changes the model,
        # the engine's after (``handlers.engine.execution.self_check``); ``admitted`` says which way it came in
        arch, probe = probe_unverified(model, tokenizer, tp_group is not None, self.max_model_len,
                                       num_blocks * config.block_size, config.max_num_batched_tokens)
        # before the runner: prepacking then swaps the linears inside the LoRA wrappers, and fused projections
        # would bypass them
        self.lora = enable_lora(model, config, tp_group is not None, adapters or {})
        self.runner = ModelRunner(model, num_blocks, config.block_size, prepack_weights=config.prepack_weights,
                                  measure_linears=config.measure_linears, max_seqs=config.max_num_seqs,
                                  populate_kv=config.kv_cache_populate, num_kv_heads=num_kv_heads, group=tp_group,
                                  fuse_weights=config.fuse_projections and self.lora is None,
                                  use_kernels=config.attention_kernel == "native",
                                  step_tokens=config.max_num_batched_tokens,
                                  cuda_graphs=0 if config.enforce_eager else config.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.runner.lora = self.lora
        self.admitted = ADMITTED_BY_LIST if probe is None else verify(self.runner, probe, arch)
        self._kv_block_bytes = per_token * config.block_size
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, num_blocks=num_blocks, max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, sliding_window=self.runner.sliding_window,
            max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
            max_speculative_batch=config.speculative_max_batch_size or 1 << 30,
            burst_prefill_first=config.burst_prefill_first))
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB); %.1f sequences of %d tokens fit",
                    num_blocks, config.block_size, num_blocks * config.block_size * per_token / 2**20,
                    num_blocks * config.block_size / self.max_model_len, self.max_model_len)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.vocab_size = int(model.config.vocab_size)  # the logits' width
        self._seed_source = random.Random(config.seed)
        self._requests: dict[str, EngineRequest] = {}
        self._embeddings = EmbeddingPool()  # embedding requests: prompt only, pooled (execution.pooling)
        self._compiling: PendingGrammars[EngineRequest] = PendingGrammars(tokenizer, self.vocab_size,
                                                                          self.eos_token_ids)
        self._lora_waiting: AdapterQueue[EngineRequest] = AdapterQueue(self.lora, self._start_adapter)
        self._counters = {"num_steps_total": 0, "num_prefill_tokens_total": 0, "prompt_tokens_total": 0,
                          "generation_tokens_total": 0, "num_requests_finished_total": 0,
                          "num_requests_aborted_total": 0, "spec_draft_tokens_total": 0,
                          "spec_accepted_tokens_total": 0}
        self.step_cost = StepCost()  # every step's tokens and seconds (``rollcore.step_cost``: serving tune fits it)
        # the step's clocks: the fitted step cost, the prefill bound, the ITL target, the guesses' gate
        timing = time_steps(config, self.scheduler, self.runner.execute, self._draft, calibrate_now=tp_group is None)
        self.step_fit, self.prefill_budget, self.itl, self.draft_gate = (timing.step_fit, timing.prefill_budget,
                                                                          timing.itl, timing.draft_gate)

    @classmethod
    def from_options(cls, model_dir: Path, options: Mapping[str, str], device_id: int = -1) -> LLMEngine:
        """Load model and tokenizer from ``model_dir`` and build an engine from DJL-style options on the worker's
        device (``handlers.engine.build``: checks, preflight, tensor-parallel ranks, loading)."""
        loaded = load_for_engine(model_dir, options, device_id)
        return cls(loaded.model, loaded.tokenizer, loaded.config, tp_group=loaded.group,
                   num_kv_heads=loaded.num_kv_heads, memory_plan=loaded.memory_plan, adapters=loaded.adapters)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (no-op without tensor parallelism)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()
            self.tp_group = None
        self._compiling.close()

    # --------------------------------------------------------------- requests
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ``rollcore.errors.InvalidRequest`` if it can never run."""
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if request_id in self._compiling:
            raise InvalidRequest(f"request id {request_id!r} is already in the engine")
        self.scheduler.check(seq)
        lookup = None if self.scheduler.drafter is None else (self.config.prompt_lookup_min,
                                                                self.config.prompt_lookup_max)
        req = new_request(seq, self.tokenizer, self._backend_tokenizer, self.eos_token_ids, self._seed_source, lookup)
        if params.adapter is not None:
            check_adapter(self.lora, params.adapter)
        if params.grammar is None:
            self._queue(req)
            return
        self._compiling.add(request_id, req, params.grammar)

    def add_embedding(self, request_id: str, prompt_token_ids: list[int], pooling: str = "last",
                      normalize: bool = True) -> None:
        """Queue an embedding request: its prompt runs like a prefill, answered by one delta with the ``pooling``
        of its final hidden states (L2-normalised with ``normalize``). Raises ``InvalidRequest`` if it can never
        run."""
        if pooling not in POOLINGS or not self.runner.head_tap.available:
            raise InvalidRequest(f"this model cannot embed with pooling {pooling!r} in the rolling engine")
        if request_id in self._compiling or request_id in self._embeddings:
            raise InvalidRequest(f"request id {request_id!r} is already in the engine")
        seq = Sequence(request_id, list(prompt_token_ids), SamplingParams(max_new_tokens=0, embed=True),
                       pooling=pooling)
        self.scheduler.add(seq)
        self._embeddings.add(request_id, seq.num_prompt_tokens, normalize)

    def abort(self, request_id: str) -> None:
        """Drop a request now (waiting or running); its blocks are free before the next step."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release(req)
        if req is not None or self._compiling.discard(request_id) or self._embeddings.discard(request_id):
            self.scheduler.abort(request_id)
            self._counters["num_requests_aborted_total"] += 1

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._compiling) or bool(self._lora_waiting)

    def _queue(self, req: EngineRequest) -> None:
        """Hand a request to the scheduler; one of an adapter first needs a slot (``AdapterQueue``)."""
        self._requests[req.seq.request_id] = req
        if req.seq.params.adapter is None:
            self.scheduler.add(req.seq)
        else:
            self._lora_waiting.push(req, req.seq.params.adapter)

    def _start_adapter(self, req: EngineRequest, slot: int) -> None:
        req.lora_slot = slot
        self.scheduler.add(req.seq)

    def _release(self, req: EngineRequest) -> None:
        if req.lora_slot >= 0:
            self._lora_waiting.release(req.lora_slot)
            req.lora_slot = -1
        else:
            self._lora_waiting.discard(req)

    def _admit_compiled(self) -> list[TokenDelta]:
        """Queue the requests whose grammar is built; a grammar that failed fails its request alone. With
        nothing else to run, wait briefly for a build instead of spinning."""
        built, failed = self._compiling.ready(wait_s=0 if self.scheduler.has_work() else 0.02)
        for _, req, matcher in built:
            trigger = req.seq.params.grammar_trigger
            if trigger is None:
                req.matcher = matcher
            else:
                req.trigger = Trigger(matcher, trigger, self._token_piece)
            self._queue(req)
        return [TokenDelta(rid, finish_reason=FinishReason.ERROR,
                           error=f"the constraint cannot be compiled for this model: {exc}") for rid, exc in failed]

    def configure(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  max_itl_ms: int | None = None) -> None:
        """Change the running batch's size and the step's token budget from the next step on (None keeps a
        value); running requests are never preempted to comply. The KV cache and the activation allowance keep
        the sizes planned at load: a larger batch than planned may preempt for blocks, a larger token budget
        uses activation memory beyond the plan (logged). ``max_itl_ms``: the inter-token latency target (0: off)."""
        planned = self.memory_plan.max_num_batched_tokens
        if max_num_batched_tokens is not None and max_num_batched_tokens > planned:
            logger.warning("max_rolling_batch_prefill_tokens=%d exceeds the %d tokens the memory plan reserved "
                           "activations for at load", max_num_batched_tokens, planned)
        if max_itl_ms is not None:
            self.itl.set(max_itl_ms)
        self.scheduler.set_limits(max_num_seqs, max_num_batched_tokens)
        cfg = self.scheduler.config
        logger.info("engine limits: max_rolling_batch_size=%d, max_rolling_batch_prefill_tokens=%d, max_itl_ms=%s "
                    "(from the next step)", cfg.max_num_seqs, cfg.max_num_batched_tokens,
                    self.itl.as_dict()["max_itl_ms"])

    # ------------------------------------------------------------------- step
    def step(self) -> list[TokenDelta]:
        """Run one iteration; returns a delta for every token produced (one per request, or several for a
        request whose guessed tokens were confirmed: ``_verify``)."""
        t0 = time.perf_counter()
        failed = self._admit_compiled() if self._compiling else []
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return failed
        # a one-token chunk that samples is a row (it pays the LM head); any other chunk is prompt work
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 or not c.samples)
        rows = plan.num_batched_tokens - prompt_tokens
        fitted = self.step_fit.model
        predicted = fitted.seconds(rows, prompt_tokens) if fitted is not None else None
        adapters = [self._lora_slot(c.seq.request_id) for c in plan.chunks] if self.lora else []
        logits = self.runner.execute(plan.chunks, adapters if any(a >= 0 for a in adapters) else ())
        embedded = self._pooled(plan.chunks) if self._embeddings else []
        if any(c.num_prompt_rows for c in plan.chunks):
            logits = score_prompt_rows(plan.chunks, logits, self.tokenizer.batch_decode, self._record_prompt_scores)
        self.scheduler.commit(plan)
        self._counters["num_steps_total"] += 1
        self._counters["num_prefill_tokens_total"] += prompt_tokens
        sampled = [c for c in plan.chunks if c.samples]
        reqs = [self._requests[c.seq.request_id] for c in sampled]
        if any(c.draft for c in sampled):
            deltas = self._verify(sampled, reqs, logits)
        else:
            tokens = sample_batch(logits, [c.seq.token_ids for c in sampled], [r.sampler for r in reqs],
                                  self._allowed(reqs))
            deltas = [self._advance(r, t) for r, t in zip(reqs, tokens, strict=True)]
        seconds = time.perf_counter() - t0
        self.step_cost.add(plan.num_batched_tokens, seconds)
        self.step_fit.record(rows, prompt_tokens, seconds)
        self.itl.record_step(t0 + seconds, rows, bool(sampled), predicted)
        return failed + embedded + deltas

    def _lora_slot(self, request_id: str) -> int:
        req = self._requests.get(request_id)  # embedding requests run on the base model
        return req.lora_slot if req is not None else -1

    def _pooled(self, chunks: tuple[ScheduledChunk, ...]) -> list[TokenDelta]:
        """The embedding requests this step completed (their sequences finished, blocks freed)."""
        if not any(c.seq.pooling is not None for c in chunks):
            return []
        hidden = self.runner.head_tap.take() if any(c.pooled_rows for c in chunks) else None
        deltas = []
        for chunk, delta in self._embeddings.fold(chunks, hidden):
            self.scheduler.finish(chunk.seq)
            self._counters["prompt_tokens_total"] += chunk.seq.num_prompt_tokens
            self._counters["num_requests_finished_total"] += 1
            deltas.append(delta)
        return deltas

    def _record_prompt_scores(self, chunk: ScheduledChunk, infos: list[TokenInfo]) -> None:
        scores = self._requests[chunk.seq.request_id].prompt_scores
        assert scores is not None
        # a chunk recomputed after preemption writes the same values again
        scores[chunk.start + 1:chunk.start + 1 + len(infos)] = infos

    def _token_piece(self, token: int) -> str:
        return str(self._backend_tokenizer.decode([token], skip_special_tokens=False))

    def _allowed(self, reqs: list[EngineRequest]) -> dict[int, torch.Tensor] | None:
        """The grammar masks of the constrained rows among ``reqs`` (row index -> allowed tokens), or None."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        allowed = self._compiling.masks([reqs[i].matcher for i in rows])
        return dict(zip(rows, allowed, strict=True))

    # -------------------------------------------------------- speculative decoding
    def _draft(self, seq: Sequence) -> list[int]:
        """The scheduler's drafter: guesses of ``seq``'s next tokens, never more than it may still generate
        after the token the model adds."""
        req = self._requests.get(seq.request_id)
        if req is None or req.drafter is None:
            return []
        k = min(self.config.num_speculative_tokens, seq.params.max_new_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1)
        return req.drafter.propose(seq.token_ids, k)

    def _verify(self, sampled: list[ScheduledChunk], reqs: list[EngineRequest],
                logits: torch.Tensor) -> list[TokenDelta]:
        """A step with guesses (``handlers.engine.execution.decoding.drafts``): confirmed guesses and each chunk's next
        token become deltas."""
        allowed = self._allowed([r for c, r in zip(sampled, reqs, strict=True) if not c.draft])
        deltas = []
        for req, checked in zip(reqs, check_drafts(sampled, [r.sampler for r in reqs], logits, allowed), strict=True):
            if not checked.drafted:
                deltas.append(self._advance(req, checked.tokens[0]))
                continue
            if req.drafter is not None:
                req.drafter.record(checked.drafted, checked.accepted)
            if self.draft_gate is not None:
                self.draft_gate.odds.record(checked.drafted, checked.accepted)
            self._counters["spec_draft_tokens_total"] += checked.drafted
            self._counters["spec_accepted_tokens_total"] += checked.accepted
            deltas.extend(self._advance_many(req, checked.tokens))
        return deltas

    def _advance_many(self, req: EngineRequest, tokens: list[SampledToken]) -> list[TokenDelta]:
        """Emit the model's tokens of one verified chunk (confirmed guesses, then its own next token), a delta
        each (so that every token keeps its own released text), stopping at the first that finishes the
        request; the confirmed guesses' KV counts as computed."""
        deltas = []
        for token in tokens:
            deltas.append(self._advance(req, token))
            if deltas[-1].finish_reason is not None:
                return deltas
        self.scheduler.accept_draft(req.seq, len(deltas) - 1)
        return deltas

    def _advance(self, req: EngineRequest, sampled: SampledToken) -> TokenDelta:
        """The request's next token out (``handlers.engine.emission``); a finished request leaves the engine."""
        delta = emit_token(req, sampled, self.max_model_len)
        self._counters["generation_tokens_total"] += 1
        if delta.prompt_tokens is not None:  # its first delta
            self._counters["prompt_tokens_total"] += delta.prompt_tokens
        if delta.finish_reason is not None:
            self.scheduler.finish(req.seq)
            self._release(self._requests.pop(req.seq.request_id))
            self._counters["num_requests_finished_total"] += 1
        return delta

    # ------------------------------------------------------------------ stats
    def set_runtime_adapters(self, adapters: Mapping[str, str]) -> None:
        """The LoRA adapters registered over the API (``LoraLayers.set_runtime``); on the engine's thread."""
        if self.lora is None:
            raise AdapterError("this model serves no LoRA adapters: option.enable_lora is off")
        self.lora.set_runtime(adapters)

    def prefix_events(self) -> dict[str, Any] | None:
        """The prefix-cache keys registered and evicted since the last call (``BlockAllocator.take_events``) with
        the block size they cover, for the frontend's prefix-aware routing; None when nothing changed."""
        events = self.scheduler.allocator.take_events()
        return None if events is None else {**events, "block_size": self.config.block_size}

    def stats(self) -> dict[str, Any]:
        """Gauges and counters; ``blocks_held`` maps each live request id to its number of KV blocks;
        ``max_num_seqs``/``max_num_batched_tokens`` are the limits in force and ``limits`` what the steps since
        they last changed did (``scheduler.LimitsRecord``)."""
        alloc = self.scheduler.allocator
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": alloc.num_blocks,
            "kv_blocks_used": alloc.num_used_blocks,
            "kv_blocks_cached_free": alloc.num_cached_free_blocks,
            "kv_cache_usage_ratio": alloc.num_used_blocks / alloc.num_blocks,
            # Blocks ever handed out: with option.kv_cache_populate=lazy the pool's pages are paid for when first
            # written, so the worker's RSS grows with this (up to the planned KV size), not with a leak.
            "kv_blocks_touched": alloc.num_touched_blocks,
            "kv_block_bytes": self._kv_block_bytes,
            "kv_cache_populate": self.config.kv_cache_populate,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "num_burst_paused_steps_total": self.scheduler.num_paused_steps,
            "itl_over_target_steps_total": self.itl.steps_over,
            "itl_over_target_seconds_total": self.itl.seconds_over,
            "prefix_cache_queries_total": alloc.prefix_queries,
            "prefix_cache_hits_total": alloc.prefix_hits,
            **self._counters,
            "max_num_seqs": self.scheduler.config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
            "limits": self.scheduler.limits.as_dict(),
            "step_cost": self.step_cost.as_dict(),
            "prefill_budget": self.prefill_budget.as_dict() if self.prefill_budget is not None else None,
            "draft_gate": self.draft_gate.as_dict() if self.draft_gate is not None else None,
            "itl_target": self.itl.as_dict(),
            "blocks_held": {s.request_id: s.num_live_blocks for s in self.scheduler.live_sequences()},
        }

