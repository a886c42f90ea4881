"""Generation parameters shared by every protocol: their model (validation and document) and SamplingParams.

Design note: HTTP (LMI, TGI, OpenAI) and gRPC (OIP ``sampling_parameters``, typed service) all end up
here, so a bad value gets the same message whatever the protocol. ``LmiParameters`` is the one definition
of LMI's ``parameters`` object (also TGI's, OIP's and the typed gRPC message's); the OpenAI models reuse its
field types (``Temperature``, ``TopP``, ...), so a range is written once. Messages come from
``serving.requests.schema``: every check names the field, JSON's ``true`` is never accepted where a number is
expected, NaN and infinities are refused, unknown fields are listed (unless the model relaxes it). Limits
are passed in, never read from globals.

Ranges are stated once, in ``rollcore.sampling_ranges`` (the handlers check against the same table): the field
types below take their bounds from it, and ``sampling_params`` checks the combined values (``min_tokens`` <=
``max_new_tokens``). Here only what the wire adds: a positive ``temperature`` below 0.01 counts as 0.01 so that
the logits never overflow; ``top_k`` -1 is vLLM's "off" (0); ``seed`` 0..2^63-1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from rollcore.errors import InvalidRequest
from rollcore.sampling_ranges import MAX_TOKEN_ID, RANGES, check_sampling
from rollcore.types import SamplingParams
from serving.requests import structured
from serving.requests.schema import BY_SHAPE, INTEGER, TEXT, Cap, Only, StrictModel
from serving.requests.validation import RequestSchema, kind_of, type_error

MAX_SEED = 2**63 - 1
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack (the worker channel) can carry
MAX_PAYLOAD_DEPTH = 64
MIN_TEMPERATURE = 0.01


def _bounds(name: str) -> dict[str, float]:
    """pydantic's bounds of the sampling parameter ``name`` (``rollcore.sampling_ranges.RANGES``)."""
    r = RANGES[name]
    out: dict[str, float] = {}
    if r.lo is not None:
        out["gt" if r.lo_open else "ge"] = r.lo
    if r.hi is not None:
        out["le"] = r.hi
    return out


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on what one request may ask for (the configurable ones come from config.properties)."""

    max_new_tokens: int = 4096
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 64
    max_sequences_per_request: int = 64  # prompts x n of one request
    max_n: int = 8
    max_logprobs: int = 20
    max_prompt_chars: int = 1_000_000


# --- field types, shared by the LMI/TGI parameters and the OpenAI bodies ---------------------------------
MaxNewTokens = Annotated[int, Field(**_bounds("max_new_tokens")), Cap("max_new_tokens"), INTEGER]
Temperature = Annotated[float, Field(**_bounds("temperature"), description=(
    "0 = greedy; higher = more random (default 1.0); a positive value below 0.01 counts as 0.01"))]
# -1 is vLLM's spelling of off (0)
TopK = Annotated[int, Field(ge=-1, le=RANGES["top_k"].hi, description="sample among the k most likely tokens; "
                            "0 or -1 = off"), INTEGER]
TopP = Annotated[float, Field(**_bounds("top_p"), description="nucleus sampling: the smallest set of tokens whose "
                              "probabilities add up to top_p (1 = off)")]
RepetitionPenalty = Annotated[float, Field(**_bounds("repetition_penalty"),
                                           description="> 1 discourages repeating tokens (1 = off)")]
Seed = Annotated[Annotated[int, Field(ge=0, le=MAX_SEED), INTEGER]
                 | Annotated[str, Field(pattern=r"^[0-9]{1,18}$")], BY_SHAPE,
                 Field(description="makes sampling reproducible; an integer, or one written as a string of digits "
                       "(as DJL's clients send it)")]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID), INTEGER]
StopText = Annotated[str, Field(min_length=1), Cap("max_stop_length"), TEXT]
Stop = Annotated[StopText | Annotated[list[StopText], Cap("max_stop_sequences")], BY_SHAPE, Field(
    description="stop sequences: generation ends before the first one (a string or a list)")]
StopTokenIds = Annotated[list[TokenId], Cap("max_stop_token_ids"), Field(
    description="token ids that end generation (ids of the model's vocabulary)")]
Logprobs = Annotated[int, Field(**_bounds("logprobs")), Cap("max_logprobs"), INTEGER]
Penalty = Annotated[float, Field(**_bounds("presence_penalty"), description="vLLM's: subtracted from a token's logit "
                                 "once it has been generated (presence) or once per time it was (frequency); 0 = off")]
MinP = Annotated[float, Field(**_bounds("min_p"),
                              description="drop tokens less likely than min_p x the likeliest (0 = off)")]
TypicalP = Annotated[float, Field(**_bounds("typical_p"), description="typical sampling's mass (1 = off)")]
MinTokens = Annotated[int, Field(**_bounds("min_tokens")), Cap("max_new_tokens"), INTEGER]
BadWords = Annotated[list[StopText], Cap("max_stop_sequences"), Field(
    description="vLLM's: words never generated (each at most max_stop_length characters)")]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(
    max_length=1024, description="token id (a string of digits) -> a bias of -100..100 added to its logit")]


class Grammar(StrictModel):
    """TGI's ``grammar`` parameter."""

    type: Literal["json", "regex", "json_schema"]
    value: Any = Field(description="the JSON schema (json), the pattern (regex), or {\"name\", \"schema\"} "
                       "(json_schema)")


