"""Embeddings outside the rolling engine: what a model's ``option.task`` / ``option.pooling`` mean, the pooling of
a batch's final hidden states, and ``EmbeddingHandler``, the dynamic-batching handler of ``option.task=embedding``.

Design note: an embedding is the model's final hidden states (after its last norm) pooled over the prompt: the last
token's (vLLM's default for decoders), the mean over the prompt's tokens (sentence-transformers' usual, the default
for encoders) or the first token's (cls), L2-normalised unless a sentence-transformers folder leaves its
``Normalize`` module out. A sentence-transformers folder (``modules.json``) says its pooling and normalisation and
``sentence_bert_config.json`` its longest input; ``option.pooling`` overrides the pooling. ``EmbeddingHandler``
loads any ``AutoModel`` (BERT-like encoders and decoders alike) and runs a batch right-padded in one forward with
its attention mask: a causal model's real tokens never see the padding after them and their positions start at 0,
an encoder's mask hides it, so a prompt's vector is the same alone or in a batch. ``Embedder`` does the same for
the dynamic generation handler's decoder (its ``base_model``). Every bad item fails alone.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.base import Context, Handler, Input, Output
from handlers.request_checks import check_prompt_ids
from rollcore.errors import InvalidRequest, ServingError
from rollcore.model_folder import read_json_object, weights_folder
from rollcore.options import option_value
from rollcore.values import AUTO

log = logging.getLogger(__name__)

# sentence-transformers' pooling modes -> ours (their ``pooling_mode``, and the older boolean keys)
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def sentence_transformers_pooling(folder: Path) -> tuple[str, bool, int | None] | None:
    """(pooling, normalize, max_seq_length) of a sentence-transformers folder, or None for another folder. Raises
    ``ValueError`` for a pooling this server does not compute (max, weighted mean, several modes at once)."""
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(modules, list):
        return None
    types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules if isinstance(m, dict)]
    pooling_dirs = [path for kind, path in types if kind.endswith("Pooling")]
    if not pooling_dirs:
        return None
    config = read_json_object(folder / pooling_dirs[0] / "config.json")
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [ours for key, ours in _ST_LEGACY.items() if config.get(key)]
        extra = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_LEGACY]
        mode = modes[0] if len(modes) == 1 and not extra else None
    else:
        mode = _ST_MODES.get(mode) if isinstance(mode, str) else None
    if mode is None:
        raise ValueError(f"the sentence-transformers pooling {config.get('pooling_mode') or config} is not one this "
                         "server computes (mean, cls or lasttoken); set option.pooling to override it")
    max_len = read_json_object(folder / "sentence_bert_config.json").get("max_seq_length")
    normalize = any(kind.endswith("Normalize") for kind, _ in types)
    return mode, normalize, max_len if isinstance(max_len, int) and max_len > 0 else None


def model_folder(ctx: Context) -> Path:
    """Where the weights are (``rollcore.model_folder.weights_folder`` of ``option.model_id``)."""
    return weights_folder(ctx.model_dir, ctx.option("model_id"))


@dataclass(frozen=True, slots=True)
class EmbeddingTask:
    """What a model serves (``option.task``: auto = generation and embeddings, generate, embedding) and how it
    embeds (``pooling``, ``normalize``); ``max_len`` caps an embedded prompt when its folder says so."""

    task: str
    pooling: str
    normalize: bool
    max_len: int | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str], folder: Path, decoder: bool) -> EmbeddingTask:
        """The options and the folder's sentence-transformers config (if any). Raises ``ValueError``."""
        task = option_value(options, "task")
        pooling = option_value(options, "pooling")
        found = None
        if task != "generate":
            try:
                found = sentence_transformers_pooling(folder)
            except ValueError:
                if pooling == AUTO:
                    raise
                found = (pooling, True, None)  # the option names the pooling; the folder's normalisation is unread
        if found is None:
            found = ("last" if decoder else "mean", True, None)
        return cls(task, found[0] if pooling == AUTO else pooling, found[1], found[2])

    @property
    def embeds(self) -> bool:
        return self.task != "generate"

    @property
    def generates(self) -> bool:
        return self.task != "embedding"

    def check(self, embed: bool) -> None:
        """Refuse a request of a kind the model does not serve. Raises ``InvalidRequest`` naming the task."""
        if embed and not self.embeds:
            raise InvalidRequest("this model serves option.task=generate: it computes no embeddings")
        if not embed and not self.generates:
            raise InvalidRequest("this model serves option.task=embedding: it generates no text (POST /v1/embeddings)")

    def check_length(self, num_tokens: int, max_model_len: int) -> None:
        limit = min(max_model_len, self.max_len or max_model_len)
        if num_tokens > limit:
            raise InvalidRequest(f"'input' has {num_tokens} tokens; the model embeds at most {limit} "
                                 "(max_model_len)")

    def describe(self, size: int) -> dict[str, Any]:
        """The facts the frontend routes by (``tasks``) and the embeddings route answers with."""
        tasks = [t for t, on in (("generate", self.generates), ("embedding", self.embeds)) if on]
        out: dict[str, Any] = {"tasks": tasks}
        if self.embeds:
            out["embedding"] = {"size": size, "pooling": self.pooling, "normalize": self.normalize}
        return out


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """[B, T, H] final hidden states of right-padded rows, their mask [B, T] -> [B, H] fp32 vectors."""
    hidden = hidden.float()
    if pooling == "cls":
        out = hidden[:, 0]
    elif pooling == "last":
        out = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    else:
        weights = mask[..., None].to(hidden.dtype)
        out = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


