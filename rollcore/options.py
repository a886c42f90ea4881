"""The option schema: every ``option.*`` key that rollserve's own code reads, with its parser and default.

Design note: part of the kernel (imports only ``rollcore.values`` and ``rollcore.errors``; no torch), the one
place an option is defined. ``serving.config.model_config`` validates a model's options with it at load (file, line, key
and value in the error), puts the effective value and its source in ``ModelConfig.options``/``sources``
(what ``serving config`` prints) and warns about an unknown ``option.*`` key close to a known one
(``suggest``); the handlers parse the same keys with the same parsers (``option_value``: the rolling
engine's ``EngineConfig.from_options``, the huggingface and echo handlers), so a value means the same on
both sides of the worker boundary. ``readers`` says who reads a key: ``serving`` (the frontend, for every
model), ``loader`` (custom entry points), or a built-in handler (``engine``: the rolling engine,
``huggingface``: dynamic batching with ``generate``, ``echo``). An ``option.*`` key not listed here is a
custom handler's own and passes through as is.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from rollcore.errors import ConfigError
from rollcore.values import (
    BOOL_WORDS,
    Parser,
    any_text,
    boolean,
    choice,
    integer,
    number,
    text,
)

SERVING, LOADER, ENGINE, HUGGINGFACE, ECHO = "serving", "loader", "engine", "huggingface", "echo"
SUGGEST_CUTOFF = 0.8  # difflib ratio above which an unknown key is taken for a typo of a known one

ROLLING_BATCH_MODES = ("disable", "auto", "scheduler", "lmi-dist", "vllm")
# DJL's names for rolling-batch engines: rollserve's engine (scheduler) serves these...
ROLLING_ENGINE_ALIASES = frozenset({"lmi-dist", "vllm"})
# ...and refuses these, which name engines rollserve does not have.
_FOREIGN_ROLLING_ENGINES = {"trtllm": "TensorRT-LLM", "tensorrt": "TensorRT-LLM", "tensorrt-llm": "TensorRT-LLM",
                            "tnx": "transformers-neuronx", "neuronx": "transformers-neuronx",
                            "deepspeed": "DeepSpeed"}
DTYPES = ("fp32", "fp16", "bf16", "auto")
DTYPE_ALIASES = MappingProxyType({"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"})
PREPACK_MODES = ("auto", "hybrid", "true", "false")
# Entry points of the built-in handlers -> the readers whose options they take. ``huggingface`` runs the
# rolling engine or HF generate, whichever batching the model gets (``handlers_of``).
_BUILTIN_READERS: Mapping[str, frozenset[str]] = MappingProxyType({
    "huggingface": frozenset({ENGINE, HUGGINGFACE}), "djl_python.huggingface": frozenset({ENGINE, HUGGINGFACE}),
    "rolling": frozenset({ENGINE}), "echo": frozenset({ECHO}),
})


def rolling_batch(value: str) -> str:
    lowered = value.lower()
    if lowered in _FOREIGN_ROLLING_ENGINES:
        raise ValueError(f"{_FOREIGN_ROLLING_ENGINES[lowered]} is not part of rollserve; use auto or scheduler "
                         "(rollserve's rolling engine; DJL's lmi-dist and vllm name it too) or disable")
    if lowered not in ROLLING_BATCH_MODES:
        raise ValueError(f"expected one of {', '.join(ROLLING_BATCH_MODES)}")
    return lowered


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One ``option.<key>``: its parser, its default as text (None: absent unless set; the reader decides),
    who reads it and what it means."""

    key: str
    parser: Parser
    default: str | None
    readers: frozenset[str]
    meaning: str


def _spec(key: str, parser: Parser, default: str | None, readers: tuple[str, ...], meaning: str) -> OptionSpec:
    return OptionSpec(key, parser, default, frozenset(readers), meaning)