class LmiParameters(StrictModel):
    """Generation parameters: LMI's and TGI's ``parameters``, the Open Inference Protocol's
    ``sampling_parameters`` and the typed gRPC ``SamplingParameters``. Every field may be null (its default)."""

    max_new_tokens: MaxNewTokens | None = Field(None, description="the most tokens to generate (default 30)")
    do_sample: bool | None = Field(None, description="sample instead of greedy decoding (default false; the TGI "
                                   "routes sample whenever a sampling parameter is set, as TGI does)")
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_sequences: Stop | None = Field(None, description="TGI's name for stop (both may be given: together at "
                                        "most max_stop_sequences)")
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = Field(None, description="keep generating after the end-of-sequence token")
    ignore_eos_token: bool | None = Field(None, description="another name of ignore_eos")
    details: bool | None = Field(None, description="answer with details: finish reason, tokens, log-probabilities")
    return_full_text: bool | None = Field(None, description="prepend the prompt to the generated text")
    logprobs: Logprobs | None = Field(None, description="with details: the k most likely alternatives of each "
                                      "token")
    top_n_tokens: Logprobs | None = Field(None, description="TGI's name for logprobs")
    decoder_input_details: bool | None = Field(None, description="with details: details.prefill lists the prompt's "
                                               "tokens with their log-probabilities (the first has none)")
    prompt_logprobs: Logprobs | None = Field(None, description="vLLM's: each prompt token's log-probability given "
                                             "those before it, with the k most likely alternatives (0: none)")
    truncate: Annotated[int, Field(ge=1, le=MAX_TOKEN_ID), INTEGER] | None = Field(
        None, description="TGI routes: keep only the last N prompt tokens; accepted and ignored by the LMI routes")
    watermark: Annotated[bool, Only((False,), "is not supported: only false or null is accepted")] | None = None
    typical_p: TypicalP | None = None
    best_of: Annotated[int, Field(ge=1), Cap("max_n"), INTEGER] | None = Field(
        None, description="sample this many candidates, answer the likeliest (the others in "
        "details.best_of_sequences); needs sampling, not with stream; gRPC: only 1")
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = Field(None, description="no end-of-sequence or stop token before this many tokens")
    bad_words: BadWords | None = None
    num_beams: Annotated[int, Field(**_bounds("num_beams")), INTEGER] | None = Field(
        None, description="beam search with this many beams (dynamic batching; the rolling engine refuses > 1)")
    length_penalty: Annotated[float, Field(**_bounds("length_penalty"))] | None = Field(
        None, description="beam search: the score is the log-probability sum over length ** length_penalty")
    early_stopping: bool | None = Field(None, description="beam search: stop once num_beams answers are complete")
    logit_bias: LogitBias | None = None
    include_stop_str_in_output: bool | None = Field(None, description="keep the stop string that ended the answer")
    skip_special_tokens: bool | None = Field(None, description="false: keep special tokens' text (default true)")
    grammar: Grammar | None = Field(None, description="TGI's constraint: {\"type\": \"json\", \"value\": SCHEMA} or "
                                    "{\"type\": \"regex\", \"value\": PATTERN}")
    guided_json: dict[str, Any] | str | None = Field(None, description="the answer is JSON valid under this schema")
    guided_regex: str | None = Field(None, description="the answer matches this regular expression")
    guided_choice: list[str] | None = Field(None, description="the answer is one of these strings")
    guided_grammar: str | None = Field(None, description="the answer follows this grammar (Lark, or GBNF)")
    adapter_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="TGI's: the LoRA adapter to answer with (a model with option.enable_lora)")


