"""The engine on one GPU: correctness of every family checked, the HTTP server end to end, and decode speed
against the memory-bandwidth roofline. Run through ``benchmarks/gpu_check.sh`` (one command, one table).

Sections (each prints its rows as it finishes; a failing section prints its error and the others still run):
1. the device and its copy bandwidth, measured here (the roofline's denominator);
2. small random models built on the device (Llama, Qwen2, Gemma-2 with a sliding window, Falcon-7B layout) in
   fp32 and bf16: the engine's greedy tokens, 8 prompts batched, against transformers' ``generate`` on the same
   device one prompt at a time (fp32 must be equal; bf16 reports the first divergence);
3. a 1B-class random Llama served by ``serving`` over HTTP (OpenAI streaming, 64 concurrent requests);
4. in process, a Llama-3-8B-layout random model in bf16: decode tok/s at batch 1, 8, 64, 256, the step time,
   and the batch-1 step's fraction of the roofline (weight + KV bytes read per step / step time / bandwidth),
   with CUDA graphs and without (``enforce_eager``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_common  # noqa: E402
from benchmarks.gpu_common import build_random, emit, llama_config, release, sync  # noqa: E402
from handlers.engine.engine import LLMEngine  # noqa: E402
from handlers.engine.planning.engine_config import EngineConfig  # noqa: E402
from handlers.synthetic_model import build_model, build_tokenizer  # noqa: E402
from rollcore.types import SamplingParams  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write counted), median of 10."""
    size = (2 << 30) if not gpu_common.SMOKE else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=gpu_common.DEV)
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * size / statistics.median(times[3:])


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, params)
    while engine.has_work():
        for d in engine.step():
            out[d.request_id] += [t.id for t in d.tokens]
    return [out[f"r{i}"] for i in range(len(prompts))]