_BOTH = (ENGINE, HUGGINGFACE)
OPTIONS: Mapping[str, OptionSpec] = MappingProxyType({s.key: s for s in (
    # Read by the frontend for every model (and by the handlers named).
    _spec("entryPoint", text, None, (SERVING,), "the handler; default model.py if present, else huggingface"),
    _spec("model_id", text, None, (SERVING, *_BOTH),
          "where the weights are: another local folder; a .gguf file or a folder of them (gguf_file picks one); "
          "s3://bucket/prefix (boto3's credential chain, AWS_ENDPOINT_URL); a hub id org/name[@rev] (HF_ENDPOINT, "
          "HF_TOKEN). Anything but a local folder is fetched (GGUF: its config and tokenizer read, the file served "
          "as it is) once, before "
          "the workers start, into model_cache_dir, and reused"),
    _spec("gguf_file", text, None, (SERVING,), "which .gguf file of option.model_id's folder to load"),
    _spec("dtype", choice(DTYPES, DTYPE_ALIASES), "fp32", (SERVING, *_BOTH),
          "weights and KV cache dtype: fp32, fp16, bf16, or auto. Rolling engine on a CPU: auto is bf16 where the CPU "
          "runs bf16 natively (AVX512-BF16 or AMX) and fp32 elsewhere, whatever the checkpoint stores (the choice is "
          "logged); on a GPU, unset or auto is the checkpoint's bf16/fp16 (bf16 for an fp32 checkpoint). Dynamic "
          "(HF generate): auto is the checkpoint's config.json dtype"),
    _spec("quantize", choice(("auto", "none", "int8", "int4")), "auto", (SERVING, *_BOTH),
          "weight-only int8 (a scale per output channel) or int4 (a scale and minimum per group of "
          "quantize_group_size inputs, llama.cpp's Q4_1 form) linear layers through a C kernel built on first use; "
          "each input row is computed alone (option.quantized_activations), so a request's tokens do not depend on "
          "its batch-mates. fp32 CPU workers, no "
          "tensor parallelism; prepacking and fused projections are off with it; a safetensors checkpoint is "
          "quantized layer by layer while loading. auto: none for a float checkpoint; a GGUF file's quantized "
          "tensors as the file holds them (its F16/BF16/F32 matrices int8); a compressed-tensors (pack-quantized), "
          "GPTQ or AWQ checkpoint's integers as it holds them; none on a GGUF file dequantizes it to fp32 at load"),
    _spec("quantize_group_size", integer(8), "32", (SERVING, *_BOTH), "inputs per int4 scale and minimum"),
    _spec("quantized_activations", choice(("auto", "fp32", "int8", "int8x2")), "auto", (SERVING, *_BOTH),
          "what quantized linear layers multiply: int8, each input row quantized per 32 values (16 for "
          "K-quants' sub-blocks) and integer dot products (llama.cpp's precision; needs AVX-512 VNNI and VBMI, "
          "else fp32), int8x2 the same with what "
          "int8 leaves quantized again (inputs to ~1e-5 of their largest value: the answers of fp32 inputs), or "
          "fp32 inputs times the weights converted (exact to the dequantized model). auto: for a GGUF file int8x2, "
          "int8 from 1e9 weights in its linear layers (llama.cpp's precision where the integer work is most of a "
          "step); int8x2 for a quantized checkpoint's weights; fp32 for option.quantize on a float checkpoint"),
    _spec("trust_remote_code", boolean, "false", (SERVING, *_BOTH), "run the model folder's own code"),
    _spec("predict_timeout", number(0, exclusive=True), "120", (SERVING,), "seconds one request may take"),
    _spec("model_loading_timeout", number(0, exclusive=True), "600", (SERVING,), "seconds a worker may load"),
    _spec("liveness_timeout", number(0, exclusive=True), "60", (SERVING,),
          "rolling: seconds a worker with work pending may go without a step before it is restarted"),
    _spec("rolling_batch", rolling_batch, "disable", (SERVING,),
          "auto: the rolling engine when it serves the architecture exactly, else dynamic batching (the reason in "
          "GET /models/{name}); scheduler (DJL's lmi-dist and vllm name it too): the engine or FAILED; disable"),
    _spec("max_rolling_batch_size", integer(1), "32", (SERVING, ENGINE), "sequences running at once per worker"),
    _spec("max_rolling_batch_prefill_tokens", integer(1), "2048", (SERVING, ENGINE),
          "token budget of one engine step (longer prompts are prefilled in chunks)"),
    _spec("routing", choice(("prefix", "least_loaded")), "prefix", (SERVING,),
          "rolling, several workers: prefix sends a request to the worker whose prefix cache holds the longest "
          "prefix of its prompt (the least loaded on a tie); least_loaded ignores the prefix (docs/routing.md)"),
    _spec("routing_max_imbalance", integer(1), "4", (SERVING,),
          "rolling: a request (a session's too) goes to a worker only while it runs fewer than this many requests "
          "more than the least loaded worker"),
    _spec("tensor_parallel_degree", integer(1), "1", (SERVING, ENGINE),
          "rolling engine: ranks per worker over torch.distributed (gloo on CPU, nccl on GPU); max = the "
          "visible GPUs"),
    _spec("follower_weights", choice(("auto", "resolve", "stream")), "auto", (SERVING, ENGINE),
          "tensor parallelism over several hosts: how a follower host gets the weights. resolve: from "
          "option.model_id itself (its own credentials and cache; a local folder from its own model store); "
          "stream: the leader's files over the group's authenticated connection; auto: resolve where the "
          "follower can, else stream. Either way every file is checked against the leader's (name, size, "
          "SHA-256) before a rank loads"),
    _spec("origin_model_id", text, None, (ENGINE,),
          "set by the server, not by hand: the option.model_id a fetched model came from (followers resolve it)"),
    _spec("tensor_parallel_timeout", number(0, exclusive=True), "60", (SERVING, ENGINE),
          "seconds rank 0 waits for another rank within a step once the group is up: a host that died "
          "silently fails the step and its requests within this bound (the ranks' loading is not bounded by it)"),
    _spec("strict_parameters", boolean, "false", (SERVING,),
          "true: unknown request parameters are a 400 (default: ignored, named in X-Ignored-Parameters)"),
    _spec("output_formatter", any_text, None, (SERVING,),
          "sse: streams as server-sent events; jsonlines: a rolling model streams unasked"),
    _spec("tgi_compat", boolean, "false", (SERVING,), "TGI-shaped answers and stream events"),
    _spec("enable_auto_tool_choice", boolean, "true", (SERVING,),
          "tool_choice auto (OpenAI's default with tools): the model decides, its calls read in its own format "
          "and kept valid once started; false refuses auto"),
    _spec("tool_call_parser", choice(("auto", "hermes", "llama3_json", "mistral", "granite", "qwen3_xml",
                                      "pythonic")), "auto", (SERVING,),
          "how tool calls look in the model's text; auto: as its chat template renders them (hermes, the generic "
          "format, when the template does not render tools)"),
    _spec("reasoning_parser", choice(("auto", "none", "think", "deepseek_r1", "qwen3", "granite")), "auto",
          (SERVING,), "reasoning kept apart from the answer (reasoning_content, thinking blocks, reasoning items) for "
          "models that think in <think>...</think>; auto: when the chat template writes <think>; none: never; the "
          "others (vLLM's names): always"),
    _spec("handler", any_text, None, (LOADER,), "the handler class of a custom entry point's module"),
    _spec("task", choice(("auto", "generate", "embedding"), {"embed": "embedding"}), "auto", (SERVING, *_BOTH),
          "what the model serves: auto = generation and, for a decoder, POST /v1/embeddings too (the prompt's "
          "final hidden states pooled); generate; embedding = POST /v1/embeddings only (the generation routes "
          "answer 400): an encoder such as BERT (any AutoModel folder) on dynamic batching, or a decoder on either "
          "batching"),
    _spec("pooling", choice(("auto", "last", "mean", "cls")), "auto", _BOTH,
          "how an embedding pools the prompt's final hidden states: auto = a sentence-transformers folder's "
          "pooling (and its normalisation), else last for a decoder (vLLM's default) and mean for an encoder; "
          "last token, mean over the prompt's tokens, or cls (the first token). Vectors are L2-normalised unless a "
          "sentence-transformers folder has no Normalize module"),
    # The rolling engine (handlers.engine.planning.engine_config.EngineConfig) and the dynamic huggingface handler.
    _spec("max_prefill_tokens_while_decoding", integer(0), "256", (ENGINE,),
          "while sequences decode, prefill chunks take at most this many tokens of a step (a long prefill step "
          "stalls every running stream); 0 = up to the whole budget"),
    _spec("max_mixed_step_ratio", number(0), "8", (ENGINE,),
          "while sequences decode, a step that also prefills lasts at most this many decode-only steps (by the "
          "step costs the engine fits: fixed + per decode row + per prompt token), times waiting / decoding "
          "sequences while more requests wait for a first token than decode (a burst); 0 = the token cap alone. "
          "Off on GPUs"),
    _spec("burst_prefill_first", boolean, "true", (ENGINE,),
          "while more requests wait for a first token than sequences decode, their prompts take more than two "
          "steps and the streams are likely to write 100 tokens or more on average, guessed from what they wrote so "
          "far (a burst), the decodes wait until those "
          "requests have their first tokens: each running stream pauses once, for the burst's prefill, instead "
          "of at every step of it, and first tokens come sooner; false = streams keep decoding beside the "
          "burst's chunks (shorter pauses, more of them, later first tokens). Off on GPUs; inert while max_itl_ms "
          "is in force"),
    _spec("max_itl_ms", integer(0, auto=True), "auto", (ENGINE,),
          "inter-token latency target in ms: every step with running streams keeps them in it, and the prompt work "
          "beside them is sized by the fitted step cost, less the margin by which recent steps overran it, so that "
          "the step lasts at most this long (prompts larger "
          "than that are chunked over steps; a waiting prompt still gets a floor of block_size tokens a step; "
          "the token cap, the time ratio and burst pauses step aside); auto = 2 decode steps of a full batch "
          "as measured at load (GET /models/{name}: batcher.engines.<worker>.itl_target.derived_ms); 0 = off. "
          "Changeable at run time (PUT /models/{name}?max_itl_ms=)"),
    _spec("block_size", integer(1), "16", (ENGINE,), "tokens per KV-cache block"),
    _spec("kv_cache_memory_mb", integer(0, auto=True), "auto", (ENGINE,),
          "KV cache of a worker (all its ranks) in MiB; auto or 0: kv_cache_memory_fraction of the memory left "
          "after weights, prepacked copies and activations, capped at what max_rolling_batch_size sequences of "
          "max_model_len need"),
    _spec("kv_cache_memory_fraction", number(0, 1, exclusive=True), "0.9", (ENGINE,),
          "share of the memory left after weights that auto gives the KV cache"),
    _spec("num_kv_blocks", integer(0), "0", (ENGINE,), "KV blocks outright; 0 = sized by memory"),
    _spec("kv_cache_populate", choice(("auto", "eager", "lazy")), "auto", (ENGINE,),
          "eager: every page of the KV cache touched at load (memory committed up front); lazy: zeroed anonymous "
          "memory paid for page by page when first used (a faster start; steps fault pages in until the cache has "
          "been used once, and the RSS grows with use up to the planned size). auto: lazy for a GGUF file (its "
          "users size the machine by the file, as with llama.cpp), eager otherwise"),
    _spec("enable_prefix_caching", boolean, "true", (ENGINE,), "share KV blocks of identical prefixes"),
    _spec("num_threads", integer(1, auto=True), "auto", _BOTH,
          "torch threads per worker (each rank); auto: the cores of the worker's CPU affinity mask divided by "
          "maxWorkers x tensor_parallel_degree x the models loaded at start (more OpenMP threads than cores spin "
          "against each other)"),
    _spec("max_model_len", integer(0), None, _BOTH,
          "prompt + generated tokens per sequence; absent or 0: the model's max_position_embeddings (capped there "
          "for learned positions, allowed with a warning above it for rotary ones)"),
    _spec("prepack_weights", choice(PREPACK_MODES, {w: str(v).lower() for w, v in BOOL_WORDS.items()}), "auto",
          (ENGINE,), "oneDNN-packed linear weights: auto = measured at load on this CPU: passes through the "
          "model's layers (as a step streams them from memory), plain against packed against the panel kernel "
          "(fp32), at each row count a step can bring, and each row count of "
          "the layers (and of the LM head) runs on the fastest, a layer keeping only the copies it uses (at most "
          "two, as the plan counts; one packed copy where two do not fit; timings cached per CPU); hybrid = "
          "packed for inputs of 2 to 128 rows and the prefill row counts built at load, plain beyond (a second "
          "copy of the weights); true = packed only; false. Packed layers run on a fixed set of row counts whose "
          "kernels are built at load, so a worker's memory does not grow with traffic"),
    _spec("attention_kernel", choice(("native", "torch")), "native", (ENGINE,),
          "CPU kernels: native = rollserve's C kernels for decode and prompt attention and the fused norm and "
          "activation steps (built on first use with the system C compiler, cached; PyTorch's path without a "
          "compiler), torch = PyTorch's operations (SDPA per sequence)"),
    _spec("gpu_memory_utilization", number(0, 1, exclusive=True), "0.9", (ENGINE,),
          "GPU workers: share of the device's memory the worker may fill (weights, activations, KV cache)"),
    _spec("enforce_eager", boolean, "false", (ENGINE,), "GPU workers: no CUDA graphs for decode steps"),
    _spec("fuse_projections", boolean, "false", (ENGINE,), "fuse the q/k/v and gate/up projections"),
    _spec("allow_unsafe_weights", boolean, "false", _BOTH, "load pickled (.bin) weights"),
    _spec("seed", integer(0), "0", (ENGINE,), "the engine's sampling seed"),
    _spec("speculative_draft", choice(("none", "ngram")), "none", (ENGINE,),
          "speculative decoding of greedy requests without logprobs: ngram = prompt lookup (guessed tokens taken "
          "from what followed an earlier occurrence of the sequence's last n-gram, checked by the model in the "
          "same step; the output stays greedy decoding's). A sequence whose guesses miss pauses 1, 2, 4 .. 16 "
          "steps"),
    _spec("num_speculative_tokens", integer(1, 16), "8", (ENGINE,),
          "most guesses checked per sequence and step (the auto gate gives fewer where rows are dear)"),
    _spec("prompt_lookup_min", integer(1, 16), "1", (ENGINE,), "shortest n-gram the ngram drafter matches"),
    _spec("prompt_lookup_max", integer(1, 16), "3", (ENGINE,), "longest n-gram the ngram drafter matches"),
    _spec("speculative_max_batch_size", integer(0, auto=True), "auto", (ENGINE,),
          "auto = guess while the step's measured cost says a guess pays for its row (the model's confirmed share "
          "of earlier guesses against what a row costs beside the sequences decoding: guesses on memory-bound "
          "steps, none on compute-bound ones); N = only while at most N sequences decode; 0 = always"),
    _spec("enable_lora", boolean, "false", (ENGINE,),
          "serve the LoRA adapters of the model folder's adapters/NAME/ (PEFT format) and those registered at run "
          "time; rows of different adapters and of the base model share each step (no weights merged)"),
    _spec("max_loras", integer(1, 64), "4", (ENGINE,),
          "adapters resident at once (a slot each per projection); others wait in host memory and swap in when "
          "a slot's adapter has no sequence left, least recently used first"),
    _spec("max_lora_rank", integer(1, 256), "16", (ENGINE,), "the largest adapter rank served (slots are this wide)"),
    # The echo handler (tests, load generation).
    _spec("echo_delay_ms", number(0), "0", (ECHO,), "sleep once per batch"),
    _spec("echo_fail_on", any_text, None, (ECHO,), "fail an item whose prompt contains this"),
)})
_LOWER = {key.lower(): key for key in OPTIONS}


