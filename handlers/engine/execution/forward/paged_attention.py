"""The paged-attention function plugged into transformers models through ``AttentionInterface``.

Design note: the model runs one flat batch ``[1, T]`` of tokens from many sequences with no cache
object (``use_cache=False``); each attention call finds this step's ``StepMetadata`` through the
``StepContext`` the runner attached to the model's attention modules (some families do not forward
extra kwargs to attention, so a kwarg would not reach them). The function writes the step's new K/V
into the layer's slots of the preallocated pool (in place), then attends per sequence against that
sequence's cached KV. A sequence whose blocks are contiguous is read as a view of the pool (no copy);
otherwise its slots are gathered.

Devices: the pool, the step's slot mapping and every index or mask built here live on the pool's device;
decode rows go to ``meta.kernels`` (the C kernel on CPU, ``gpu_attention``'s Triton kernel on a GPU), prefill
chunks to the C prefill kernel on CPU (``csrc/prefill_attention.c``), else to SDPA, which picks the device's fused
kernel.

Attention features: per-layer sliding windows (a query at position p sees keys (p - window, p], as
transformers' masks), logit soft-capping (Gemma-2) and attention sinks (gpt-oss ``s_aux``). Plain
attention runs the native kernels (else SDPA's fused kernel); soft-capping and sinks run an exact eager path. Any other
attention argument with a value raises ``UnsupportedAttentionFeature``: the engine probes one forward
at load, so a model needing a feature the engine lacks is refused by name, never served wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from handlers.engine.core.speculative import MAX_SPECULATIVE_TOKENS
from handlers.engine.execution.forward.lazy_memory import ZeroRegion
from handlers.engine.execution.kernels.native import PagedKernels
from handlers.engine.planning.families import UnsupportedModel

ATTN_IMPLEMENTATION = "rollserve_paged"
# A chunk of at most this many tokens after cached ones (speculative decoding's last token and guesses) goes to
# the decode kernel as one row per token, instead of a masked attention call of its own.
MAX_ROWS_AS_DECODES = MAX_SPECULATIVE_TOKENS + 1
CONTEXT_ATTR = "rollserve_context"

# Arguments transformers passes to attention that carry no attention semantics (bookkeeping for caches,
# routers and masks the engine builds itself).
_NEUTRAL_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits",
                             "cache_position", "past_key_values", "past_key_value", "layer_head_mask",
                             "is_causal", "output_hidden_states", "return_dict"})


class UnsupportedAttentionFeature(UnsupportedModel):
    """A model asked the attention for something the engine does not implement (named in the message)."""


class KVPool:
    """Preallocated KV memory: per layer one key and one value tensor of shape [Hkv, num_slots, D].

    Head-major so that a contiguous slot range is, per head, one contiguous run of rows: the CPU flash
    attention kernel reads such a view as fast as a contiguous tensor."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, populate: str = "eager",
                 device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.device = torch.device(device)
        shape = (num_kv_heads, num_slots, head_dim)
        if self.device.type != "cpu":  # device memory: one allocation per tensor from the device's allocator
            self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            return
        # One zeroed anonymous mapping for every layer: touched now (eager) or page by page on first use (lazy);
        # lazy_memory's note has the measured trade-off.
        per_tensor = num_kv_heads * num_slots * head_dim * dtype.itemsize
        self.region = ZeroRegion(2 * num_layers * per_tensor, populate)
        self.keys = [self.region.view(2 * i * per_tensor, shape, dtype) for i in range(num_layers)]
        self.values = [self.region.view((2 * i + 1) * per_tensor, shape, dtype) for i in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One sequence's part of the step, independent of the layer: query rows [q_start, q_start + num_new)
    are its tokens at positions [start, start + num_new); ``block_table`` covers its first start + num_new
    tokens (entries wholly before every layer's window may be stale: they are never read)."""

    q_start: int
    start: int
    num_new: int
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SeqAttention:
    """How one layer reads one sequence: query rows [q_start, q_end) against ``kv_len`` keys at positions
    [kv_pos, kv_pos + kv_len). KV is ``pool[kv_slot_start : kv_slot_start + kv_len]`` when ``kv_index`` is
    None, else ``pool[kv_index]``. ``mask`` (bool [q, kv_len], True = visible) or ``causal`` (keys and
    queries start at the same position) shape it; neither means every key is visible (decode).
    """

    q_start: int
    q_end: int
    kv_pos: int
    kv_len: int
    kv_slot_start: int
    kv_index: torch.Tensor | None
    mask: torch.Tensor | None
    causal: bool


_CPU = torch.device("cpu")
# kernels.prefill(query [n, H, D], key [Hkv, L, D], value, out [n, H, D], window, scale) -> done
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], bool]