class Embedder:
    """Embeds a batch with ``body`` (a model whose output has ``last_hidden_state``)."""

    def __init__(self, body: Any, tokenizer: Any, task: EmbeddingTask, max_model_len: int, vocab_size: int) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.task = task
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0  # masked (encoders) or after the real tokens (decoders)

    def prompt_ids(self, item: Input) -> list[int]:
        """The item's token ids, checked. Raises ``InvalidRequest``."""
        if item.prompt_token_ids:
            ids = list(item.prompt_token_ids)
        elif not item.prompt:
            raise InvalidRequest("'input' must not be empty")
        else:
            ids = list(self.tokenizer(item.prompt)["input_ids"])
        check_prompt_ids(ids, self.vocab_size)
        self.task.check_length(len(ids), self.max_model_len)
        return ids

    def embed(self, items: Sequence[Input]) -> list[Output]:
        """One ``Output`` per item, in order: its vector, or its own failure."""
        outputs: list[Output | None] = [None] * len(items)
        rows: list[tuple[int, list[int]]] = []
        for k, item in enumerate(items):
            try:
                rows.append((k, self.prompt_ids(item)))
            except ServingError as exc:
                outputs[k] = Output.failure(item.request_id, exc.message, exc.kind)
        if rows:
            try:
                vectors = self._forward([ids for _, ids in rows])
                for (k, ids), vector in zip(rows, vectors, strict=True):
                    outputs[k] = Output(request_id=items[k].request_id, prompt_tokens=len(ids),
                                        embedding=tuple(vector.tolist()))
            except Exception as exc:  # noqa: BLE001 - the batch's embeddings fail, never the worker
                log.exception("embedding forward failed on a batch of %d", len(rows))
                for k, _ in rows:
                    outputs[k] = Output.failure(items[k].request_id, f"embedding failed: {type(exc).__name__}: {exc}")
        return [o for o in outputs if o is not None]

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[j, :len(r)] = 1
        device = next(self.body.parameters()).device
        with torch.inference_mode():
            out = self.body(input_ids=ids.to(device), attention_mask=mask.to(device))
        return pool(out.last_hidden_state, mask.to(device), self.task.pooling, self.task.normalize).cpu()


def is_decoder(config: Any) -> bool:
    """A causal language model's config (its last-token default pooling), as against an encoder's."""
    archs = getattr(config, "architectures", None) or ()
    return bool(getattr(config, "is_decoder", False)) or any(str(a).endswith("ForCausalLM") for a in archs)


class EmbeddingHandler(Handler):
    """``option.task=embedding`` on dynamic batching: any ``AutoModel`` folder (an encoder such as BERT, or a
    decoder), its embeddings only. Options: ``pooling``, ``dtype``, ``max_model_len``, ``num_threads``,
    ``trust_remote_code``, ``allow_unsafe_weights``, ``model_id``."""

    def __init__(self) -> None:
        self.embedder: Embedder | None = None
        self.max_model_len = 0
        self.size = 0

    def initialize(self, ctx: Context) -> None:
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from handlers.engine.planning.cpu import auto_threads
        from handlers.huggingface import DTYPES

        threads = option_value(ctx.properties, "num_threads")
        torch.set_num_threads(auto_threads(int(ctx.option("maxWorkers") or 1)) if threads == AUTO else threads)
        folder = model_folder(ctx)
        trust = option_value(ctx.properties, "trust_remote_code")
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
        task = EmbeddingTask.from_options(ctx.properties, folder, is_decoder(config))
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
        model = AutoModel.from_pretrained(folder, dtype=DTYPES[option_value(ctx.properties, "dtype")],
                                          trust_remote_code=trust,
                                          use_safetensors=not option_value(ctx.properties, "allow_unsafe_weights"))
        if ctx.device_id >= 0 and torch.cuda.is_available():
            model.to(f"cuda:{ctx.device_id}")
        model.eval()
        limit = getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length
        self.max_model_len = option_value(ctx.properties, "max_model_len") or min(int(limit), task.max_len or 1 << 30)
        self.size = int(config.hidden_size)
        vocab = int(getattr(config, "vocab_size", None) or len(tokenizer))
        self.embedder = Embedder(model, tokenizer, task, self.max_model_len, vocab)
        log.info("model %s: embeddings of %s (%s pooling%s, %d dimensions, max_model_len=%d)", ctx.model_name,
                 type(model).__name__, task.pooling, ", normalized" if task.normalize else "", self.size,
                 self.max_model_len)

    def handle(self, inputs: Sequence[Input]) -> list[Output]:
        assert self.embedder is not None, "initialize() has not been called"
        outputs: list[Output | None] = [None] * len(inputs)
        embeds: list[int] = []
        for k, item in enumerate(inputs):
            try:
                self.embedder.task.check(item.params.embed)
                embeds.append(k)
            except ServingError as exc:
                outputs[k] = Output.failure(item.request_id, exc.message, exc.kind)
        for k, out in zip(embeds, self.embedder.embed([inputs[k] for k in embeds]), strict=True):
            outputs[k] = out
        return [o for o in outputs if o is not None]

    def describe(self) -> dict[str, Any]:
        assert self.embedder is not None, "initialize() has not been called"
        return {"max_model_len": self.max_model_len, "vocab_size": self.embedder.vocab_size, "chat_template": None,
                **self.embedder.task.describe(self.size)}
