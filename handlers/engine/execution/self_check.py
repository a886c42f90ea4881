"""The load-time self-check: an architecture off the verified list is served only when the engine reproduces
transformers' own forward on it.

Design note: runs in the worker, inside ``LLMEngine.__init__`` (it needs the weights), in two halves around
the ``ModelRunner``'s construction. Before it, ``reference_logits`` runs the untouched model (same object,
eager attention, the model's dtype: fp32 unless option.dtype says otherwise) over a few fixed sequences, one
forward each, no cache; after it (paged attention plugged in, projections fused or prepacked, the lean
decoder chosen), ``verify`` feeds the same tokens through the runner's paged path: each prompt's prefill in
two or more chunks, then ``DECODE_STEPS`` decode steps of fixed tokens (teacher-forced, so both sides see the
same sequence whatever either would pick), its blocks taken in reverse order from the end of the pool, and
compares every sampled row. The sequences are ``len(PROMPT_LENGTHS)`` prompts of token ids drawn from the
vocabulary with a fixed seed; when the config has a sliding window (any layer) that ``max_model_len`` lets
a sequence exceed, the longest prompt is replaced by one that crosses it.

Tolerance: a row agrees when its largest absolute difference is at most ``RTOL`` (1e-3 in fp32, 5e-2 in
reduced precision) times the reference row's scale (its largest absolute logit, at least 1), and its argmax
(the greedy token) is the reference's, unless the reference's two best logits are within twice that
tolerance (a tie at the tolerance). The first row that does not agree refuses the model with the prompt,
the step and the difference named. Cost: one reference forward per prompt plus about
``len(PROMPT_LENGTHS) * (2 + DECODE_STEPS)`` engine forwards: nothing for a tiny model, a few forward passes'
time for a big one.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from handlers.engine.execution.forward.runner import ModelRunner, StepInputs
from handlers.engine.planning.families import UnsupportedModel, needs_self_check

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (5, 12, 23)
DECODE_STEPS = 4
SEED = 0
RTOL = {torch.float32: 1e-3}
RTOL_REDUCED = 5e-2  # bf16/fp16: the engine's and transformers' kernels round differently


@dataclass(frozen=True, slots=True)
class ProbeSequence:
    """One probe: ``prompt`` is prefilled in ``chunks`` (sizes), then ``decode`` is fed one token a step."""

    prompt: list[int]
    decode: list[int]
    chunks: list[int]

    @property
    def rows(self) -> list[tuple[str, int]]:
        """``(label, position)`` of every compared row: each prefill chunk's last, then each decode step's."""
        out, end = [], 0
        for n in self.chunks:
            end += n
            out.append((f"prefill (through position {end - 1})", end - 1))
        out += [(f"decode step {k + 1}", len(self.prompt) + k) for k in range(len(self.decode))]
        return out


@dataclass(frozen=True, slots=True)
class Probe:
    """The sequences and the reference logits (one [rows, vocab] tensor per sequence)."""

    sequences: list[ProbeSequence]
    reference: list[torch.Tensor]
    window: int  # the sliding window the longest prompt crosses, 0 when none

    def describe(self, max_diff: float) -> str:
        crossed = f", crossing the {self.window}-token sliding window" if self.window else ""
        return (f"load-time self-check ({len(self.sequences)} prompts, {DECODE_STEPS} decode steps each{crossed}, "
                f"max diff {max_diff:.2g})")


def probe_sequences(vocab: int, max_len: int, pool_tokens: int, chunk_tokens: int, window: int,
                    seed: int = SEED) -> tuple[list[ProbeSequence], int]:
    """The probe's sequences and the window the longest one crosses (0 when none does): prompt lengths
    ``PROMPT_LENGTHS`` (the longest replaced by ``window + 12`` when the window is shorter than what the
    engine allows), capped so that prompt and decode tokens fit ``max_len`` and the KV pool."""
    room = max(2, min(max_len, pool_tokens) - DECODE_STEPS)
    lengths = list(PROMPT_LENGTHS)
    crossed = 0
    if window and window + DECODE_STEPS + 1 < min(max_len, pool_tokens):
        lengths[-1] = max(lengths[-1], min(window + 12, room))
        crossed = window if lengths[-1] + DECODE_STEPS > window + 1 else 0
    lengths = sorted({max(1, min(n, room)) for n in lengths})
    rng = random.Random(seed)
    out = []
    for n in lengths:
        prompt = [rng.randrange(vocab) for _ in range(n)]
        decode = [rng.randrange(vocab) for _ in range(DECODE_STEPS)]
        first = max(1, min(chunk_tokens, -(-n // 2)))  # a chunk boundary inside every prompt longer than 1
        chunks = [first]
        while sum(chunks) < n:
            chunks.append(min(chunk_tokens, n - sum(chunks)))
        out.append(ProbeSequence(prompt, decode, chunks))
    return out, crossed


def config_window(config: Any) -> int:
    """The config's sliding window (any layer), 0 when it has none."""
    window = getattr(config, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else 0


def model_vocab(model: torch.nn.Module, tokenizer: Any) -> int:
    """Token ids both the tokenizer and the model know."""
    sizes = [int(getattr(model.config, "vocab_size", 0) or 0)]
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    sizes.append(int(getattr(embeddings, "num_embeddings", 0) or 0))
    try:
        sizes.append(len(tokenizer))
    except TypeError:
        pass
    return max(1, min(s for s in sizes if s > 0))


@torch.inference_mode()
def reference_logits(model: Any, tokenizer: Any, max_len: int, pool_tokens: int, chunk_tokens: int) -> Probe:
    """Transformers' own logits on the probe sequences: the model as loaded, eager attention, no cache.
    Call before the ``ModelRunner`` plugs its attention in (and fuses or prepacks weights)."""
    sequences, window = probe_sequences(model_vocab(model, tokenizer), max_len, pool_tokens, chunk_tokens,
                                        config_window(model.config))
    try:
        model.set_attn_implementation("eager")
    except (ValueError, NotImplementedError) as exc:
        raise UnsupportedModel(f"the load-time self-check cannot run transformers' eager attention ({exc})") from None
    model.eval()
    reference = []
    for seq in sequences:
        ids = seq.prompt + seq.decode
        keep = torch.tensor([p for _, p in seq.rows], dtype=torch.long)
        out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids)).unsqueeze(0),
                    use_cache=False, logits_to_keep=keep)
        reference.append(out.logits[0].float())
    return Probe(sequences, reference, window)