PARAMETERS = RequestSchema(LmiParameters, params_at=())


def sampling_params(values: Mapping[str, Any], limits: Limits) -> SamplingParams:
    """Validated values keyed by ``SamplingParams`` field names (None = default) -> ``SamplingParams``:
    ``stop`` is a tuple of stop fields (each null, a string or a list; they add up); a positive temperature
    below ``MIN_TEMPERATURE`` is raised to it (as vLLM: smaller ones overflow the logits), ``top_k`` -1 (vLLM's
    "off") is 0 (LMI's). Raises ``InvalidRequest`` for values that do not go together (``check_sampling``)."""
    kw: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
    stops: list[str] = []
    for item in kw.pop("stop", ()):
        if item is not None:
            stops.extend([item] if isinstance(item, str) else item)
    if len(stops) > limits.max_stop_sequences:
        raise InvalidRequest(f"parameters 'stop' and 'stop_sequences' have {len(stops)} entries together; at most "
                             f"{limits.max_stop_sequences} (max_stop_sequences)")
    kw["stop"] = tuple(stops)
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"])
    t = kw.get("temperature")
    if t is not None and 0.0 < t < MIN_TEMPERATURE:
        kw["temperature"] = MIN_TEMPERATURE
    if kw.get("top_k") == -1:
        kw["top_k"] = 0
    if isinstance(kw.get("seed"), str):
        kw["seed"] = int(kw["seed"])
    if "logit_bias" in kw:
        kw["logit_bias"] = logit_bias(kw["logit_bias"])
    params = SamplingParams(**kw)
    check_sampling(params)  # what no single field says (min_tokens <= max_new_tokens), before any work
    return params


