"""The engine's decode attention on GPUs: one Triton kernel per layer that reads KV blocks in place.

Design note: the GPU backend of the ``PagedKernels`` interface (``handlers.engine.execution.kernels.native`` is the CPU
one, in C). ``decode`` takes the same decode plan (``paged_attention.DecodePlan``: per row the query row, the first and
end key positions and the offset of its block table) and runs every decode row of the step in one launch:
a program per (row, KV head) walks the row's block table with an online softmax over the query heads of that
KV head's group, so grouped-query attention reads each KV block once per group and no KV is gathered or
copied. Sliding windows come in as the first key position, soft-capping and sinks as flags, so every family
the CPU kernel serves is served here. The launch's grid depends only on the number of rows and heads, and
its loop bounds are read from the plan on the device, so a CUDA graph captures it for a batch size once.
``write_kv`` declines (returns False): ``index_copy_`` is one fused kernel on a GPU already.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors: that is how the CPU test
suite checks it against the engine's reference attention.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _kernels():  # type: ignore[no-untyped-def]
    """The Triton kernels, imported lazily: importing triton costs a second, and CPU workers never need it."""
    from handlers.engine.execution.gpu import triton_decode

    return triton_decode


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonPagedKernels:
    """``PagedKernels`` for tensors on a GPU (or on the CPU under Triton's interpreter).

    ``matrix_units``: the kernel that reads several KV blocks per iteration and scores them with ``tl.dot``
    (``paged_decode_dot``; measured the faster one); when it fails to compile on a device, the plain kernel
    (``paged_decode``) takes over for good, logged."""

    def __init__(self, matrix_units: bool = True) -> None:
        self.matrix_units = matrix_units

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        return False  # the caller's index_copy_ is already one kernel per tensor on a GPU

    prefill = None  # prompt chunks: SDPA takes the device's flash kernel (and its result is used as a view)

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               meta: torch.Tensor, tables: torch.Tensor, block_size: int, scale: float, softcap: float | None,
               sinks: torch.Tensor | None) -> bool:
        """The decode rows of ``meta`` (see ``kernels.PagedKernels.decode``: same arguments, same layouts);
        False when the shapes are beyond the kernel (block size not a power of two, or one kernel per head
        group of more than 64 heads)."""
        num_heads, head_dim = query.shape[1], query.shape[3]
        num_kv = k_cache.shape[0]
        if (block_size & (block_size - 1) or num_heads % num_kv or num_heads // num_kv > 64
                or k_cache.stride(2) != 1 or query.stride(3) != 1 or out.stride(3) != 1):
            return False
        group = num_heads // num_kv
        if meta.shape[0] == 0:
            return True
        sinks_arg = sinks.detach().contiguous() if sinks is not None else meta  # any pointer when unused
        args = (query, query.stride(2), query.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
                out, out.stride(1), out.stride(2), meta, tables, sinks_arg, float(scale), float(softcap or 1.0))
        common = {"GROUP": group, "HEAD_DIM": head_dim, "D_PAD": max(16, _pow2(head_dim)), "BLOCK": block_size,
                  "HAS_SOFTCAP": softcap is not None, "HAS_SINKS": sinks is not None}
        grid = (meta.shape[0], num_kv)
        if self.matrix_units:
            try:
                _kernels().paged_decode_dot[grid](*args, GROUP_PAD=max(16, _pow2(group)),
                                                  TILE=max(block_size, 64), EXACT=query.dtype == torch.float32,
                                                  **common)
                return True
            except Exception as exc:  # noqa: BLE001 (a compiler's refusal: the plain kernel serves instead)
                logger.warning("the matrix-unit decode kernel does not build here (%s: %s); using the plain one",
                               type(exc).__name__, str(exc)[:300])
                self.matrix_units = False
        _kernels().paged_decode[grid](*args, GROUP_PAD=_pow2(group), **common)
        return True