def probe_unverified(model: Any, tokenizer: Any, tensor_parallel: bool, max_len: int, pool_tokens: int,
                     chunk_tokens: int) -> tuple[str, Probe | None]:
    """The architecture's name, and for one off the verified list its ``reference_logits`` (None for a verified
    one). The self-check runs on one rank only: an unverified architecture under tensor parallelism is refused."""
    model_type = str(getattr(model.config, "model_type", "") or "")
    arch = f"{type(model).__name__} (model_type={model_type})"
    if not needs_self_check(model_type):
        return arch, None
    if tensor_parallel:
        raise UnsupportedModel(f"{arch}: tensor parallelism serves verified architectures only")
    return arch, reference_logits(model, tokenizer, max_len, pool_tokens, chunk_tokens)


def verify(runner: ModelRunner, probe: Probe, arch: str) -> str:
    """Run the probe through the runner's paged path and compare with the reference; returns the admission
    text (``Probe.describe``) or raises ``UnsupportedModel`` naming the first row that differs."""
    started = time.perf_counter()
    bs = runner.block_size
    worst = 0.0
    rtol = RTOL.get(next(runner.model.parameters()).dtype, RTOL_REDUCED)
    for i, (seq, ref) in enumerate(zip(probe.sequences, probe.reference, strict=True)):
        ids = seq.prompt + seq.decode
        table = [runner.num_blocks - 1 - b for b in range(-(-len(ids) // bs))]  # reversed: slots are not positions

        def step(start: int, n: int, ids: list[int] = ids, table: list[int] = table) -> StepInputs:
            positions = list(range(start, start + n))
            return StepInputs(ids[start:start + n], positions, [table[p // bs] * bs + p % bs for p in positions],
                              [(0, start, n, table[:-(-(start + n) // bs)])], [n - 1])

        steps, start = [], 0
        for n in seq.chunks:
            steps.append(step(start, n))
            start += n
        steps += [step(len(seq.prompt) + k, 1) for k in range(len(seq.decode))]
        for row, (inputs, (label, _)) in enumerate(zip(steps, seq.rows, strict=True)):
            got = runner.forward(inputs)[0].float()
            want = ref[row]
            diff = float((got - want).abs().max())
            tol = rtol * max(1.0, float(want.abs().max()))
            where = f"prompt {i + 1} ({len(seq.prompt)} tokens) {label}"
            if not diff <= tol:  # NaN fails too
                raise UnsupportedModel(f"{arch} is not on the verified list and failed the load-time self-check: "
                                       f"{where} logits differ by {diff:.3g} (tolerance {tol:.2g})")
            mine, theirs = int(got.argmax()), int(want.argmax())
            if mine != theirs and float(want[theirs] - want[mine]) > 2 * tol:
                raise UnsupportedModel(f"{arch} is not on the verified list and failed the load-time self-check: "
                                       f"{where} greedy token {mine} differs from transformers' {theirs} (logits "
                                       f"differ by {diff:.3g}, tolerance {tol:.2g})")
            worst = max(worst, diff)
    admitted = probe.describe(worst)
    logger.info("%s: admitted by the %s in %.1f s", arch, admitted, time.perf_counter() - started)
    return admitted