def families(tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    emit("## Greedy equality with transformers' generate on the GPU (8 prompts of 3-45 tokens batched, 24 new "
         "tokens each)")
    emit("| family | dtype | decoder | CUDA graphs | equal prompts | first divergence (prompt: token index) |")
    emit("|---|---|---|---|---|---|")
    rng = random.Random(1)
    prompts = [[rng.randint(5, 500) for _ in range(rng.randint(3, 45))] for _ in range(8)]
    max_new = 24
    for arch in ("llama", "qwen2", "gemma2", "falcon-7b") if not gpu_common.SMOKE else ("llama",):
        folder = build_model(tmp / arch, arch=arch, size="small", seed=0)
        for dtype in (torch.float32, torch.bfloat16):
            try:
                # the reference in transformers' eager attention: its exact math (SDPA leaves out soft-capping)
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                             attn_implementation="eager").to(gpu_common.DEV).eval()
                model.generation_config.eos_token_id = None  # as the engine's ignore_eos: EOS may be chosen
                want = []
                with torch.no_grad():
                    for p in prompts:
                        ids = torch.tensor([p], device=gpu_common.DEV)
                        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=max_new)
                        want.append(gen[0, len(p):].tolist())
                engine = LLMEngine(model, AutoTokenizer.from_pretrained(folder),
                                   EngineConfig(num_kv_blocks=512, max_num_seqs=16, max_model_len=256))
                got = run_engine(engine, prompts, max_new)
                equal = sum(g == w for g, w in zip(got, want, strict=True))
                first = next(((i, next(j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b))
                              for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w), None)
                runner = engine.runner
                emit(f"| {arch} | {str(dtype)[6:]} | {'lean' if runner.lean else 'transformers'} | "
                     f"{'on' if runner.graphs else 'off'} | {equal}/{len(prompts)} | "
                     f"{'-' if first is None else f'{first[0]}: {first[1]}'} |")
                del engine, model
            except Exception as exc:  # noqa: BLE001 (a section reports its failure and the check goes on)
                emit(f"| {arch} | {str(dtype)[6:]} | error | | | {type(exc).__name__}: {str(exc)[:200]} |")
                traceback.print_exc()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_server(tmp: Path) -> None:
    emit("## The HTTP server on the GPU: a 1.1B random Llama (bf16), 64 concurrent OpenAI streaming requests")
    store = tmp / "store"
    folder = store / "llama1b"
    build_random(folder, llama_config(2048, 22, 32, 4, 5632, 32000) if not gpu_common.SMOKE else
                 llama_config(128, 2, 4, 2, 256, 4096))
    requests = 64 if not gpu_common.SMOKE else 8
    (folder / "serving.properties").write_text("option.rolling_batch=auto\noption.max_rolling_batch_size=64\n"
                                               "option.max_model_len=1024\n")
    port, mport = free_port(), free_port()
    (tmp / "config.properties").write_text(f"inference_address=http://127.0.0.1:{port}\n"
                                           f"management_address=http://127.0.0.1:{mport}\n"
                                           f"model_store={store}\nload_models=ALL\ngrpc_address=127.0.0.1:{free_port()}\n")
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(tmp / "config.properties")],
                            cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {(tmp / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("server not ready in 300 s")
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
            emit(f"- /v1/models: {json.loads(r.read())['data'][0]['id']}")
        results: list[dict[str, float]] = []

        def one(i: int) -> None:
            rng = random.Random(i)
            body = json.dumps({"model": "llama1b", "prompt": " ".join(f"w{rng.randint(0, 999)}" for _ in range(
                rng.randint(20, 200))), "max_tokens": rng.choice([32, 64, 128]), "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            stamps = []
            tokens = 0
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                        if event.get("choices"):
                            stamps.append(time.perf_counter())
            results.append({"ttft": stamps[0] - t0, "n": tokens, "chunks": len(stamps), "end": stamps[-1] - t0,
                            "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]})

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        tokens = sum(r["n"] for r in results)
        ttft = sorted(r["ttft"] for r in results)
        gaps = sorted(g for r in results for g in r["gaps"]) or [0.0]
        emit(f"- {len(results)}/{requests} requests completed: {tokens} tokens ({sum(r['chunks'] for r in results)} "
             f"stream chunks) in {wall:.2f} s = {tokens / wall:.0f} output tok/s; TTFT p50 "
             f"{ttft[len(ttft) // 2] * 1e3:.0f} ms, p99 {ttft[int(len(ttft) * 0.99)] * 1e3:.0f} ms; inter-chunk p50 "
             f"{gaps[len(gaps) // 2] * 1e3:.1f} ms, p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms")
        token = json.loads((tmp / "key_file.json").read_text())["management"]["key"]
        req = urllib.request.Request(f"http://127.0.0.1:{mport}/models/llama1b",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            described = json.loads(r.read())[0]["models"][0]
        emit(f"- GET /models/llama1b workers: {json.dumps(described.get('workers'))}")
    except Exception as exc:  # noqa: BLE001
        emit(f"- error: {type(exc).__name__}: {str(exc)[:500]}")
        traceback.print_exc()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.copy(tmp / "server.log", Path(os.environ.get("OUT", tmp)) / "server.log")


def decode_speed(tmp: Path, bandwidth: float) -> None:
    from transformers import AutoModelForCausalLM

    emit("## Decode speed: Llama-3-8B layout (32 layers, hidden 4096, GQA 32/8, vocab 128256), random bf16, "
         "prompts of 128 tokens, in process")
    torch.manual_seed(0)
    shape = (4096, 32, 32, 8, 14336, 128256) if not gpu_common.SMOKE else (128, 2, 4, 2, 256, 4096)
    with torch.device(gpu_common.DEV):
        model = AutoModelForCausalLM.from_config(llama_config(*shape), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    tokenizer_dir = tmp / "tok8b"
    build_tokenizer(tokenizer_dir, 4096, 0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    weight_bytes = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    emit(f"- weights read per step (all but the embedding table): {weight_bytes / 1e9:.2f} GB; copy bandwidth "
         f"{bandwidth / 1e12:.2f} TB/s: roofline of a batch-1 step {weight_bytes / bandwidth * 1e3:.2f} ms")
    emit("| CUDA graphs | fused QKV, gate/up | batch | engine step ms (median) | graph replay alone ms | "
         "decode tok/s | x batch 1 | roofline fraction |")
    emit("|---|---|---|---|---|---|---|---|")
    # unfused first: fusing replaces the model's projection modules for good
    runs = [(False, False, (1, 64)), (False, True, (1, 8, 64, 256)), (True, True, (1, 64))]
    for eager, fused, batches in runs:
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=256 * 512 // 16 + 64, max_num_seqs=max(batches),
                                                          max_model_len=512, enforce_eager=eager,
                                                          fuse_projections=fused))
        per_token_kv = 2 * shape[1] * shape[3] * (shape[0] // shape[2]) * 2
        base = None
        for batch in batches if not gpu_common.SMOKE else (1, 8):
            rng = random.Random(batch)
            params = SamplingParams(max_new_tokens=96, ignore_eos=True)
            for i in range(batch):
                engine.add(f"b{batch}-{i}", [rng.randint(5, 4000) for _ in range(128)], params)
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
                engine.step()
            for _ in range(4):  # warm-up decode steps
                engine.step()
            times = []
            contexts = []
            for _ in range(32):
                contexts.append(sum(s.num_tokens for s in engine.scheduler.running))
                sync()
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            while engine.has_work():
                engine.step()
            step = statistics.median(times)
            tps = batch / step
            base = base if batch > 1 else tps
            roof = (weight_bytes + statistics.median(contexts) * per_token_kv) / bandwidth / step
            graph = "-"
            graphs = engine.runner.graphs
            # the captured forward alone: the device's share of a step
            if graphs is not None and gpu_common.DEV.type == "cuda":
                replays = []
                for _ in range(20):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs._graphs[batch].replay()
                    end.record()
                    end.synchronize()
                    replays.append(start.elapsed_time(end))
                graph = f"{statistics.median(replays):.2f}"
            emit(f"| {'off' if eager else 'on'} | {'yes' if fused else 'no'} | {batch} | {step * 1e3:.2f} | {graph} | "
                 f"{tps:.0f} | {tps / base:.1f} | {roof:.2f} |")
        del engine


def profile(tmp: Path) -> None:
    """Where a batch-1 decode step of the 8B layout spends device time: the eager step under torch.profiler
    (a CUDA graph replays the same kernels), the kernels with the most time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    emit("## Profile: one batch-1 decode step of the 8B layout (eager, fused projections), kernels by device time")
    shape = (4096, 32, 32, 8, 14336, 128256) if not gpu_common.SMOKE else (128, 2, 4, 2, 256, 4096)
    with torch.device(gpu_common.DEV):
        model = AutoModelForCausalLM.from_config(llama_config(*shape), dtype=torch.bfloat16)
    build_tokenizer(tmp / "tokp", 4096, 0)
    engine = LLMEngine(model, AutoTokenizer.from_pretrained(tmp / "tokp"),
                       EngineConfig(num_kv_blocks=256, max_num_seqs=4, max_model_len=512, enforce_eager=True,
                                    fuse_projections=True))
    engine.add("p", list(range(5, 133)), SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(8):
        engine.step()
    activities = [ProfilerActivity.CUDA] if gpu_common.DEV.type == "cuda" else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        for _ in range(4):
            engine.step()
        sync()
    key = "self_device_time_total" if gpu_common.DEV.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:14]
    total = sum(getattr(e, key, 0) for e in prof.key_averages()) / 4
    emit(f"- device time per step {total / 1e3:.2f} ms")
    emit("| kernel | calls per step | us per step | share |")
    emit("|---|---|---|---|")
    for e in rows:
        t = getattr(e, key, 0) / 4
        emit(f"| {e.key[:90]} | {e.count / 4:.0f} | {t:.0f} | {t / total:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--sections", default="families,http,decode",
                    help="of families, http, decode, profile (a kernel breakdown of one batch-1 step)")
    ap.add_argument("--smoke", action="store_true", help="tiny models on --device (a dry run of this script)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    gpu_common.DEV, gpu_common.SMOKE = torch.device(args.device), args.smoke
    if gpu_common.DEV.type == "cuda" and gpu_common.DEV.index is None:
        gpu_common.DEV = torch.device("cuda", 0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons in true fp32
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(gpu_common.DEV) if gpu_common.DEV.type == "cuda" else "cpu (smoke run)"
    emit(f"# gpu_check: {name}, torch {torch.__version__}, "
         f"{time.strftime('%Y-%m-%d %H:%M')}")
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    emit(f"- device-to-device copy bandwidth (read + write), median of 10: {bandwidth / 1e12:.2f} TB/s")
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("families", lambda: families(Path(tmp))), ("http", lambda: http_server(Path(tmp))),
                         ("decode", lambda: decode_speed(Path(tmp), bandwidth)),
                         ("profile", lambda: profile(Path(tmp)))):
            if name in sections:
                started = time.perf_counter()
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001
                    emit(f"- section {name} failed: {type(exc).__name__}: {str(exc)[:500]}")
                    traceback.print_exc()
                release()
                emit(f"({name}: {time.perf_counter() - started:.0f} s)")
                emit()
    emit(f"total {time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text("\n".join(gpu_common.LINES) + "\n")


if __name__ == "__main__":
    main()
