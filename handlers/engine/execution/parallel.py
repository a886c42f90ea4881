"""Tensor parallelism for the rolling engine: N ranks per worker through ``torch.distributed``.

Design note (Megatron-style, on stock transformers modules): every rank holds 1/N of the attention heads
(rows of ``q/k/v_proj``, columns of ``o_proj``) and 1/N of the MLP (rows of ``gate/up_proj``, columns of
``down_proj``); a forward hook all-reduces the outputs of the attention and MLP blocks (after ``o_proj``
and ``down_proj``). Embeddings, norms and
``lm_head`` are replicated, so every rank computes the same logits. Transformers' attention reshapes with
``-1`` heads, so sharded projections need no module changes; the paged attention sees ``Hkv / N`` heads and
each rank's KV pool holds only its heads.

Rank 0 is the worker process: it owns scheduling, sampling and IPC, and broadcasts each step's flat batch
(``StepInputs`` packed into one int64 tensor) before running it; ranks 1..N-1 are child processes started
by rank 0 (``python -m handlers.engine.execution.parallel``) that load their shard, then loop: receive a step, run the
model, repeat. A failed collective is fatal for the whole group: the worker exits and is restarted by the
frontend's pool, which respawns its ranks. Single node; the group address is a loopback TCP port chosen by
rank 0.

Devices: on CPU one gloo group does everything. On GPUs (the worker's ``CUDA_VISIBLE_DEVICES`` lists its group,
``serving.devices``) rank r runs on ``cuda:r``; the all-reduces go through NCCL on device tensors, and the
step broadcasts, which are host-side integers, through a second group on gloo, so no step is copied to a
device and back. Each rank loads and shards its model on the host, then moves its shard to its device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from handlers.engine.execution.runner import StepInputs

logger = logging.getLogger(__name__)

_STOP = -1


def pack_step(inputs: StepInputs) -> torch.Tensor:
    """A step as one int64 tensor: counts, ids, positions, slots, kept rows, then each sequence."""
    flat = [len(inputs.input_ids), len(inputs.seqs), len(inputs.keep), *inputs.input_ids, *inputs.positions,
            *inputs.slots, *inputs.keep]
    for q0, start, num_new, table in inputs.seqs:
        flat += [q0, start, num_new, len(table), *table]
    return torch.tensor(flat, dtype=torch.long)


def unpack_step(t: torch.Tensor) -> StepInputs:
    v = t.tolist()
    n, ns, nk = v[0], v[1], v[2]
    i = 3
    ids, pos, slots, keep = v[i:i + n], v[i + n:i + 2 * n], v[i + 2 * n:i + 3 * n], v[i + 3 * n:i + 3 * n + nk]
    i += 3 * n + nk
    seqs = []
    for _ in range(ns):
        q0, start, num_new, tl = v[i:i + 4]
        seqs.append((q0, start, num_new, v[i + 4:i + 4 + tl]))
        i += 4 + tl
    return StepInputs(ids, pos, slots, seqs, keep)


@dataclass
class TensorParallelGroup:
    """This process's place in the group, and (on rank 0) the child rank processes it started."""

    rank: int
    world_size: int
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    control: Any = None  # the group that carries steps (host tensors): gloo beside NCCL on GPUs, else the default

    def broadcast_step(self, inputs: StepInputs | None) -> StepInputs | None:
        """Rank 0 sends the step (``None`` = stop); other ranks receive it."""
        if self.rank == 0:
            payload = pack_step(inputs) if inputs is not None else torch.tensor([], dtype=torch.long)
            size = torch.tensor([payload.numel() if inputs is not None else _STOP], dtype=torch.long, device="cpu")
            dist.broadcast(size, 0, group=self.control)
            if inputs is not None:
                dist.broadcast(payload, 0, group=self.control)
            return inputs
        size = torch.zeros(1, dtype=torch.long, device="cpu")
        dist.broadcast(size, 0, group=self.control)
        if int(size.item()) == _STOP:
            return None
        payload = torch.empty(int(size.item()), dtype=torch.long, device="cpu")
        dist.broadcast(payload, 0, group=self.control)
        return unpack_step(payload)

    def broadcast_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device="cpu")
        dist.broadcast(t, 0, group=self.control)
        return int(t.item())

    def shutdown(self) -> None:
        if self.rank == 0:
            try:
                self.broadcast_step(None)
            except Exception:  # noqa: BLE001 - ranks may already be gone
                pass
            for child in self.children:
                try:
                    child.wait(5)
                except subprocess.TimeoutExpired:
                    child.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_group(world_size: int, model_dir: Path, options: Mapping[str, str],
                gpu: bool = False) -> TensorParallelGroup:
    """On the worker (rank 0): spawn ranks 1..N-1 and join the process group with them (``gpu``: rank r on
    ``cuda:r``)."""
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    children = [
        subprocess.Popen([sys.executable, "-m", "handlers.engine.execution.parallel", "--rank", str(r),
                          "--world-size", str(world_size), "--init-method", init_method,
                          "--model-dir", str(model_dir), "--options", json.dumps(dict(options)),
                          "--device", f"cuda:{r}" if gpu else "cpu"],
                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        for r in range(1, world_size)
    ]
    control = _init(0, world_size, init_method, gpu)
    logger.info("tensor parallel group of %d ranks up (%s)", world_size, dist.get_backend())
    return TensorParallelGroup(0, world_size, children, control)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the worker (rank 0) dies, so no rank is orphaned."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _init(rank: int, world_size: int, init_method: str, gpu: bool) -> Any:
    """Join the group; returns the group that carries steps (None: the default one, gloo on CPU)."""
    if not gpu:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        return None
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size, device_id=device)
    return dist.new_group(backend="gloo")


