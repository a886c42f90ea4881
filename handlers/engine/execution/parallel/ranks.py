"""Tensor parallelism for the rolling engine: N ranks per worker through ``torch.distributed``.

Design note: rank 0 is the worker process: it owns scheduling, sampling and IPC, and broadcasts each step's flat
batch (``StepInputs`` packed into one int64 tensor) before running it; the other ranks load their shard
(``handlers.engine.execution.parallel.sharding``), then loop: receive a step, run the model, repeat. Every rank computes
the same logits. A failed collective is fatal for the whole group: the worker exits and is restarted by the
frontend's pool, which forms the group again.

Where the ranks run: on one host, ranks 1..N-1 are processes the worker starts (forked from a zygote that imported
torch once, ``handlers.engine.execution.parallel.rank_process``; ``python -m handlers.engine.execution.parallel.ranks``
runs one by hand); across H hosts (``handlers.engine.execution.parallel.cluster``), rank 0's
host runs
N/H of them and each follower host's agent runs its N/H. Either way every rank meets the others through rank 0's
``Rendezvous`` (an authenticated store: a peer must hold the group's secret), never through an open TCPStore.

Devices: on CPU one gloo group does everything. On GPUs (the worker's ``CUDA_VISIBLE_DEVICES`` lists its group,
``serving.config.devices``) each rank runs on its own device; the all-reduces go through NCCL on device tensors, and the
step broadcasts, which are host-side integers, through a second group on gloo, so no step is copied to a
device and back. Each rank loads and shards its model on the host, then moves its shard to its device.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from handlers.engine.execution.forward.runner import StepInputs
from handlers.engine.execution.parallel.auth_store import AuthStore
from handlers.engine.execution.parallel.cluster import gloo_interface, leader_spec
from handlers.engine.execution.parallel.host_weights import WeightsMismatch, manifest, weight_files
from handlers.engine.execution.parallel.rank_process import RankProcess, spawn_rank
from handlers.engine.execution.parallel.rendezvous import SECRET_ENV, Rendezvous
from handlers.engine.execution.parallel.sharding import shard_model
from handlers.engine.planning.engine_config import EngineConfig
from rollcore.model_folder import weights_folder

logger = logging.getLogger(__name__)

_STOP = -1


def pack_step(inputs: StepInputs) -> torch.Tensor:
    """A step as one int64 tensor: counts, ids, positions, slots, kept rows, then each sequence, then the LoRA
    slot of each sequence and the slot fills (slot, then the adapter's name and folder as UTF-8 bytes)."""
    flat = [len(inputs.input_ids), len(inputs.seqs), len(inputs.keep), *inputs.input_ids, *inputs.positions,
            *inputs.slots, *inputs.keep]
    for q0, start, num_new, table in inputs.seqs:
        flat += [q0, start, num_new, len(table), *table]
    flat += [len(inputs.adapters), *inputs.adapters, len(inputs.fills)]
    for slot, name, folder in inputs.fills:
        flat.append(slot)
        for text in (name.encode(), folder.encode()):
            flat += [len(text), *text]
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
    na = v[i]
    adapters = v[i + 1:i + 1 + na]
    i += 1 + na
    fills = []
    nf, i = v[i], i + 1
    for _ in range(nf):
        slot, i = v[i], i + 1
        texts = []
        for _ in range(2):
            n = v[i]
            texts.append(bytes(v[i + 1:i + 1 + n]).decode())
            i += 1 + n
        fills.append((slot, texts[0], texts[1]))
    return StepInputs(ids, pos, slots, seqs, keep, adapters, fills=fills)


@dataclass
class TensorParallelGroup:
    """This process's place in the group, and (on rank 0) the child rank processes it started."""

    rank: int
    world_size: int
    children: list[RankProcess] = field(default_factory=list)
    control: Any = None  # the group that carries steps (host tensors): gloo beside NCCL on GPUs, else the default
    rendezvous: Rendezvous | None = None  # rank 0: the group's store and the follower hosts' lifelines
    broken: bool = False  # a step failed on rank 0 (a dead peer's collective): the ranks are out of step
    step_timeout_s: float | None = None  # rank 0: the longest wait for a peer in a step, once every rank is ready
    _ready: bool = False

    def healthy(self) -> bool:
        """False once a step failed on rank 0, a rank this host started has exited or a follower host has left."""
        return not self.broken and all(c.poll() is None for c in self.children) and not (
            self.rendezvous and self.rendezvous.lost)

    def mark_broken(self) -> None:
        self.broken = True

    def wait_ready(self) -> None:
        """Every rank: meet once all ranks have built their runners (loading may take minutes, waited for with
        torch's long default). From then on rank 0's collectives give up on a peer after ``step_timeout_s``: a
        host that died without closing its connections fails the step, and the requests in it, within that
        bound. The other ranks keep the long wait: between requests they wait for the next step indefinitely."""
        if self._ready:
            return
        dist.barrier(group=self.control)
        self._ready = True
        if self.rank == 0 and self.step_timeout_s:
            timeout = timedelta(seconds=self.step_timeout_s)
            for group in [None] if self.control is None else [None, self.control]:
                _set_pg_timeout(timeout, group)

    def broadcast_step(self, inputs: StepInputs | None) -> StepInputs | None:
        """Rank 0 sends the step (``None`` = stop); other ranks receive it."""
        if self.rank == 0:
            self.wait_ready()  # the other ranks meet at the barrier before their first step, the stop included
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
                if self.healthy():  # else a rank is gone: the stop would wait on it; the survivors are killed below
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
        if self.rendezvous is not None:
            self.rendezvous.close()


def start_group(world_size: int, model_dir: Path, options: Mapping[str, str],
                gpu: bool = False) -> TensorParallelGroup:
    """On the worker (rank 0): form the group (``gpu``: each rank on its own device). On one host, start ranks
    1..N-1 here; with follower hosts (``cluster.leader_spec``), wait until they join, hand each its ranks and the
    manifest of the weights, wait until each holds a verified copy (``WeightsMismatch`` when one cannot: the
    model fails, naming the file), and start this host's share."""
    spec = leader_spec(os.environ, world_size)
    secret = spec.secret if spec is not None else secrets.token_hex(32)
    host = spec.bind if spec is not None else "127.0.0.1"
    rendezvous = Rendezvous(secret.encode(), host, spec.port if spec is not None else 0)
    local = world_size // spec.nodes if spec is not None else world_size
    env = {SECRET_ENV: secret}
    try:
        if spec is not None:
            followers = rendezvous.wait_followers(spec.nodes - 1)
            weights = _share_weights(rendezvous, model_dir, options)
            for node, follower in enumerate(followers, start=1):  # every host fetches at once
                rendezvous.assign(follower, {
                    "world_size": world_size, "first_rank": node * local, "ranks": local, "model": model_dir.name,
                    "options": dict(options), "gpu": gpu, "weights": weights})
            for follower in followers:
                _check_answer(rendezvous, follower)
            env.update(gloo_interface(followers[0].local_address))
            os.environ.update(env)  # rank 0 meets the remote ranks on the same interface as its children
        store_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        children = [spawn_rank(r, world_size, (store_host, rendezvous.port), model_dir, options,
                               f"cuda:{r}" if gpu else "cpu", env) for r in range(1, local)]
        control = _init(0, world_size, AuthStore(store_host, rendezvous.port, secret.encode()),
                        torch.device("cuda", 0) if gpu else torch.device("cpu"))
    except BaseException:
        rendezvous.close()
        raise
    where = f" on {spec.nodes} hosts" if spec is not None else ""
    logger.info("tensor parallel group of %d ranks up%s (%s)", world_size, where, dist.get_backend())
    return TensorParallelGroup(0, world_size, children, control, rendezvous,
                               step_timeout_s=EngineConfig.from_options(options).tensor_parallel_timeout_s)


def _share_weights(rendezvous: Rendezvous, model_dir: Path, options: Mapping[str, str]) -> dict[str, Any]:
    """The weights part of a follower's assignment: the manifest of the folder rank 0 loads (shared for
    streaming), the source it came from and how followers get theirs (``option.follower_weights``)."""
    folder = weights_folder(model_dir, options.get("model_id"))
    rendezvous.share(weight_files(folder))
    entries = manifest(folder)
    logger.info("weights for the follower hosts: %d files, %.1f MiB", len(entries),
                sum(e.size for e in entries) / 2**20)
    return {"manifest": [e.to_wire() for e in entries], "origin": options.get("origin_model_id"),
            "mode": EngineConfig.from_options(options).follower_weights}


def _check_answer(rendezvous: Rendezvous, follower: Any) -> None:
    """Raise unless ``follower`` holds a verified copy of the weights (``WeightsMismatch`` when it never will)."""
    answer = rendezvous.weights_answer(follower)
    host = follower.address[0]
    if not answer.get("ok"):
        error = f"follower host {host}: {answer.get('error', 'no answer about the weights')}"
        raise WeightsMismatch(error) if answer.get("permanent") else RuntimeError(error)
    logger.info("follower host %s holds the weights (%s): %d files, %.1f MiB verified", host, answer.get("how"),
                answer.get("files", 0), answer.get("bytes", 0) / 2**20)


def _init(rank: int, world_size: int, store: AuthStore, device: torch.device) -> Any:
    """Join the group; returns the group that carries steps (None: the default one, gloo on CPU)."""
    if device.type != "cuda":
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        return None
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    return dist.new_group(backend="gloo")


def rank_main(argv: list[str] | None = None) -> None:
    """Entry point of ranks 1..N-1: load the shard, then run every step rank 0 broadcasts."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of rank 0's rendezvous")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--options", required=True)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank}[%(process)d] %(levelname)s "
                                                   "%(name)s: %(message)s")
    from handlers.engine.execution.forward.lora import enable_lora, folder_adapters
    from handlers.engine.execution.forward.runner import ModelRunner
    from handlers.engine.execution.gpu.device import device_defaults
    from handlers.engine.execution.weights.loading import load_model_and_tokenizer

    options = json.loads(args.options)
    device = torch.device(args.device)
    host, _, port = args.store.rpartition(":")
    control = _init(args.rank, args.world_size, AuthStore(host, int(port), os.environ[SECRET_ENV].encode()), device)
    group = TensorParallelGroup(args.rank, args.world_size, control=control)
    try:
        model, _, config = load_model_and_tokenizer(args.model_dir, options, dtype_for=device)
        config = device_defaults(config, options, device)
        kv_heads = shard_model(model, args.rank, args.world_size)
        model.to(device)
        num_blocks = group.broadcast_int(0)
        # as rank 0 does: the projections wrapped before the runner prepacks or fuses them
        lora = enable_lora(model, config, False, folder_adapters(args.model_dir))
        runner = ModelRunner(model, num_blocks, config.block_size, prepack_weights=config.prepack_weights,
                             measure_linears=config.measure_linears, max_seqs=config.max_num_seqs,
                             populate_kv=config.kv_cache_populate,
                             num_kv_heads=kv_heads, fuse_weights=config.fuse_projections and lora is None,
                             use_kernels=config.attention_kernel == "native",
                             step_tokens=config.max_num_batched_tokens)
        runner.lora = lora
        group.wait_ready()
        while True:
            inputs = group.broadcast_step(None)
            if inputs is None:
                break
            if inputs.fills and lora is not None:
                lora.apply_fills(inputs.fills)
            runner.forward(inputs)
    except Exception:  # noqa: BLE001 - any failure ends this rank; rank 0 sees the broken collective
        logger.exception("tensor-parallel rank %d failed", args.rank)
        os._exit(1)
    group.shutdown()


if __name__ == "__main__":
    rank_main()