def handlers_of(entry_point: str, rolling: bool | None = None) -> frozenset[str]:
    """The built-in readers whose options a model with ``entry_point`` takes: the handler it runs when
    ``rolling`` is known (``huggingface`` is the engine when rolling, HF generate otherwise), every handler the
    entry point may run when None; empty for a custom entry point."""
    readers = _BUILTIN_READERS.get(entry_point, frozenset())
    if rolling is None or readers != _BUILTIN_READERS["huggingface"]:
        return readers
    return frozenset({ENGINE if rolling else HUGGINGFACE})


def reads(spec: OptionSpec, handlers: frozenset[str]) -> bool:
    """True when a model whose handler is one of ``handlers`` (``handlers_of``) reads ``spec``'s key."""
    return bool(spec.readers & ({SERVING, LOADER} | handlers))


def parse_option(key: str, raw: str | None, where: str = "") -> Any:
    """``option.<key>``'s value (``raw`` stripped; absent: the default, or None without one), parsed by its
    schema entry. Raises ``ConfigError`` naming ``where`` (if given), the key and the value."""
    spec = OPTIONS[key]
    if raw is None:
        return None if spec.default is None else spec.parser(spec.default)
    try:
        return spec.parser(raw.strip())
    except ValueError as exc:
        raise ConfigError(f"{where + ': ' if where else ''}option.{key} = {raw!r}: {exc}") from None


def option_value(options: Mapping[str, str], key: str) -> Any:
    """``parse_option`` of ``options.get(key)``: how a handler reads one of its options (prefix stripped)."""
    return parse_option(key, options.get(key))


def suggest(key: str) -> str | None:
    """The known option an unknown ``key`` (without ``option.``) looks like a typo of, or None."""
    close = difflib.get_close_matches(key.lower(), list(_LOWER), n=1, cutoff=SUGGEST_CUTOFF)
    return _LOWER[close[0]] if close else None