def seq_attention(span: SeqSpan, block_size: int, window: int = 0, device: torch.device = _CPU) -> SeqAttention:
    """The keys one sequence's queries read in a layer with sliding ``window`` (0 = full attention); its
    index and mask tensors on ``device`` (the pool's; default CPU)."""
    bs = block_size
    start, n = span.start, span.num_new
    end = start + n
    lo = max(0, start - window + 1) if window else 0  # first key the first query sees
    table = span.block_table
    b0, b1 = lo // bs, (end - 1) // bs
    contiguous = table[b1] - table[b0] == b1 - b0 and (
        b1 - b0 < 2 or all(table[i + 1] == table[i] + 1 for i in range(b0, b1)))
    index = None
    if not contiguous:
        blocks = torch.tensor(table[b0:b1 + 1], dtype=torch.long, device=device)
        index = (blocks[:, None] * bs + torch.arange(bs, device=device)).flatten()[lo - b0 * bs:end - b0 * bs]
    mask = None
    causal = False
    if n > 1:
        if lo == start and (not window or n <= window):
            causal = True
        else:
            q_pos = torch.arange(start, end, device=device)[:, None]
            k_pos = torch.arange(lo, end, device=device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
    return SeqAttention(span.q_start, span.q_start + n, lo, end - lo, table[b0] * bs + lo - b0 * bs, index, mask,
                        causal)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The step's decode rows for the native kernel (``handlers.engine.execution.kernels.native``): ``meta`` [n, 4]
    int64 (query row, first key position, end key position, offset of the block table in ``tables``), ``tables``
    the block tables concatenated (int32); ``rest`` the views of the other sequences (prefill chunks)."""

    meta: torch.Tensor
    tables: torch.Tensor
    rest: tuple[SeqAttention, ...]


@dataclass(slots=True)
class StepMetadata:
    """What every attention layer needs for one step; built once per step by the runner. Per-window views
    of the sequences (and decode plans) are built by the first layer that needs them and shared by the
    others. ``kernels``: the native decode kernel, when loaded."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token
    spans: tuple[SeqSpan, ...]
    block_size: int
    kernels: PagedKernels | None = None
    _views: dict[int, tuple[SeqAttention, ...]] = field(default_factory=dict)
    _plans: dict[int, DecodePlan | None] = field(default_factory=dict)

    def views(self, window: int = 0) -> tuple[SeqAttention, ...]:
        found = self._views.get(window)
        if found is None:
            found = tuple(seq_attention(s, self.block_size, window, self.pool.device) for s in self.spans)
            self._views[window] = found
        return found

    def decode_plan(self, window: int = 0) -> DecodePlan | None:
        """The decode rows of this step for the kernel, or None when there are none."""
        if window in self._plans:
            return self._plans[window]
        rows: list[int] = []
        tables: list[int] = []
        rest = []
        for span in self.spans:
            if span.num_new != 1 and not (span.start > 0 and span.num_new <= MAX_ROWS_AS_DECODES):
                rest.append(seq_attention(span, self.block_size, window, self.pool.device))
                continue
            # Each query at position p reads keys [lo, p] (seq_attention's range for one query, without its view);
            # a short chunk after cached tokens (a decode with guesses) is read as that many decode rows.
            offset = len(tables)
            for i in range(span.num_new):
                p = span.start + i
                rows += [span.q_start + i, max(0, p - window + 1) if window else 0, p + 1, offset]
            tables += span.block_table
        plan = None
        if rows:
            # built on the host, then one copy each to the pool's device
            device = self.pool.device
            plan = DecodePlan(on_device(torch.tensor(rows, dtype=torch.int64, device="cpu").view(-1, 4), device),
                              on_device(torch.tensor(tables, dtype=torch.int32, device="cpu"), device), tuple(rest))
        self._plans[window] = plan
        return plan


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor built from Python lists, on ``device`` (an asynchronous copy from pinned memory on a GPU)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class StepContext:
    """Holder of the step being run, shared by the runner and every attention module of its model."""

    meta: StepMetadata | None = None
    calls: int = 0  # attention calls since the runner last reset it (the load-time probe counts layers)
    windows: dict[int, int] = field(default_factory=dict)  # layer -> sliding window of its last call (0: none)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None).
    ``attention_mask`` (transformers' mask over the flat batch) is ignored: the engine masks per sequence."""
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL_KWARGS)
    if unknown:
        raise UnsupportedAttentionFeature(
            f"{type(module).__name__} passes attention argument(s) {', '.join(unknown)} that the rolling engine "
            "does not implement")
    context = getattr(module, CONTEXT_ATTR, None)
    if not isinstance(context, StepContext) or context.meta is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside an engine step")
    meta = context.meta
    context.calls += 1
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache = meta.pool.keys[layer]
    v_cache = meta.pool.values[layer]
    if meta.kernels is None or not meta.kernels.write_kv(key[0], value[0], k_cache, v_cache, meta.slot_mapping):
        k_cache.index_copy_(1, meta.slot_mapping, key[0])  # key[0]: [Hkv, T, D]
        v_cache.index_copy_(1, meta.slot_mapping, value[0])
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    eager = softcap is not None or s_aux is not None
    window = int(sliding_window or 0)
    context.windows[layer] = window
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [1, T, H, D]
    prefill = meta.kernels.prefill if meta.kernels is not None and not eager else None
    views: tuple[SeqAttention, ...] | None = None
    if meta.kernels is not None and query.stride(3) == 1:
        plan = meta.decode_plan(window)
        if plan is not None and meta.kernels.decode(query, k_cache, v_cache, out, plan.meta, plan.tables,
                                                    meta.block_size, scaling, softcap, s_aux):
            views = plan.rest
    if views is None:
        views = meta.views(window)
        if len(views) == 1 and prefill is None:  # SDPA's result as a view, without a copy into ``out``
            return _attend(query, k_cache, v_cache, views[0], scaling, eager, softcap, s_aux).transpose(1, 2), None
    for s in views:
        q = query[:, :, s.q_start:s.q_end]
        if prefill is None or not _prefill_kernel(prefill, q, k_cache, v_cache, s, out, window, scaling):
            out[:, s.q_start:s.q_end] = _attend(q, k_cache, v_cache, s, scaling, eager, softcap, s_aux).transpose(1, 2)
    return out, None


def _prefill_kernel(prefill: PrefillKernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    s: SeqAttention, out: torch.Tensor, window: int, scaling: float) -> bool:
    """One sequence's chunk through the native prefill kernel, written into its rows of ``out``; False when the
    kernel declines (the caller then runs SDPA)."""
    if s.kv_index is None:
        k = k_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len]  # [Hkv, L, D], a view
        v = v_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len]
    else:
        k, v = k_cache.index_select(1, s.kv_index), v_cache.index_select(1, s.kv_index)
    return prefill(q[0].transpose(0, 1), k, v, out[0, s.q_start:s.q_end], window, scaling)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: SeqAttention, scaling: float,
            eager: bool, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of one sequence's queries [1, H, q, D] against its KV; returns [1, H, q, D].
    (4-D inputs, so SDPA takes the device's flash kernel.)"""
    if s.kv_index is None:
        k = k_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len].unsqueeze(0)  # [1, Hkv, L, D], a view
        v = v_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len].unsqueeze(0)
    else:
        k = k_cache.index_select(1, s.kv_index).unsqueeze(0)
        v = v_cache.index_select(1, s.kv_index).unsqueeze(0)
    if eager:
        return _attend_eager(q, k, v, s, scaling, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, is_causal=s.causal, scale=scaling,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: SeqAttention, scaling: float,
                  softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Explicit softmax attention with soft-capped logits and/or a per-head sink logit, computed in fp32
    as transformers' eager reference does. Query heads are grouped by their KV head (no KV copy)."""
    _, num_heads, n, head_dim = q.shape
    num_kv = k.shape[1]
    g = num_heads // num_kv
    qg = q.reshape(1, num_kv, g * n, head_dim).float()
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scaling).view(1, num_kv, g, n, s.kv_len)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = s.mask
    if mask is None and s.causal:
        mask = torch.ones(n, s.kv_len, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, num_kv, g, 1, 1).expand(1, num_kv, g, n, 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(1, num_kv, g * n, s.kv_len), v)  # [1, Hkv, g*n, D]
    return out.view(1, num_heads, n, head_dim)
