"""Core value types shared by the frontend and the backend.

Design note: these are plain frozen dataclasses with no dependency on any protocol, torch or the rest of
the project. Every frontend (HTTP, OpenAI, TGI, gRPC) translates its wire request into a
``GenerationRequest``; every backend answer comes back as ``TokenDelta`` (rolling) or ``BatchOutput`` (dynamic),
and the frontend hands ``GenerationResult`` (whole) to its routes. The worker channel carries these types as they
are (``serving.ipc.wire`` encodes them from their annotations); ``LOCAL_FIELDS`` names what stays in the frontend.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from rollcore.errors import ErrorKind

# How many models loaded at start share this machine's cores: set by the frontend (serving.models.registry) in its
# workers' environment, read by option.num_threads=auto (handlers.engine.planning.cpu.auto_threads).
CORE_SHARERS_ENV = "ROLLSERVE_MODELS_SHARING_CORES"


class FinishReason(str, enum.Enum):
    """Why a sequence stopped. Values are LMI's ``details.finish_reason`` spellings."""

    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ABORT = "abort"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """The OpenAI ``finish_reason`` spelling."""
        return "length" if self is FinishReason.LENGTH else "stop"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated generation parameters of one request (LMI names; defaults as in LMI)."""

    max_new_tokens: int = 30
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    details: bool = False
    return_full_text: bool = False
    logprobs: int = 0  # number of top logprobs per token to return; 0 = only the chosen token's when asked
    grammar: str | None = None  # structured output: llguidance's serialized grammar (serving.requests.structured)
    # with a grammar: it applies from where the answer first writes this text (a tool call's marker), not before
    grammar_trigger: str | None = None
    # vLLM's definitions: penalties on the generated tokens' counts, min_p relative to the top probability,
    # typical_p (transformers'), additive logit biases by token id, no EOS / stop token before min_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    typical_p: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # vLLM's: the answer keeps the stop string that ended it
    skip_special_tokens: bool = True  # False: special tokens' text (chat markers, tool-call tags) is kept
    # vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it (None: not
    # computed; k > 0: with the k most likely alternatives at each position)
    prompt_logprobs: int | None = None
    # vLLM's: words never generated (handlers.engine.execution.decoding.sampling.BadWords)
    bad_words: tuple[str, ...] = ()
    # beam search (transformers' generate: dynamic batching only); greedy and sampling ignore them at 1 beam
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    adapter: str | None = None  # a LoRA adapter of the model by name (None: the base model)
    # vLLM's cache_salt: mixed into the first prefix-cache block's key, so only requests of the same salt share
    # cached blocks (rollcore.prefix_keys)
    cache_salt: str | None = None
    # an embedding request (/v1/embeddings): the prompt's forward pass only, answered with its pooled hidden state
    embed: bool = False

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to one model, as every frontend builds it.

    ``prompt`` is text; ``prompt_token_ids`` is set instead when a client sent token ids (OpenAI).
    ``payload`` is the raw JSON body for custom handlers that read their own fields.
    ``attributes`` carries pass-through request metadata (e.g. SageMaker custom attributes).
    A frontend sets ``request_id`` to the id the client knows (``X-Request-Id`` or a generated one);
    ``ModelEndpoint.submit`` moves it to ``client_id`` and gives the request a server-generated
    ``request_id``, the only id batchers and workers ever key on (see ``serving.models.live_requests``).
    """

    # frontend-side only: never sent to a worker (serving.ipc.wire)
    LOCAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"deadline", "client_id", "affinity"})

    request_id: str
    model: str
    prompt: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: tuple[int, ...] | None = None
    stream: bool = False
    payload: dict[str, Any] | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None  # absolute time.monotonic() after which the request is aborted
    client_id: str = ""  # the client's id (logs, headers, cancel-by-id); never a table key
    # requests of one affinity key (a SageMaker session) go to one worker while it lives; frontend-side only
    affinity: str | None = None


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token: id, its text piece, and log-probability when computed."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one engine step produced for one request.

    ``text`` is the newly *released* text (stop-sequence hold-back may delay text to a later delta).
    ``finish_reason`` is set on the last delta of a request. ``prompt_tokens`` is set on the first, and so is
    ``prompt_logprobs`` when the request asked for them (one entry per prompt token; the first has no logprob).
    """

    request_id: str
    tokens: tuple[TokenInfo, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenInfo, ...] | None = None
    embedding: tuple[float, ...] | None = None  # an embedding request's pooled vector (its only delta)
    cached_tokens: int | None = None  # with prompt_tokens: how many of them the prefix cache served


@dataclass(frozen=True, slots=True)
class BatchOutput:
    """One answer of a dynamic-batching handler (``handlers.base.Output``), as the worker sends it back.
    ``error`` set means this item failed; ``error_kind`` says how (default: handler)."""

    request_id: str
    text: str = ""
    finish_reason: FinishReason = FinishReason.LENGTH
    tokens: tuple[TokenInfo, ...] = ()
    prompt_tokens: int = 0
    payload: Any = None  # a custom handler's JSON answer
    error: str | None = None
    prompt_logprobs: tuple[TokenInfo, ...] | None = None  # SamplingParams.prompt_logprobs: one per prompt token
    error_kind: ErrorKind = ErrorKind.HANDLER
    embedding: tuple[float, ...] | None = None  # an embedding request's vector (SamplingParams.embed)

    @classmethod
    def failure(cls, request_id: str, message: str, kind: ErrorKind = ErrorKind.HANDLER) -> BatchOutput:
        return cls(request_id=request_id, finish_reason=FinishReason.ERROR, error=message, error_kind=kind)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Per-request timings in seconds, measured in the frontend (send-to-event, vLLM's definitions)."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    worker_id: int | None = None  # the worker that answered (not a timing: it travels with them to the headers)
    max_itl_s: float = 0.0  # the longest gap between two of its token deliveries (0: fewer than two)

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished request: whole text, why it stopped, token details and timings."""

    request_id: str
    text: str
    finish_reason: FinishReason
    tokens: tuple[TokenInfo, ...] = ()
    prompt_tokens: int = 0
    timings: RequestTimings = field(default_factory=RequestTimings)
    payload: Any = None  # custom handlers may return arbitrary JSON instead of text
    prompt_logprobs: tuple[TokenInfo, ...] | None = None  # when asked: see ``TokenDelta``
    cached_tokens: int = 0  # of prompt_tokens, those the engine's prefix cache served (rolling)

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)


class ModelState(str, enum.Enum):
    """Lifecycle of a registered model."""

    PENDING = "PENDING"
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    DRAINING = "DRAINING"
    UNLOADED = "UNLOADED"
