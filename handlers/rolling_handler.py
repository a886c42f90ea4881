"""The built-in rolling-batch handler: serves any transformers decoder-only model with ``LLMEngine``.

Design note: a thin adapter from the ``RollingHandler`` API (``Input`` in, ``TokenDelta`` out) to the
engine; tokenization of text prompts happens here, everything else in ``handlers.engine``. Runs in the
backend worker process, on its engine thread. Every request is checked before it is admitted (sampling
values, prompt and stop token ids inside the vocabulary): a bad one is refused alone, never left to
raise inside a step that other requests share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from handlers.base import Context, Input, RollingHandler
from handlers.embedding import EmbeddingTask, model_folder
from handlers.engine.engine import LLMEngine
from handlers.request_checks import check_prompt_ids, check_token_ids
from rollcore.sampling_ranges import check_sampling
from rollcore.tokenizer_probe import TOKENIZER_PROBE
from rollcore.types import TokenDelta


class HuggingFaceRollingHandler(RollingHandler):
    """Continuous batching over a Hugging Face model directory (``ctx.model_dir``)."""

    live_options = frozenset({"max_rolling_batch_size", "max_rolling_batch_prefill_tokens", "max_itl_ms"})

    def __init__(self) -> None:
        self._engine: LLMEngine | None = None
        self.vocab_size = 0
        self.task = EmbeddingTask("auto", "last", True)

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("initialize() has not been called")
        return self._engine

    def initialize(self, ctx: Context) -> None:
        """Load model and tokenizer and preallocate the KV cache; ``ctx.properties`` are the options."""
        # before the load: a bad value fails at once
        self.task = EmbeddingTask.from_options(ctx.properties, model_folder(ctx), decoder=True)
        self._engine = LLMEngine.from_options(ctx.model_dir, ctx.properties, ctx.device_id)
        self.vocab_size = vocab_size(self._engine.model)

    def add(self, request: Input) -> None:
        """Check, tokenize (unless token ids were given) and queue. Raises ``InvalidRequest`` for bad sampling
        values, an empty prompt, token ids outside the vocabulary, or a prompt that can never fit; an embedding
        request (``params.embed``) or a generation one that the model's ``option.task`` does not serve."""
        self.task.check(request.params.embed)
        if not request.params.embed:
            check_sampling(request.params)
            check_token_ids(request.params, self.vocab_size)
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        else:
            ids = list(self.engine.tokenizer(request.prompt)["input_ids"]) if request.prompt else []
        check_prompt_ids(ids, self.vocab_size)
        if request.params.embed:
            self.task.check_length(len(ids), self.engine.max_model_len)
            self.engine.add_embedding(request.request_id, ids, self.task.pooling, self.task.normalize)
            return
        self.engine.add(request.request_id, ids, request.params)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self._engine is not None and self._engine.has_work()

    def step(self) -> list[TokenDelta]:
        return self.engine.step()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def prefix_events(self) -> dict[str, Any] | None:
        return self.engine.prefix_events() if self._engine is not None else None

    def configure(self, options: Mapping[str, int]) -> None:
        """The engine's batch size, step token budget and inter-token latency target, from the next step on."""
        self.engine.configure(max_num_seqs=options.get("max_rolling_batch_size"),
                              max_num_batched_tokens=options.get("max_rolling_batch_prefill_tokens"),
                              max_itl_ms=options.get("max_itl_ms"))

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        """The LoRA adapters registered over the API (name -> folder), all of them: others are dropped."""
        self.engine.set_runtime_adapters(adapters)

    def healthy(self) -> bool:
        """False once a tensor-parallel rank process has exited or a follower host left (the group cannot step)."""
        group = self._engine.tp_group if self._engine is not None else None
        return group is None or group.healthy()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        tok = engine.tokenizer
        eos = sorted(engine.eos_token_ids)
        return {
            "max_model_len": engine.max_model_len,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "chat_template": getattr(tok, "chat_template", None) if isinstance(
                getattr(tok, "chat_template", None), str) else None,
            "vocab_size": self.vocab_size,
            # the frontend sends its own token ids when it encodes this probe alike (rollcore.tokenizer_probe)
            "tokenizer_probe": list(tok(TOKENIZER_PROBE)["input_ids"]),
            "block_size": engine.config.block_size,
            "num_blocks": engine.scheduler.allocator.num_blocks,
            # how the architecture was admitted: the verified list, or the load-time self-check's summary
            "admitted": engine.admitted,
            "structured_output": True,  # grammars are applied (handlers.engine.execution.decoding.grammar)
            "prompt_logprobs": True,
            "adapters": sorted(engine.lora.adapters) if engine.lora is not None else [],
            "max_loras": engine.config.max_loras if engine.lora is not None else 0,  # adapters one batch runs
            "itl_target": engine.itl.as_dict(),  # the target at load and the default measured (itl_target)
            **self.task.describe(int(engine.model.config.hidden_size)),
        }


def vocab_size(model: Any) -> int:
    """Token ids the model can read and produce: the embedding rows (and logits), capped by config."""
    rows = [int(m.num_embeddings) for m in (model.get_input_embeddings(),) if hasattr(m, "num_embeddings")]
    configured = getattr(model.config, "vocab_size", None)
    return min([*rows, *([int(configured)] if configured else [])])
