"""The decode-attention kernel alone, as a decode step streams it: one call per layer over every sequence's KV.

B sequences of C tokens each, SmolLM2-135M's heads (9 query heads sharing 3 KV heads of 64) by default, a
separate KV pool per layer on anonymous memory with huge pages (as the engine's pool), 30 layers called in turn,
so each call reads its layer's keys and values from memory, not from a cache the previous call filled. Prints the
median time per layer call and the KV bytes a second it reads, and checks the output against PyTorch's attention:

    taskset -c 0 .venv/bin/python benchmarks/decode_attention.py --batch 32 --context 128
    taskset -c 0 .venv/bin/python benchmarks/decode_attention.py --library /tmp/other.so   # a rebuilt kernel
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from handlers.engine.execution.forward.lazy_memory import ZeroRegion  # noqa: E402
from handlers.engine.execution.kernels.native import PagedKernels, load_kernels  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--library", help="a shared object built from csrc/paged_attention.c (default: the engine's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernels = PagedKernels(ctypes.CDLL(args.library)) if args.library else load_kernels()
    if kernels is None:
        raise SystemExit("the kernel could not be built here (no C compiler?)")
    b, ctx, h, hkv, d, bs = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    blocks = -(-ctx // bs)
    slots = b * blocks * bs
    torch.manual_seed(0)
    regions, pools = [], []
    for _ in range(args.layers):
        pair = []
        for _ in range(2):
            region = ZeroRegion(hkv * slots * d * 4)
            pool = region.view(0, (hkv, slots, d), torch.float32)
            pool.normal_()
            regions.append(region)
            pair.append(pool)
        pools.append(tuple(pair))
    q = torch.randn(1, h, b, d)
    out = torch.empty(1, b, h, d)
    meta = torch.tensor([[i, 0, ctx, i * blocks] for i in range(b)], dtype=torch.int64)
    tables = torch.arange(b * blocks, dtype=torch.int32)
    scale = d ** -0.5

    def step() -> None:
        for k_pool, v_pool in pools:
            kernels.decode(q, k_pool, v_pool, out, meta, tables, bs, scale, None, None)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) / args.layers)
    per_layer = statistics.median(times)
    kv_bytes = 2 * hkv * b * ctx * d * 4
    k_pool, v_pool = pools[-1]
    keys = k_pool.view(hkv, b, blocks * bs, d)[:, :, :ctx].transpose(0, 1)
    values = v_pool.view(hkv, b, blocks * bs, d)[:, :, :ctx].transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q[0].transpose(0, 1)[:, :, None], keys, values,
                                                            scale=scale, enable_gqa=True)[:, :, 0]
    error = (want - out[0]).abs().max().item()
    print(f"B={b} ctx={ctx} heads {h}/{hkv}x{d}, block {bs}, {args.layers} layers: {per_layer * 1e3:.3f} ms per "
          f"layer call (min {min(times) * 1e3:.3f}), {kv_bytes / per_layer / 1e9:.1f} GB/s of KV; "
          f"max abs error {error:.1e}")


if __name__ == "__main__":
    main()
