"""Which sequences run at the next step, and with how many tokens. Pure Python, no torch.

Design note (policy only; the runner is the mechanism): every step first gives each running sequence
its next token(s) -- one for a decode, a chunk for an unfinished prefill -- then admits waiting
requests first-come-first-served while the step stays within ``max_num_batched_tokens`` and the batch
within ``max_num_seqs``. Long prompts are split across steps (chunked prefill) so decodes keep flowing.
When more requests wait for their first token than sequences decode, their prompts take more than two steps
and the streams have many tokens left (a burst), the decodes wait while those prompts are prefilled
(``burst_prefill_first``): each running stream pauses once, for the burst, instead of at every step that
carries a piece of it, and no decode row shares the burst's steps. Requests that arrive after a burst began do
not extend it, and a step that could prefill nothing decodes instead. A burst pays only where the streams are
likely to write many more tokens: that guess comes from what they wrote so far (``itl_target.tokens_left_guess``),
never from the client's ``max_tokens``.
With an inter-token latency target in force (``itl_budget``: ``handlers.engine.core.itl_target``) every step
that has running streams keeps them in it (no burst pause), and the prompt work beside them is what the fitted
step cost says fits the target, at least a floor so that first tokens keep coming in admission order; prompts
larger than that are chunked over steps. The token cap and the time ratio then step aside.
A request is admitted only when its blocks fit; when a running sequence cannot get a block, the newest
running sequence is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed from its tokens later. When every layer of the model attends within one sliding window,
blocks that fell wholly out of it are freed after each step (as vLLM does): a long sequence then holds
about window / block_size blocks instead of its whole length.

``set_limits`` changes ``max_num_seqs`` and ``max_num_batched_tokens`` of a live scheduler; the next
``schedule`` plans with them. A batch size lowered below the running count admits nothing until fewer than
the new limit run; no sequence is preempted to comply. ``LimitsRecord`` tells what the steps since the last
change did (how many they admitted, the largest running batch an admitting step left), so a caller can see
that a change took effect at the next step.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

from handlers.engine.core.itl_target import tokens_left_guess
from handlers.engine.core.kv_cache import BlockAllocator, block_key, root_key
from handlers.engine.core.schedule_plan import LimitsRecord, ScheduledChunk, SchedulerConfig, SchedulerOutput
from handlers.engine.core.sequence import FREED_BLOCK, Sequence, SequenceStatus
from rollcore.errors import InvalidRequest

# a burst pauses streams with at least this many tokens left on average: one stall is then under 1% of their gaps
PAUSE_MIN_TOKENS_LEFT = 100


class Scheduler:
    """FCFS continuous-batching scheduler with chunked prefill, prefix caching and recompute preemption."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_schedules = 0
        self.limits = LimitsRecord()
        # Speculative decoding: guesses of a decoding sequence's next tokens (the engine's drafter; None: off).
        self.drafter: Callable[[Sequence], list[int]] | None = None
        # decode rows planned -> guesses each may carry (the engine's cost gate); None: as many as the budget allows
        self.draft_length: Callable[[int], int] | None = None
        # (decode rows planned with their guesses, token cap, requests waiting for a first token, sequences
        # decoding) -> prefill tokens allowed beside the decode rows (0: no cap); None: the cap alone
        self.prefill_limit: Callable[[int, int, int, int], int] | None = None
        # decode rows planned -> prompt tokens a step may add under the inter-token latency target; it returns
        # None while no target is in force (off, or the step cost not fitted yet); None: no target at all
        self.itl_budget: Callable[[int], int | None] | None = None
        self._burst: set[str] = set()  # request ids of the burst being prefilled while decodes wait
        self.num_paused_steps = 0  # steps that prefilled a burst while sequences waited to decode

    def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the batch size and the token budget of the coming steps (None keeps a value). Sequences
        already running keep running; the next ``schedule`` admits under the new limits."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.config = replace(self.config,
                              max_num_seqs=self.config.max_num_seqs if max_num_seqs is None else max_num_seqs,
                              max_num_batched_tokens=self.config.max_num_batched_tokens
                              if max_num_batched_tokens is None else max_num_batched_tokens)
        self.limits = LimitsRecord(changes=self.limits.changes + 1, changed_at_schedule=self.num_schedules,
                                   running_at_change=len(self.running), waiting_at_change=len(self.waiting))

    # --------------------------------------------------------------- requests
    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Raises ``InvalidRequest`` if it could never run."""
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def check(self, seq: Sequence) -> None:
        """Raise ``InvalidRequest`` if ``seq`` could never run (``add`` calls it)."""
        cfg = self.config
        if seq.request_id in self._by_id:
            raise InvalidRequest(f"request id {seq.request_id!r} is already in the engine")
        if seq.num_prompt_tokens == 0:
            raise InvalidRequest("the prompt is empty")
        total = seq.max_total_tokens
        if total > cfg.max_model_len:
            raise InvalidRequest(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_new_tokens ({seq.params.max_new_tokens}) = "
                f"{total} tokens exceeds the model's maximum length of {cfg.max_model_len} tokens")
        capacity = cfg.num_blocks * cfg.block_size
        if total > capacity:
            raise InvalidRequest(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_new_tokens ({seq.params.max_new_tokens}) = "
                f"{total} tokens can never fit in the KV cache of {capacity} tokens")

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running request and free its blocks now. Returns it, or None if unknown."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.finish(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Mark a sequence finished, drop it from the batch and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        self._by_id.pop(seq.request_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    # ------------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Never exceeds the token budget or the batch size; while decodes run (or wait for a
        burst), prefill chunks take at most ``max_prefill_tokens_while_decoding`` of it (0 = no such cap), or what
        ``prefill_limit`` makes of that cap given the decode rows (the engine's time bound)."""
        budget = self.config.max_num_batched_tokens
        planned: dict[int, ScheduledChunk] = {}  # id(seq) -> chunk
        preempted: list[str] = []
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        # under a target a pause only lengthens the streams' gap (a mixed step carries more prompt in the same gap),
        # and a prompt's last token is priced as the row it is
        first = self.config.burst_prefill_first and not self._itl_in_force()
        for s in self.running:  # a prompt with one token left is still a burst's, not a stream that waits for it
            left = s.num_tokens - s.num_computed_tokens
            (prefills if left > 1 or (first and s.num_output_tokens == 0) else decodes).append(s)
        paused = first and bool(decodes) and self._in_burst(decodes, prefills)
        if not paused:
            budget = self._plan_decodes(decodes, planned, preempted, budget)
        prefill_budget = budget
        if planned or paused:  # a long prefill chunk stalls every running decode for its whole step (ITL)
            rows = len(decodes) if paused else self.config.max_num_batched_tokens - budget
            prefill_budget = self._prefill_cap(rows, budget, decodes, prefills)
        for seq in prefills:
            if seq.status is not SequenceStatus.RUNNING or prefill_budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, prefill_budget)
            if self._plan(seq, n, planned, preempted):
                prefill_budget -= n
        admitted = 0
        if not preempted:
            while self.waiting and prefill_budget > 0 and len(self.running) < self.config.max_num_seqs:
                chunk = self._admit(self.waiting[0], prefill_budget)
                if chunk is None:
                    break
                self.waiting.popleft()
                planned[id(chunk.seq)] = chunk
                prefill_budget -= chunk.num_tokens
                admitted += 1
        if paused:
            if planned:
                self.num_paused_steps += 1
            else:  # no prompt could move (blocks): the streams must not wait on it
                self._plan_decodes(decodes, planned, preempted, budget)
        self._record(admitted)
        return SchedulerOutput(tuple(planned.values()), tuple(preempted))

    def _prefill_cap(self, rows: int, budget: int, decodes: list[Sequence], prefills: list[Sequence]) -> int:
        """Prompt tokens a step may prefill beside ``rows`` decode rows: the token cap, or the time bound made of
        it (``prefill_limit``; waiting: the requests without their first token yet), within ``budget``; under an
        inter-token latency target, what fits it (``itl_budget``) instead."""
        if self.itl_budget is not None and rows:
            fits = self.itl_budget(rows)
            if fits is not None:
                return min(budget, fits)
        cap = self.config.max_prefill_tokens_while_decoding
        if self.prefill_limit is not None:
            cap = self.prefill_limit(rows, cap, len(self.waiting) + len(prefills), len(decodes))
        return min(budget, cap) if cap else budget

    def _itl_in_force(self) -> bool:
        """Whether an inter-token latency target bounds the steps that decode now."""
        return self.itl_budget is not None and self.itl_budget(1) is not None

    def _in_burst(self, decodes: list[Sequence], prefills: list[Sequence]) -> bool:
        """Whether the decodes wait this step: a burst starts when more requests wait for a first token (those a
        free batch slot can take, and those part-way through their prompt) than sequences decode and the pause
        pays (``_pause_pays``), and lasts until each of its requests has its first token (or left); later
        arrivals are not part of it."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        waiting = list(itertools.islice(self.waiting, free)) + prefills
        if self._burst:
            self._burst.intersection_update(s.request_id for s in waiting)
        elif len(waiting) > len(decodes) and self._pause_pays(decodes, prefills, waiting):
            self._burst = {s.request_id for s in waiting}
        return bool(self._burst)

    def _pause_pays(self, decodes: list[Sequence], prefills: list[Sequence], burst: list[Sequence]) -> bool:
        """A pause turns the stalls a burst puts into each stream (one a step carrying its prompts) into one
        longer stall. That pays where the streams have many gaps left, so that one stall each stays outside the
        inter-token latency's 99th percentile (short answers spend a larger share of their gaps on it, and their
        decode steps cost more apart than beside the prompts), and where the prompts take more than two steps
        at the prefill cap (fewer stall each stream as often either way, and for less beside them)."""
        left = sum(tokens_left_guess(s, self.config.max_model_len) for s in decodes) / len(decodes)
        if left < PAUSE_MIN_TOKENS_LEFT:
            return False
        tokens = sum(s.num_tokens - s.num_computed_tokens for s in burst)
        return tokens > 2 * self._prefill_cap(len(decodes), self.config.max_num_batched_tokens, decodes, prefills)

    def _plan_decodes(self, decodes: list[Sequence], planned: dict[int, ScheduledChunk], preempted: list[str],
                      budget: int) -> int:
        """One row for each decoding sequence, then the drafter's guesses; returns the budget left."""
        for seq in decodes:
            if seq.status is SequenceStatus.RUNNING and budget > 0 and self._plan(seq, 1, planned, preempted):
                budget -= 1
        if self.drafter is not None and budget > 0 and len(decodes) <= self.config.max_speculative_batch:
            per_seq = budget if self.draft_length is None else self.draft_length(len(decodes))
            if per_seq > 0:
                budget = self._add_drafts(decodes, planned, budget, per_seq)
        return budget

    def _add_drafts(self, decodes: list[Sequence], planned: dict[int, ScheduledChunk], budget: int,
                    per_seq: int) -> int:
        """Extend the planned decodes with the drafter's guesses, at most ``per_seq`` each, within the token
        budget and the free blocks beyond one per running sequence (a guess never preempts anyone). Returns the
        budget left."""
        assert self.drafter is not None
        bs = self.config.block_size
        spare = self.allocator.num_free_blocks - len(self.running)
        for seq in decodes:
            chunk = planned.get(id(seq))
            if chunk is None or budget <= 0:
                continue
            draft = self.drafter(seq)[:min(budget, per_seq)]
            # positions start .. start + len(draft) must have slots: the blocks held plus the spare ones
            room = (len(seq.block_ids) + max(0, spare)) * bs - chunk.start - 1
            draft = draft[:max(0, room)]
            if not draft:
                continue
            need = self._blocks_needed(seq, 1 + len(draft))
            self.allocator.allocate(seq.block_ids, need)
            spare -= need
            planned[id(seq)] = replace(chunk, draft=tuple(draft))
            budget -= len(draft)
        return budget

    def _record(self, admitted: int) -> None:
        self.num_schedules += 1
        record = self.limits
        if not record.changes:
            return
        if record.first_step_admitted is None:
            record.first_step_admitted = admitted
        if admitted:
            record.admitted_since_change += admitted
            record.peak_running_admitting = max(record.peak_running_admitting, len(self.running))

    def _plan(self, seq: Sequence, n: int, planned: dict[int, ScheduledChunk], preempted: list[str]) -> bool:
        """Plan ``n`` tokens of a running sequence (preempting others for blocks if needed)."""
        if not self._grow_or_preempt(seq, n, planned, preempted):
            return False
        planned[id(seq)] = ScheduledChunk(seq, seq.num_computed_tokens, n)
        return True

    def commit(self, output: SchedulerOutput) -> None:
        """Record that the planned chunks' KV is now computed (call after the model step; confirmed guesses
        are added by ``accept_draft``)."""
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self._computed(seq)

    def accept_draft(self, seq: Sequence, num_tokens: int) -> None:
        """The first ``num_tokens`` guesses of ``seq``'s last chunk were confirmed and are now among its tokens:
        their KV (written by that step) counts as computed."""
        if seq.status is SequenceStatus.RUNNING and num_tokens > 0:
            seq.num_computed_tokens += num_tokens
            assert seq.num_computed_tokens < seq.num_tokens, "a confirmed guess beyond the sequence's tokens"
            self._computed(seq)

    def _computed(self, seq: Sequence) -> None:
        """Register the blocks ``num_computed_tokens`` filled (prefix cache); free what left the window."""
        bs = self.config.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else _root(seq)
            key = block_key(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(key)
            self.allocator.register_full_block(seq.block_ids[i], key)
        if self.config.sliding_window:
            self._free_out_of_window(seq)

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Free the blocks no future query of ``seq`` can see: every later token is at a position
        >= num_computed_tokens and reads keys from (position - window, position]. (They are full and
        registered, so with prefix caching they stay reusable until evicted.)"""
        first_needed = max(0, seq.num_computed_tokens - self.config.sliding_window + 1) // self.config.block_size
        for i in range(seq.num_freed_blocks, min(first_needed, len(seq.block_ids))):
            self.allocator.free([seq.block_ids[i]])
            seq.block_ids[i] = FREED_BLOCK
            seq.num_freed_blocks = i + 1

    # ---------------------------------------------------------------- helpers
    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.config.block_size) - len(seq.block_ids))

    def _grow_or_preempt(self, seq: Sequence, n: int, planned: dict[int, ScheduledChunk],
                         preempted: list[str]) -> bool:
        """Give ``seq`` blocks for ``n`` more tokens, preempting the newest running sequences if needed.
        Returns False if ``seq`` itself had to be preempted."""
        need = self._blocks_needed(seq, n)
        while need > self.allocator.num_free_blocks:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            planned.pop(id(victim), None)
            if victim is seq:
                return False
        self.allocator.allocate(seq.block_ids, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_ids[seq.num_freed_blocks:])
        seq.block_ids = []
        seq.num_freed_blocks = 0
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """Start (or restart) ``seq`` with a first chunk of at most ``budget`` tokens, if its blocks fit."""
        alloc = self.allocator
        # At least the last token is always computed so that its logits can be sampled; a request that wants
        # its prompt's log-probabilities, or an embedding pooled over more than the last row, computes the whole
        # prompt (a cached block holds KV, not logits or hidden states).
        whole = seq.params.prompt_logprobs is not None or seq.pooling not in (None, "last")
        reusable = 0 if whole else seq.num_tokens - 1
        cached, keys = alloc.match_prefix(seq.token_ids, reusable, _root(seq))
        num_cached_tokens = len(cached) * self.config.block_size
        n = min(seq.num_tokens - num_cached_tokens, budget)
        total_blocks = -(-(num_cached_tokens + n) // self.config.block_size)
        reused_free = sum(1 for b in cached if alloc.ref_count(b) == 0)
        if total_blocks - len(cached) + reused_free > alloc.num_free_blocks:
            return None
        alloc.acquire(cached)
        seq.block_ids = list(cached)
        seq.block_hashes = list(keys)
        alloc.allocate(seq.block_ids, total_blocks - len(cached))
        seq.num_computed_tokens = num_cached_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return ScheduledChunk(seq, num_cached_tokens, n)


def _root(seq: Sequence) -> bytes | None:
    """The parent key of ``seq``'s first block: its adapter and cache salt (``rollcore.prefix_keys.root_key``)."""
    return root_key(seq.params.adapter, seq.params.cache_salt)
