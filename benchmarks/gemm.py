"""The decode step's GEMMs alone: our prepacked linear against ``F.linear`` and vLLM's oneDNN matmul.

A stack of the 110m model's linear shapes (12 layers of fused QKV 2304x768, output 768x768, fused gate/up
6144x768, down 768x3072, then the lm_head 8192x768: 340 MB of fp32 weights, streamed from memory every step
as in the engine) run on ``--rows`` rows; prints the median step time and the CPU time per step. ``--shapes
smollm2`` runs SmolLM2-135M's 30 layers as the engine has them (q, k, v, o, gate, up, down: 424 MB), ``--shapes
smollm2-fused`` with QKV and gate/up fused, ``--no-head`` leaves the LM head out.

    .venv/bin/python benchmarks/gemm.py packed --threads 2           #
    handlers.engine.execution.kernels.prepack.PackedLinear
    .venv/bin/python benchmarks/gemm.py plain --threads 2            # F.linear on the plain weight
    benchmarks/.venv-vllm/bin/python benchmarks/gemm.py vllm --threads 2   # vLLM's create_onednn_mm/onednn_mm
    .venv/bin/python benchmarks/gemm.py packed-all --rows 2048              # the packed weight at any row count
    .venv/bin/python benchmarks/gemm.py panel --shapes smollm2 --rows 8     #
    handlers.engine.execution.kernels.panel_linear
    OPENBLAS_NUM_THREADS=2 .venv/bin/python benchmarks/gemm.py openblas --threads 2 --rows 2048
                                         # numpy's OpenBLAS (sgemm into the torch tensor), for comparison only

``plain`` is MKL's sgemm (what ``F.linear`` runs for fp32 on x86), ``packed`` the engine's hybrid
``PackedLinear`` (oneDNN up to 128 rows, then the plain weight), ``packed-all`` oneDNN at every row count
(rounded up to ``packed_rows``), ``panel`` the panel kernel at every row count (``PanelLinear``, fp32), ``vllm``
vLLM's oneDNN matmul.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
LAYER_SHAPES = [(2304, 768), (768, 768), (6144, 768), (768, 3072)]  # (out, in) per decoder layer
LM_HEAD = (8192, 768)
SHAPES = {  # name -> (layer shapes (out, in), layers, LM head)
    "110m": (LAYER_SHAPES, 12, LM_HEAD),
    "smollm2": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)], 30,
                (49152, 576)),
    "smollm2-fused": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
}


def build(mode: str, weights: list[torch.Tensor]) -> list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]]:
    fns: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = []
    for w in weights:
        if mode == "plain":
            fns.append((w.shape[1], lambda x, w=w: F.linear(x, w)))
        elif mode in ("packed", "packed-all"):
            sys.path.insert(0, str(REPO))
            from handlers.engine.execution.kernels.prepack import HYBRID_MAX_PACKED_ROWS, PackedLinear

            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data = w
            fns.append((w.shape[1], PackedLinear(lin, max_packed_rows=HYBRID_MAX_PACKED_ROWS
                                                 if mode == "packed" else None)))
        elif mode == "panel":
            sys.path.insert(0, str(REPO))
            from handlers.engine.execution.kernels.panel_linear import PanelLinear, load_panel_kernel

            kernel = load_panel_kernel()
            if kernel is None:
                raise SystemExit("the panel kernel did not build here (no C compiler?)")
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data = w
            fns.append((w.shape[1], PanelLinear(lin, kernel)))
        elif mode == "openblas":
            import numpy as np

            def blas(x: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
                out = x.new_empty(x.shape[0], w.shape[0])
                np.matmul(x.numpy(), w.numpy().T, out=out.numpy())
                return out

            fns.append((w.shape[1], blas))
        else:
            from vllm import _custom_ops as ops  # type: ignore[import-not-found]

            handler = ops.create_onednn_mm(w.t(), 32)
            fns.append((w.shape[1], lambda x, h=handler: ops.onednn_mm(h, x, None)))
    return fns


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["packed", "packed-all", "plain", "panel", "openblas", "vllm"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=32, help="rows of each matmul (decode: running sequences)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="110m", help="whose linear layers")
    ap.add_argument("--no-head", action="store_true", help="the decoder layers only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer, layers, head = SHAPES[args.shapes]
    shapes = layer * layers + ([] if args.no_head else [head])
    fns = build(args.mode, [torch.randn(n, k) * 0.02 for n, k in shapes])
    xs = {k: torch.randn(args.rows, k) for _, k in shapes}

    def step() -> None:
        with torch.inference_mode():
            for k, f in fns:
                f(xs[k])

    for _ in range(3):
        step()
    times = []
    cpu0 = time.process_time()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / args.steps
    gflop = 2 * args.rows * sum(n * k for n, k in shapes) / 1e9
    print(f"{args.mode}, {args.threads} thread(s), {args.rows} rows: step median {1000 * statistics.median(times):.1f} "
          f"ms (min {1000 * min(times):.1f}), CPU {1000 * cpu:.1f} ms a step, "
          f"{gflop / statistics.median(times):.1f} GFLOP/s")


if __name__ == "__main__":
    main()
