"""The engine's step clocks, wired into its scheduler at load: the fitted step cost, the time bound on a step's
prefill, the inter-token latency target and the gate on speculative guesses.

Design note: each of these reads the same ``StepFit`` (what a step of so many rows and prompt tokens costs here),
which the engine feeds after every step; the scheduler asks them how much prompt work or how many guesses a step
may carry. ``option.max_itl_ms=auto`` takes its target from a decode step of a full batch timed now
(``handlers.engine.execution.itl_calibration``); under tensor parallelism, where the other ranks step only with the
engine, nothing is timed at load and the target comes from the first fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handlers.engine.core.draft_gate import DraftGate, DraftOdds
from handlers.engine.core.itl_target import ItlTarget
from handlers.engine.core.scheduler import Scheduler
from handlers.engine.core.sequence import Sequence
from handlers.engine.core.step_budget import PrefillBudget, StepFit
from handlers.engine.execution.itl_calibration import calibrate
from handlers.engine.planning.engine_config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepTiming:
    step_fit: StepFit  # what a step costs, fitted over the steps run: prices prefill tokens and guessed rows
    prefill_budget: PrefillBudget | None  # the prefill a step may carry while sequences decode (core.step_budget)
    itl: ItlTarget  # the inter-token latency target (core.itl_target)
    draft_gate: DraftGate | None  # speculative_max_batch_size=auto: the guesses' cost decides who guesses


def time_steps(config: EngineConfig, scheduler: Scheduler, execute: Callable[..., Any],
               drafter: Callable[[Sequence], list[int]], calibrate_now: bool) -> StepTiming:
    """Build the clocks for ``config`` and hand ``scheduler`` its bounds (and ``drafter`` with n-gram speculative
    decoding). ``execute``: the runner's step, timed here when ``calibrate_now``."""
    step_fit = StepFit()
    prefill_budget = None
    if config.max_mixed_step_ratio:
        prefill_budget = PrefillBudget(config.max_mixed_step_ratio, floor=config.block_size, fit=step_fit)
        scheduler.prefill_limit = prefill_budget.limit
    itl = ItlTarget(step_fit, floor=config.block_size, target_ms=config.max_itl_ms, full_batch=config.max_num_seqs)
    scheduler.itl_budget = itl.prefill_tokens
    decode_s = calibrate(execute, scheduler.allocator, config.max_num_seqs, step_fit) if calibrate_now else None
    if decode_s is not None:
        itl.derive(decode_s)
    draft_gate = None
    if config.speculative_draft == "ngram":
        scheduler.drafter = drafter
        if config.speculative_max_batch_size is None:  # auto: the guesses' cost decides
            draft_gate = DraftGate(step_fit, DraftOdds(config.num_speculative_tokens))
            scheduler.draft_length = draft_gate
        logger.info("speculative decoding: n-gram prompt lookup, up to %d tokens a step (n-grams of %d-%d) %s",
                    config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                    "while the step cost says they pay" if draft_gate else
                    f"while at most {config.speculative_max_batch_size or 'any number of'} sequences decode")
    return StepTiming(step_fit, prefill_budget, itl, draft_gate)