# ----------------------------------------------------------------------------------------- sharding
def _keep_rows(linear: torch.nn.Linear, start: int, end: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[start:end].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start:end].contiguous(), requires_grad=False)
    linear.out_features = end - start


def _keep_cols(linear: torch.nn.Linear, start: int, end: int, rank: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[:, start:end].contiguous(), requires_grad=False)
    if linear.bias is not None and rank != 0:  # the all-reduce would add the bias N times
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = end - start


def _all_reduce_hook(module: torch.nn.Module, args: object, output: object) -> None:
    """Sum the partial outputs of a row-parallel block in place (attention returns a tuple)."""
    dist.all_reduce(output[0] if isinstance(output, tuple) else output)  # type: ignore[arg-type]


def head_ranges(heads: int, kv_heads: int, rank: int, world_size: int) -> tuple[int, int, int, int]:
    """This rank's query heads [q0, q1) and KV heads [kv0, kv1). With fewer KV heads than ranks (multi-query,
    or GQA with few groups) each KV head is replicated on the ranks whose query heads use it.
    Raises ValueError when the heads do not split evenly."""
    if heads % world_size:
        raise ValueError(f"tensor_parallel_degree={world_size} does not divide num_attention_heads={heads}")
    hq = heads // world_size
    if kv_heads >= world_size:
        if kv_heads % world_size:
            raise ValueError(f"tensor_parallel_degree={world_size} does not divide num_key_value_heads={kv_heads}")
        hkv = kv_heads // world_size
        return rank * hq, (rank + 1) * hq, rank * hkv, (rank + 1) * hkv
    if world_size % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} cannot be replicated evenly over "
                         f"tensor_parallel_degree={world_size} ranks (the degree must be a multiple of it)")
    kv = rank * hq // (heads // kv_heads)
    return rank * hq, (rank + 1) * hq, kv, kv + 1


def shard_model(model: torch.nn.Module, rank: int, world_size: int) -> int:
    """Shard a model in place for ``rank``; returns this rank's number of KV heads. Layouts: Llama-family
    (q/k/v/o_proj, gate/up/down_proj) and Falcon (after ``handlers.engine.execution.adapters``: canonical fused QKV).

    Raises ValueError for a model whose layout is not supported or whose heads do not divide evenly.
    """
    from handlers.engine.execution.runner import kv_geometry

    cfg: Any = model.config
    heads = int(cfg.num_attention_heads)
    _, kv_heads, head_dim = kv_geometry(cfg)
    q0, q1, kv0, kv1 = head_ranges(heads, kv_heads, rank, world_size)
    if getattr(model, "rollserve_adapter", None) == "falcon":
        _shard_falcon(model, rank, world_size, (q0, q1, kv0, kv1), heads, kv_heads, head_dim)
        return kv1 - kv0
    inter = int(getattr(cfg, "intermediate_size", 0))
    if inter % world_size:
        raise ValueError(f"tensor_parallel_degree={world_size} does not divide intermediate_size={inter}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: tensor parallelism supports Llama-family models "
                         "(model.model.layers with q/k/v/o_proj and gate/up/down_proj) and Falcon")
    hi = inter // world_size
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{type(model).__name__}: unsupported layer layout for tensor parallelism")
        _keep_rows(attn.q_proj, q0 * head_dim, q1 * head_dim)
        _keep_rows(attn.k_proj, kv0 * head_dim, kv1 * head_dim)
        _keep_rows(attn.v_proj, kv0 * head_dim, kv1 * head_dim)
        _keep_cols(attn.o_proj, q0 * head_dim, q1 * head_dim, rank)
        _keep_rows(mlp.gate_proj, rank * hi, (rank + 1) * hi)
        _keep_rows(mlp.up_proj, rank * hi, (rank + 1) * hi)
        _keep_cols(mlp.down_proj, rank * hi, (rank + 1) * hi, rank)
        # On the blocks, not the projections: prepacking later swaps the Linear modules out.
        attn.register_forward_hook(_all_reduce_hook)
        mlp.register_forward_hook(_all_reduce_hook)
    return kv1 - kv0


