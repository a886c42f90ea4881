"""HuggingFaceHandler: dynamic-batching text generation with transformers.

Design note: runs in the backend worker process. A batch is split into groups of requests whose
generation-shaping parameters match (usually one group; a seeded sampling request is a group of its own, so
its answer does not depend on its batch-mates); each group is left-padded and run through ONE
``model.generate`` (transformers derives position ids from the attention mask, so a prompt's greedy output
is the same alone or padded in a batch). Items of a group may differ in ``max_new_tokens`` (the group runs
to the largest; each item is cut at its own) and in what they report (details, logprobs, full text).
Post-processing per item finds EOS / stop token ids / stop strings, decodes only the new tokens and builds
per-token text pieces that concatenate to the answer. A bad item (validation) or a group whose generate
raises fails only its own items.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from handlers.base import Context, Handler, Input, Output
from handlers.embedding import Embedder, EmbeddingTask
from handlers.engine.execution.decoding.grammar import GrammarCompiler, GrammarError, GrammarLogitsProcessor
from handlers.engine.execution.decoding.grammar_trigger import Trigger
from handlers.engine.execution.decoding.sampling import BadWords, OutputPenalties, bad_words_ids, scored_tokens
from handlers.engine.execution.kernels.quantize import float_checkpoint_activations, quantize_linears
from handlers.engine.execution.weights.gguf_load import load_gguf_model
from handlers.engine.execution.weights.quant_ckpt_load import load_integer_model
from handlers.engine.planning.checkpoint import check_quantization
from handlers.engine.planning.cpu import auto_threads, keep_freed_memory
from handlers.engine.planning.gguf_plan import gguf_file_in
from handlers.request_checks import check_length, check_prompt_ids, check_token_ids
from rollcore.errors import InvalidRequest, ServingError
from rollcore.model_folder import read_config
from rollcore.options import option_value
from rollcore.sampling_ranges import check_sampling
from rollcore.tokenizer_probe import TOKENIZER_PROBE
from rollcore.types import FinishReason, SamplingParams, TokenInfo
from rollcore.values import AUTO

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype | str] = {  # option.dtype's values (rollcore.options.DTYPES)
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "auto": "auto",
}


@dataclass(frozen=True, slots=True)
class _Item:
    index: int  # position in the handled batch
    request: Input
    prompt_ids: list[int]
    matcher: Any = None  # structured output: the grammar's matcher (handlers.engine.execution.decoding.grammar)


def _group_key(p: SamplingParams, index: int) -> Hashable:
    """Parameters that shape one ``generate`` call; sampling-only ones are dropped for greedy requests.
    A seeded sampling request runs alone (keyed by its position ``index``): batch-mates would draw from its
    seeded generator, and a seed promises the answer the request gets alone."""
    sampling = None if p.greedy else (p.temperature, p.top_k, p.top_p, p.seed, p.min_p, p.typical_p)
    alone = index if sampling is not None and p.seed is not None else None
    return (sampling, alone, p.repetition_penalty, p.stop, p.stop_token_ids, p.ignore_eos, p.presence_penalty,
            p.frequency_penalty, p.logit_bias, p.min_tokens, p.bad_words, p.num_beams, p.length_penalty,
            p.early_stopping)


class HuggingFaceHandler(Handler):
    """Text generation for any ``AutoModelForCausalLM``; one ``generate`` per parameter group.

    Options: ``model_id`` (path, relative to the model folder or absolute; default the folder itself),
    ``dtype`` (fp32 default, fp16, bf16, auto), ``trust_remote_code`` (false), ``allow_unsafe_weights``
    (false: safetensors only), ``num_threads`` (torch CPU threads; ``auto``, the default: the cores of the
    worker's affinity mask / maxWorkers), ``max_model_len``.
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.model_name = "-"
        self.eos_token_ids: frozenset[int] = frozenset()
        self.pad_token_id = 0
        self.vocab_size = 0
        self._grammars: GrammarCompiler | None = None  # built with the first constrained request
        self.embedder: Embedder | None = None  # embedding requests: the decoder's pooled hidden states

    def initialize(self, ctx: Context) -> None:
        self.model_name = ctx.model_name
        threads = option_value(ctx.properties, "num_threads")  # options parse as the schema says
        torch.set_num_threads(auto_threads(int(ctx.option("maxWorkers") or 1)) if threads == AUTO else threads)
        keep_freed_memory()  # large generate() temporaries reused instead of faulted in again every call
        dtype_name = option_value(ctx.properties, "dtype")
        path = _model_path(ctx)
        trust = option_value(ctx.properties, "trust_remote_code")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        self.tokenizer.padding_side = "left"
        quantize = option_value(ctx.properties, "quantize")
        gguf = gguf_file_in(Path(path))
        integer = False  # the model's layers made integer while loading (quant_ckpt_load)
        if gguf is not None:  # a GGUF file's weights as it holds them (gguf_load), on the CPU
            group = option_value(ctx.properties, "quantize_group_size")
            self.model = load_gguf_model(Path(path), gguf, quantize, group,
                                         option_value(ctx.properties, "quantized_activations"))
        else:
            check_quantization(read_config(path), Path(path).name)
            # a quantized checkpoint, or option.quantize on fp32 weights on the CPU: one tensor at a time, integer
            on_cpu = ctx.device_id < 0 or not torch.cuda.is_available()
            self.model = None if trust or option_value(ctx.properties, "allow_unsafe_weights") else load_integer_model(
                Path(path), quantize, option_value(ctx.properties, "quantize_group_size"),
                option_value(ctx.properties, "quantized_activations"), on_cpu and dtype_name == "fp32")
            integer = self.model is not None
            if self.model is None:
                self.model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=DTYPES[dtype_name], trust_remote_code=trust,
                    use_safetensors=not option_value(ctx.properties, "allow_unsafe_weights"),
                )
        if ctx.device_id >= 0 and torch.cuda.is_available() and gguf is None and not integer:
            self.model.to(f"cuda:{ctx.device_id}")
        self.model.eval()
        if quantize in ("int8", "int4") and gguf is None and not integer:
            n = quantize_linears(self.model, quantize, option_value(ctx.properties, "quantize_group_size"),
                                 float_checkpoint_activations(option_value(ctx.properties, "quantized_activations")))
            log.info("model %s: option.quantize=%s: %d linear layers quantized", ctx.model_name, quantize, n)
        # transformers' sliding-window masks count left padding as context: a padded row would see fewer of
        # its own tokens than alone. Such models batch only prompts of equal length (no padding).
        layer_types = getattr(self.model.config, "layer_types", None) or ()
        self._padding_shifts_windows = bool(getattr(self.model.config, "sliding_window", None)) and (
            not layer_types or "sliding_attention" in layer_types)
        self._init_limits(ctx)
        task = EmbeddingTask.from_options(ctx.properties, Path(path), decoder=True)
        self.embedder = Embedder(self.model.base_model, self.tokenizer, task, self.max_model_len, self.vocab_size)
        log.info("model %s loaded from %s (%s, max_model_len=%d)", ctx.model_name, path, dtype_name,
                 self.max_model_len)

    def _init_limits(self, ctx: Context) -> None:
        config = self.model.config
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.vocab_size = int(getattr(config, "vocab_size", None) or len(self.tokenizer))
        configured = option_value(ctx.properties, "max_model_len")
        if configured:
            self.max_model_len = configured
        else:
            limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
            self.max_model_len = int(limit or min(self.tokenizer.model_max_length, 1 << 20))

    def describe(self) -> dict[str, Any]:
        eos = self.tokenizer.eos_token_id
        if eos is None and self.eos_token_ids:
            eos = min(self.eos_token_ids)
        return {"max_model_len": self.max_model_len, "eos_token_id": eos,
                "chat_template": self.tokenizer.chat_template or None, "vocab_size": self.vocab_size,
                # the frontend sends its own token ids when it encodes this probe alike (rollcore.tokenizer_probe)
                "tokenizer_probe": list(self.tokenizer(TOKENIZER_PROBE)["input_ids"]),
                "structured_output": True, "prompt_logprobs": True, "beam_search": True,
                **(self.embedder.task.describe(int(self.model.config.hidden_size)) if self.embedder else {})}

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """Render chat ``messages`` to a prompt (with the assistant turn opened). Raises ``InvalidRequest``."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template; send a completion prompt instead")
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def handle(self, inputs: Sequence[Input]) -> list[Output]:
        outputs: list[Output | None] = [None] * len(inputs)
        groups: dict[Hashable, list[_Item]] = {}
        embeds: list[int] = []  # embedding requests: one forward of their prompts (handlers.embedding)
        for index, request in enumerate(inputs):
            try:
                if self.embedder is not None:
                    self.embedder.task.check(request.params.embed)
                if request.params.embed:
                    embeds.append(index)
                    continue
                item = _Item(index, request, self._prepare(request), self._matcher(request.params))
            except ServingError as exc:
                outputs[index] = Output.failure(request.request_id, exc.message, exc.kind)
                continue
            key = _group_key(request.params, index)
            if self._padding_shifts_windows:
                key = (key, len(item.prompt_ids))
            groups.setdefault(key, []).append(item)
        for items in groups.values():
            try:
                results = self._generate(items)
            except Exception as exc:  # noqa: BLE001 - one group's failure must not fail the others
                rids = ",".join(i.request.request_id for i in items)
                log.exception("request %s model %s: generate failed", rids, self.model_name,
                              extra={"request_id": rids, "model": self.model_name})
                results = [Output.failure(i.request.request_id, f"generation failed: {type(exc).__name__}: {exc}")
                           for i in items]
            for item, result in zip(items, results, strict=True):
                outputs[item.index] = result
        if embeds and self.embedder is not None:
            for index, out in zip(embeds, self.embedder.embed([inputs[k] for k in embeds]), strict=True):
                outputs[index] = out
        return [o for o in outputs if o is not None]

    def _prepare(self, request: Input) -> list[int]:
        check_sampling(request.params)
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        elif not request.prompt:
            raise InvalidRequest("inputs must be a non-empty string")
        else:
            ids = list(self.tokenizer(request.prompt)["input_ids"])
        check_prompt_ids(ids, self.vocab_size)
        check_token_ids(request.params, self.vocab_size)
        check_length(len(ids), request.params.max_new_tokens, self.max_model_len)
        return ids

    def _matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher of the request's grammar (None without one). Raises ``InvalidRequest`` when the grammar
        cannot be built for this tokenizer."""
        if params.grammar is None:
            return None
        if params.num_beams > 1:  # the grammar's state follows one answer, beams fork it
            raise InvalidRequest("parameter 'num_beams' > 1 cannot be combined with a structured-output constraint")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, int(self.model.config.vocab_size), self.eos_token_ids)
        try:
            matcher = self._grammars.matcher(params.grammar).result()
        except GrammarError as exc:
            raise InvalidRequest(f"the constraint cannot be compiled for this model: {exc}") from None
        if params.grammar_trigger is None:
            return matcher
        return Trigger(matcher, params.grammar_trigger,
                       lambda token: str(self.tokenizer.decode([token], skip_special_tokens=False)))

    def _generate(self, items: list[_Item]) -> list[Output]:
        p = items[0].request.params  # shaping parameters are the same for the whole group
        input_ids, attention_mask = self._left_pad([i.prompt_ids for i in items])
        want_logits = any(i.request.params.details or i.request.params.logprobs > 0 for i in items)
        kwargs = self._generate_kwargs(p, max(i.request.params.max_new_tokens for i in items), input_ids.shape[1])
        if any(i.matcher is not None for i in items) and self._grammars is not None:
            kwargs.setdefault("logits_processor", LogitsProcessorList()).append(GrammarLogitsProcessor(
                self._grammars.executor, [i.matcher for i in items], int(self.model.config.vocab_size)))
        if not p.greedy and p.seed is not None:
            torch.manual_seed(p.seed)
        beams = p.num_beams > 1  # generate's logits are per beam then: the chosen answer is scored again below
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      return_dict_in_generate=True, output_logits=want_logits and not beams, **kwargs)
        new_ids = out.sequences[:, input_ids.shape[1]:].tolist()  # [B, steps]
        results = []
        for row, item in enumerate(items):
            if not want_logits:
                logits = None
            elif beams:
                logits = list(self._rescored(item.prompt_ids, new_ids[row]))
            else:
                logits = [step[row] for step in out.logits]
            results.append(self._finish(item, new_ids[row], logits))
        return results

    def _rescored(self, prompt: list[int], generated: list[int]) -> torch.Tensor:
        """The model's logits before each generated token [len(generated), V]: one forward of the whole text."""
        with torch.inference_mode():
            ids = torch.tensor([prompt + generated], device=self.model.device)
            return self.model(ids).logits[0, len(prompt) - 1:len(prompt) + len(generated) - 1]

    def _generate_kwargs(self, p: SamplingParams, max_new_tokens: int, prompt_width: int = 0) -> dict[str, Any]:
        stop_ids = set(p.stop_token_ids)
        # ignore_eos as vLLM: EOS may be generated and does not end the row (stop token ids still do).
        ends = stop_ids if p.ignore_eos else self.eos_token_ids | stop_ids
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens, "pad_token_id": self.pad_token_id,
            "eos_token_id": sorted(ends) or None,
            "repetition_penalty": p.repetition_penalty, "num_beams": p.num_beams,
        }
        if p.num_beams > 1:
            kwargs.update(length_penalty=p.length_penalty, early_stopping=p.early_stopping, num_return_sequences=1)
        if p.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kwargs.update(do_sample=True, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          min_p=p.min_p or None, typical_p=p.typical_p)
        if p.logit_bias:
            kwargs["sequence_bias"] = {(t,): b for t, b in p.logit_bias}
        if p.min_tokens:
            kwargs["min_new_tokens"] = p.min_tokens  # EOS and stop token ids held back until then
        processors = LogitsProcessorList()  # the generated tokens begin after the (padded) prompt
        if p.presence_penalty or p.frequency_penalty:
            processors.append(OutputPenalties(prompt_width, p.presence_penalty, p.frequency_penalty))
        if p.bad_words:
            processors.append(BadWords(prompt_width, bad_words_ids(self.tokenizer, p.bad_words)))
        if processors:
            kwargs["logits_processor"] = processors
        if p.stop:
            kwargs.update(stop_strings=list(p.stop), tokenizer=self.tokenizer)
        return kwargs

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        for j, r in enumerate(rows):
            input_ids[j, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[j, width - len(r):] = 1
        return input_ids.to(self.model.device), attention_mask.to(self.model.device)

    def _finish(self, item: _Item, generated: list[int], logits: list[torch.Tensor] | None) -> Output:
        """Cut one row at its end condition and build its Output (runs after generate, per item)."""
        p = item.request.params
        ids = generated[:p.max_new_tokens]
        finish = FinishReason.LENGTH
        for k, token in enumerate(ids):
            if token in p.stop_token_ids:
                finish, ids = FinishReason.STOP, ids[:k + 1]
                break
            if token in self.eos_token_ids and not p.ignore_eos:
                finish, ids = FinishReason.EOS, ids[:k + 1]
                break
        skip = p.skip_special_tokens
        texts = self._token_texts(ids, skip)
        # As vLLM (and the rolling engine): a stop token ends the text without adding its own.
        text_ids = ids[:-1] if finish is not FinishReason.LENGTH else ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        stop_at = _find_stop(text, p.stop)
        if stop_at is not None:
            start, end = stop_at
            ids, texts = ids[:_tokens_covering(texts, end)], texts[:_tokens_covering(texts, end)]
            finish, text = FinishReason.STOP, text[:end] if p.include_stop_str_in_output else text[:start]
        tokens = tuple(TokenInfo(id=t, text=s, **self._logprobs(p, logits, k, t))
                       for k, (t, s) in enumerate(zip(ids, texts, strict=True)))
        if p.return_full_text:
            prompt = item.request.prompt or self.tokenizer.decode(item.prompt_ids, skip_special_tokens=True)
            text = prompt + text
        return Output(request_id=item.request.request_id, text=text, finish_reason=finish, tokens=tokens,
                      prompt_tokens=len(item.prompt_ids), prompt_logprobs=self._prompt_scores(item.prompt_ids, p))

    def _prompt_scores(self, ids: list[int], p: SamplingParams) -> tuple[TokenInfo, ...] | None:
        """Each prompt token's log-probability given those before it (one forward of the prompt alone)."""
        if p.prompt_logprobs is None:
            return None
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids], device=self.model.device)).logits[0, :-1]
        texts = self.tokenizer.batch_decode([[t] for t in ids])
        return (TokenInfo(ids[0], texts[0]), *scored_tokens(logits, ids[1:], texts[1:], p.prompt_logprobs))

    def _token_texts(self, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
        """Text piece of each token; pieces concatenate to the decoded text. A token that ends inside a
        multi-byte character gets "" and its bytes appear with the token that completes the character."""
        texts: list[str] = []
        done = ""
        for k in range(len(ids)):
            current = self.tokenizer.decode(ids[:k + 1], skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=False)
            if (current.endswith("\ufffd") and k + 1 < len(ids)) or not current.startswith(done):
                texts.append("")
                continue
            texts.append(current[len(done):])
            done = current
        return texts

    @staticmethod
    def _logprobs(p: SamplingParams, logits: list[torch.Tensor] | None, step: int, token: int) -> dict[str, Any]:
        if logits is None or not (p.details or p.logprobs > 0):
            return {}
        logprobs = torch.log_softmax(logits[step].float(), dim=-1)  # [V], the model's raw distribution
        result: dict[str, Any] = {"logprob": float(logprobs[token])}
        if p.logprobs > 0:
            top = torch.topk(logprobs, min(p.logprobs, logprobs.shape[-1]))
            result["top_logprobs"] = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return result


def _model_path(ctx: Context) -> Path | str:
    model_id = ctx.option("model_id")
    if not model_id:
        return ctx.model_dir
    local = Path(ctx.model_dir) / model_id
    return local if local.exists() else model_id


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop string in ``text``, or None."""
    found = [(text.find(s), text.find(s) + len(s)) for s in stops if s and s in text]
    return min(found) if found else None


def _tokens_covering(texts: list[str], end: int) -> int:
    """How many leading token pieces it takes to cover the first ``end`` characters."""
    covered = 0
    for k, piece in enumerate(texts):
        covered += len(piece)
        if covered >= end:
            return k + 1
    return len(texts)
