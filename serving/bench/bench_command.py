"""The ``serving bench`` command (argument parsing in ``serving.cli``; see ``serving.bench.passes``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from serving.bench.clients import Target
from serving.bench.run_metrics import parse_slo
from serving.bench.scenario import APIS, ScenarioError, load_scenario


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_dir", type=Path, nargs="?",
                    help="model folder: started on a private server unless --url is given (then only its "
                         "tokenizer and name are used)")
    ap.add_argument("--url", help="base URL of a running server's inference address (http://127.0.0.1:8080)")
    ap.add_argument("--model", help="model name on that server (default: the folder's name)")
    ap.add_argument("--grpc", metavar="HOST:PORT", help="the running server's gRPC address (api grpc)")
    ap.add_argument("--token", help="inference token of the running server, when it requires one")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json or a folder holding it (default: MODEL_DIR)")
    ap.add_argument("--scenario", "-s", default="bench-default",
                    help="a preset name or a YAML file (default bench-default; presets: bench-default, chat, "
                         "sweep, tune)")
    ap.add_argument("--slo", help="SLO for goodput, e.g. ttft_p99=2s,itl_p99=200ms (overrides the scenario's)")
    ap.add_argument("--api", choices=APIS, help="override the scenario's API")
    ap.add_argument("--num-requests", "-n", type=int, help="override the scenario's requests per pass")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="serving.properties override for the server it starts (repeatable)")
    ap.add_argument("--out", "-o", type=Path, help="results folder (default ./bench-MODEL-STAMP)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def cmd_bench(args: argparse.Namespace) -> int:
    from serving.bench.launch import LocalServer
    from serving.bench.passes import run_scenario, table, workload_of
    from serving.bench.plots import bench_figures
    from serving.bench.workload import load_tokenizer

    try:
        scenario = load_scenario(args.scenario)
        slo = parse_slo(args.slo) if args.slo else scenario.slo
    except (ScenarioError, ValueError) as exc:
        return _fail(str(exc))
    if args.num_requests is not None:
        if args.num_requests < 1:
            return _fail("--num-requests must be >= 1")
        scenario = replace(scenario, num_requests=args.num_requests)
    api = args.api or scenario.api
    if args.model_dir is None and args.url is None:
        return _fail("give a model folder to start, or --url of a running server (with --model and --tokenizer)")
    if args.model_dir is not None and not args.model_dir.is_dir():
        return _fail(f"{args.model_dir}: model folder not found")
    model = args.model or (args.model_dir.resolve().name if args.model_dir is not None else None)
    if model is None:
        return _fail("--url needs --model (the model's name on that server)")
    tok_path = args.tokenizer or args.model_dir
    if tok_path is None:
        return _fail("prompts are generated from the model's tokenizer: give --tokenizer (or the model folder)")
    try:
        tokenizer = load_tokenizer(tok_path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type
        return _fail(f"cannot read the tokenizer: {exc}")
    overrides = {}
    for spec in args.set:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            return _fail(f"--set {spec!r}: expected KEY=VALUE")
        overrides[key.strip()] = value.strip()
    if args.url and overrides:
        return _fail("--set applies to a server this command starts, not to --url")
    if api == "grpc" and args.url and not args.grpc:
        return _fail("api grpc against --url needs --grpc HOST:PORT")
    out = args.out or Path(f"bench-{model}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        w = workload_of(scenario, tokenizer)
    except ValueError as exc:
        return _fail(f"{scenario.source}: {exc}")

    server = None
    try:
        if args.url:
            target = Target(args.url.rstrip("/"), model, args.grpc, args.token)
        else:
            print(f"starting {args.model_dir} (log: {out / 'server' / 'server.log'})", file=sys.stderr, flush=True)
            server = LocalServer.start(args.model_dir, out / "server", name=model, properties=overrides)
            target = Target(server.url, model, server.grpc_target, server.tokens.get("inference"))
        result = run_scenario(scenario, api, target, w, slo, progress=not args.no_progress)
        if server is not None:
            result["server"] = {"model_dir": str(args.model_dir.resolve()), "overrides": overrides,
                                "model": server.describe()}
        else:
            result["server"] = {"url": args.url}
    except (RuntimeError, ScenarioError) as exc:
        return _fail(str(exc))
    finally:
        if server is not None:
            server.stop()
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    figures = bench_figures(result, out)
    print(table(result))
    print(f"results: {out / 'bench.json'}, " + ", ".join(str(p) for p in figures))
    failed = sum(p["metrics"].get("failed", 0) for p in result["passes"])
    if failed:
        print(f"error: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0