def _shard_falcon(model: torch.nn.Module, rank: int, world_size: int, ranges: tuple[int, int, int, int],
                  heads: int, kv_heads: int, head_dim: int) -> None:
    """Falcon: rows of the canonical fused QKV ([queries | keys | values]) and of dense_h_to_4h; columns of
    dense and dense_4h_to_h. The attention adapter reads its per-rank head counts from the module."""
    q0, q1, kv0, kv1 = ranges
    for layer in model.transformer.h:  # type: ignore[union-attr]
        attn, mlp = layer.self_attention, layer.mlp
        qkv = attn.query_key_value
        k_base, v_base = heads * head_dim, (heads + kv_heads) * head_dim
        rows = torch.cat([torch.arange(q0 * head_dim, q1 * head_dim),
                          torch.arange(k_base + kv0 * head_dim, k_base + kv1 * head_dim),
                          torch.arange(v_base + kv0 * head_dim, v_base + kv1 * head_dim)])
        qkv.weight = torch.nn.Parameter(qkv.weight.data[rows].contiguous(), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = torch.nn.Parameter(qkv.bias.data[rows].contiguous(), requires_grad=False)
        qkv.out_features = len(rows)
        attn.rollserve_heads, attn.rollserve_kv_heads = q1 - q0, kv1 - kv0
        _keep_cols(attn.dense, q0 * head_dim, q1 * head_dim, rank)
        inter = mlp.dense_h_to_4h.out_features
        if inter % world_size:
            raise ValueError(f"tensor_parallel_degree={world_size} does not divide ffn_hidden_size={inter}")
        hi = inter // world_size
        _keep_rows(mlp.dense_h_to_4h, rank * hi, (rank + 1) * hi)
        _keep_cols(mlp.dense_4h_to_h, rank * hi, (rank + 1) * hi, rank)
        attn.register_forward_hook(_all_reduce_hook)
        mlp.register_forward_hook(_all_reduce_hook)


# ------------------------------------------------------------------------------------- other ranks
def rank_main(argv: list[str] | None = None) -> None:
    """Entry point of ranks 1..N-1: load the shard, then run every step rank 0 broadcasts."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--options", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank}[%(process)d] %(levelname)s "
                                                   "%(name)s: %(message)s")
    from handlers.engine.execution.device import device_defaults
    from handlers.engine.execution.loading import load_model_and_tokenizer
    from handlers.engine.execution.runner import ModelRunner

    options = json.loads(args.options)
    device = torch.device(args.device)
    control = _init(args.rank, args.world_size, args.init_method, device.type == "cuda")
    group = TensorParallelGroup(args.rank, args.world_size, control=control)
    try:
        model, _, config = load_model_and_tokenizer(args.model_dir, options, dtype_for=device)
        config = device_defaults(config, options, device)
        kv_heads = shard_model(model, args.rank, args.world_size)
        model.to(device)
        num_blocks = group.broadcast_int(0)
        runner = ModelRunner(model, num_blocks, config.block_size, prepack_weights=config.prepack_weights,
                             populate_kv=config.kv_cache_populate,
                             num_kv_heads=kv_heads, fuse_weights=config.fuse_projections,
                             use_kernels=config.attention_kernel == "native",
                             step_tokens=config.max_num_batched_tokens)
        while True:
            inputs = group.broadcast_step(None)
            if inputs is None:
                break
            runner.forward(inputs)
    except Exception:  # noqa: BLE001 - any failure ends this rank; rank 0 sees the broken collective
        logger.exception("tensor-parallel rank %d failed", args.rank)
        os._exit(1)
    group.shutdown()


if __name__ == "__main__":
    rank_main()
