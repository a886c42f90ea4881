"""The Triton source of the GPU decode kernel (``handlers.engine.execution.gpu.gpu_attention`` calls it; its note says
how it works). Imported only when a kernel is launched, so that CPU workers never import triton."""

import triton
import triton.language as tl


@triton.jit
def paged_decode(q_ptr, q_stride_t, q_stride_h, k_ptr, v_ptr, kv_stride_h, kv_stride_s, o_ptr, o_stride_t,
                 o_stride_h, meta_ptr, tables_ptr, sinks_ptr, scale, softcap,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(meta_ptr + r * 4)  # the plan's row: query row, first and end key positions, table offset
    lo = tl.load(meta_ptr + r * 4 + 1)
    end = tl.load(meta_ptr + r * 4 + 2)
    table = tl.load(meta_ptr + r * 4 + 3)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK)
    for b in range(lo // BLOCK, (end + BLOCK - 1) // BLOCK):
        block = tl.load(tables_ptr + table + b).to(tl.int64)
        pos = b * BLOCK + n
        valid = (pos >= lo) & (pos < end)
        offsets = kvh * kv_stride_h + (block * BLOCK + n)[:, None] * kv_stride_s + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + offsets, mask=kvmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offsets, mask=kvmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if HAS_SINKS:  # one more logit per head that takes probability mass and gives no value
        sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / den[:, None]
    tl.store(o_ptr + row * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def paged_decode_dot(q_ptr, q_stride_t, q_stride_h, k_ptr, v_ptr, kv_stride_h, kv_stride_s, o_ptr, o_stride_t,
                     o_stride_h, meta_ptr, tables_ptr, sinks_ptr, scale, softcap,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK: tl.constexpr, TILE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                     EXACT: tl.constexpr):
    """``paged_decode`` on matrix units: a tile of TILE keys (several KV blocks, each token's block looked up
    in the table) per iteration, scores and the weighted sum as two ``tl.dot``s of the head group (padded to
    16 rows) against the tile. ``EXACT`` (fp32 models) keeps fp32 products (no TF32)."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(meta_ptr + r * 4)
    lo = tl.load(meta_ptr + r * 4 + 1)
    end = tl.load(meta_ptr + r * 4 + 2)
    table = tl.load(meta_ptr + r * 4 + 3)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    n = tl.arange(0, TILE)
    for t in range(lo // TILE, (end + TILE - 1) // TILE):
        pos = t * TILE + n
        valid = (pos >= lo) & (pos < end)
        block = tl.load(tables_ptr + table + pos // BLOCK, mask=valid, other=0).to(tl.int64)
        offsets = kvh * kv_stride_h + (block * BLOCK + pos % BLOCK)[:, None] * kv_stride_s + d[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + offsets, mask=kvmask, other=0.0).to(tl.float32)
        if EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GROUP_PAD, TILE]
        else:  # TF32 holds bf16 and fp16 inputs exactly; the products accumulate in fp32
            s = tl.dot(q, tl.trans(k), input_precision="tf32") * scale
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offsets, mask=kvmask, other=0.0).to(tl.float32)
        if EXACT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32")
        m = m_new
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / den[:, None]
    tl.store(o_ptr + row * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask)
