"""The ``serving`` command.

    serving [start] [--model-store DIR] [--config FILE] [-m NAME=PATH ...] [--log-format text|json]
    serving config MODEL_DIR        print the effective model configuration and where each value came from,
                                    and a rolling-batch model's memory plan (exit 2 when it cannot fit)
    serving bench [MODEL_DIR] [--url URL] [--scenario PRESET|FILE] [--slo SPEC]
                                    open-loop load on a model (a folder it starts, or a running server):
                                    TTFT, TPOT, ITL, E2E, tokens/s, goodput; JSON and PNG figures
    serving worker --leader HOST:PORT [--model-store DIR]
                                    run this host's ranks of a tensor-parallel group led by another host
    serving tune MODEL_DIR --slo SPEC [--scenario FILE] [--budget 20m] [--dry-run]
                                    search the knobs on the live model for the highest goodput meeting the
                                    SLO; writes an annotated serving.properties and a report
    serving k8s MODEL_DIR [--replicas N] [--kserve] [--nodes N] [--namespace NS] [--image IMAGE] [--name NAME]
                                    print Kubernetes manifests for the model folder (docs/deploying.md)

With no arguments it serves every model folder of ./model_store (the default model ships there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from rollcore.errors import ConfigError
from serving.config.config_report import describe_model_config
from serving.config.model_config import ModelConfig, load_model_config
from serving.config.server_config import load_server_config
from serving.logs import setup_logging
from serving.models.model_files import nothing_to_load


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="serving", description="rollserve model server",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])  # the usage lines, not the title
    sub = ap.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    start = sub.add_parser("start", help="serve the model store's models (the default command)",
                           description="Serve every model folder of the model store (default ./model_store).")
    _start_args(start)
    cfg = sub.add_parser("config", help="print a model folder's effective configuration and memory plan",
                         description="Print a model folder's effective configuration, where each value came "
                                     "from, and a rolling-batch model's memory plan (exit 2 when it cannot fit).")
    cfg.add_argument("model_dir", type=Path)
    cfg.add_argument("--config", "-f", type=Path, help="config.properties (server defaults)")
    sub.add_parser("serve", help="SageMaker's entry: same as start")
    from serving.bench import bench_command as command
    from serving.tune import tune_command as tune

    command.add_arguments(sub.add_parser("bench", help="benchmark a model with a load scenario",
                                         description=command.__doc__))
    tune.add_arguments(sub.add_parser("tune", help="find the serving.properties with the best goodput for an SLO",
                                      description=tune.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    from serving.deploy import k8s

    k8s.add_arguments(sub.add_parser("k8s", help="print Kubernetes manifests for a model folder",
                                     description=k8s.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from serving.worker import follower

    follower.add_arguments(sub.add_parser("worker", description=follower.__doc__,
                                          help="run this host's share of another host's tensor-parallel group",
                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    return ap


def _start_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-store", "-s", type=Path, help="folder of model folders (default ./model_store)")
    ap.add_argument("--config", "-f", type=Path, help="config.properties")
    ap.add_argument("-m", "--model", action="append", default=[], metavar="NAME=PATH",
                    help="serve the model folder PATH as NAME (repeatable)")
    ap.add_argument("--log-format", choices=["text", "json"], help="log line format")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--ports-file", type=Path, help="write the bound ports as JSON here (for tooling/tests)")


def cmd_config(args: argparse.Namespace) -> int:
    try:
        server = load_server_config(args.config, env=os.environ)
        cfg = load_model_config(args.model_dir, env=os.environ, server=server)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(describe_model_config(cfg))
    if (empty := nothing_to_load(cfg)) is not None:
        # A warning, not an error (exit 2 is for values the configuration rejects): the folder's files may still be
        # on their way, and its configuration is valid; the server marks the model FAILED until they are there.
        print(f"warning: model {cfg.name}: {empty}", file=sys.stderr)
    try:
        plan = memory_plan(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan:
        print(plan)
    return 0


def memory_plan(cfg: ModelConfig) -> str:
    """The rolling engine's memory plan for a rolling-batch model whose folder has a ``config.json`` (the
    preflight the worker runs before loading), or "" when none applies. Raises ``ConfigError`` (its
    ``InsufficientMemory`` when the model cannot fit)."""
    from handlers.preflight import memory_plan_text

    if not cfg.batching.rolling:
        return ""
    return memory_plan_text(cfg.model_dir, cfg.model_id, cfg.handler_properties())


def cmd_start(args: argparse.Namespace) -> int:
    overrides: dict[str, str] = {}
    if args.model_store is not None:
        overrides["model_store"] = str(args.model_store)
    if args.log_format:
        overrides["log_format"] = args.log_format
    try:
        config = load_server_config(args.config, env=os.environ, overrides=overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    extra: dict[str, str] = {}
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).name, spec
        extra[name] = path
    setup_logging(config.log_format, args.log_level)
    from serving.listeners import ListenError
    from serving.server import Server

    try:
        server = Server(config, os.environ, extra, args.ports_file)
        asyncio.run(server.run())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a taken address: one line naming the setting, not a traceback
        print(exc, file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):  # `serving --help` lists commands
        argv.insert(0, "start")
    elif argv[0] == "serve":
        argv[0] = "start"
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from serving.bench.bench_command import cmd_bench

        sys.exit(cmd_bench(args))
    if args.command == "tune":
        from serving.tune.tune_command import cmd_tune

        sys.exit(cmd_tune(args))
    if args.command == "k8s":
        from serving.deploy.k8s import cmd_k8s

        sys.exit(cmd_k8s(args))
    if args.command == "worker":  # a follower host's agent: no server configuration
        from serving.worker.follower import cmd_worker

        sys.exit(cmd_worker(args))
    sys.exit(cmd_config(args) if args.command == "config" else cmd_start(args))