def logit_bias(biases: Mapping[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings of digits) -> sorted (id, bias) pairs."""
    out = []
    for key, bias in biases.items():
        if not key.isdigit() or int(key) > MAX_TOKEN_ID:
            raise InvalidRequest(f"'logit_bias' keys must be token ids (strings of digits), got {key!r}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def lmi_sampling_params(p: LmiParameters, limits: Limits) -> SamplingParams:
    """A validated ``LmiParameters`` -> ``SamplingParams`` (TGI's names count as their LMI twins)."""
    return sampling_params({
        "max_new_tokens": p.max_new_tokens, "do_sample": p.do_sample, "temperature": p.temperature,
        "top_k": p.top_k, "top_p": p.top_p, "repetition_penalty": p.repetition_penalty, "seed": p.seed,
        "stop": (p.stop, p.stop_sequences), "stop_token_ids": p.stop_token_ids,
        "ignore_eos": p.ignore_eos if p.ignore_eos is not None else p.ignore_eos_token, "details": p.details,
        "return_full_text": p.return_full_text, "logprobs": p.logprobs if p.logprobs is not None else p.top_n_tokens,
        "typical_p": p.typical_p, "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
        "min_p": p.min_p, "min_tokens": p.min_tokens, "logit_bias": p.logit_bias,
        "bad_words": tuple(p.bad_words) if p.bad_words else None, "num_beams": p.num_beams,
        "length_penalty": p.length_penalty, "early_stopping": p.early_stopping,
        "include_stop_str_in_output": p.include_stop_str_in_output, "skip_special_tokens": p.skip_special_tokens,
        "adapter": p.adapter_id,
        "prompt_logprobs": p.prompt_logprobs if p.prompt_logprobs is not None else (
            0 if p.decoder_input_details and p.details else None),
        "grammar": structured.one_of(
            ("grammar", structured.from_response_format(p.grammar.model_dump(), "grammar")
             if p.grammar is not None else None),
            ("guided_*", structured.from_guided({k: getattr(p, k) for k in structured.GUIDED_FIELDS}))),
    }, limits)


def build_sampling_params(values: Mapping[str, Any], limits: Limits) -> SamplingParams:
    """Parameters keyed by their LMI names (the typed gRPC message's fields) -> validated SamplingParams."""
    return lmi_sampling_params(PARAMETERS.validate(dict(values), limits), limits)


def single_candidate(p: LmiParameters) -> LmiParameters:
    """``p``, refusing what only the HTTP routes answer where it would be computed and dropped (gRPC OIP, custom
    handlers): ``best_of`` > 1 and the prompt's log-probabilities."""
    if (p.best_of or 1) > 1:
        raise InvalidRequest(f"parameter 'best_of' > 1 (got {p.best_of}) is answered by the HTTP routes of the "
                             "built-in text handlers (LMI, TGI, OpenAI completions); here only 1")
    if p.prompt_logprobs is not None or p.decoder_input_details:
        raise InvalidRequest("parameters 'prompt_logprobs' and 'decoder_input_details' are answered by the HTTP "
                             "routes (LMI, TGI, OpenAI): this answer has no place for the prompt's scores")
    return p


def check_best_of(best_of: int, params: SamplingParams, stream: bool) -> None:
    """TGI's and DJL's ``best_of`` > 1: sampled candidates, answered whole."""
    if best_of > 1 and not params.do_sample:
        raise InvalidRequest("parameter 'best_of' > 1 needs sampling (do_sample, or a sampling parameter): greedy "
                             "candidates would all be the same")
    if best_of > 1 and stream:
        raise InvalidRequest("parameter 'best_of' > 1 cannot stream: the best candidate is known only at the end")


def parse_lmi_parameters(params: Any, limits: Limits, *, strict: bool = True,
                         ignored: list[str] | None = None) -> SamplingParams:
    """The LMI/TGI ``parameters`` object -> SamplingParams. Unknown names -> 400 listing them (dropped into
    ``ignored`` when not ``strict``)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, dict):
        raise type_error("parameters", "an object", params)
    return lmi_sampling_params(single_candidate(PARAMETERS.validate(params, limits, strict=strict, ignored=ignored)),
                               limits)


def check_text(name: str, v: Any, *, allow_empty: bool = False, max_chars: int = 1_000_000) -> str:
    """A client string outside a model (gRPC prompts): a str, valid Unicode (no lone surrogates), non-empty
    unless allowed, at most ``max_chars`` characters. Same messages as the models'."""
    if not isinstance(v, str):
        raise type_error(name, "a string", v)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name!r} contains invalid Unicode (a lone surrogate)") from None
    if not allow_empty and not v:
        raise InvalidRequest(f"{name!r} must not be empty")
    if len(v) > max_chars:
        raise InvalidRequest(f"{name!r} has {len(v)} characters; at most {max_chars}")
    return v


def check_sequences(num: int, limits: Limits, what: str = "'inputs'") -> None:
    """One request may ask for at most ``max_sequences_per_request`` sequences (prompts x n)."""
    if num > limits.max_sequences_per_request:
        raise InvalidRequest(f"{what} asks for {num} sequences; at most {limits.max_sequences_per_request} per "
                             "request (max_sequences_per_request)")


def check_wire_value(name: str, value: Any) -> None:
    """A raw JSON value that travels to a worker as is (a custom handler's payload): integers must fit in 64
    bits, strings must be valid Unicode, nesting at most ``MAX_PAYLOAD_DEPTH``. Raises ``InvalidRequest``
    naming the path of the first bad value (``body.parameters.foo[2]``)."""
    stack: list[tuple[str, Any, int]] = [(name, value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise InvalidRequest(f"{path!r} is nested more than {MAX_PAYLOAD_DEPTH} levels deep")
        if isinstance(v, bool) or v is None or isinstance(v, float):
            continue
        if isinstance(v, int):
            if not _INT64_MIN <= v <= _UINT64_MAX:
                raise InvalidRequest(f"{path!r} is an integer of {v.bit_length()} bits; integers must fit in "
                                     "64 bits")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"{path!r} contains invalid Unicode (a lone surrogate)") from None
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(v))
        elif isinstance(v, dict):
            for k, item in v.items():
                check_text(f"{path} key", k, allow_empty=True, max_chars=1 << 20)
                stack.append((f"{path}.{k}", item, depth + 1))
        else:
            raise InvalidRequest(f"{path!r} has an unsupported type {kind_of(v)}")
