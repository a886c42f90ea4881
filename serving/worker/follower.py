"""``serving worker``: run this host's share of a tensor-parallel group whose leader runs elsewhere.

    serving worker [--leader HOST:PORT] [--model-store DIR] [--model-cache DIR] [--node-rank N]
                   [--connect-timeout SECONDS]

The leader's address defaults to torchrun's ``MASTER_ADDR``/``MASTER_PORT`` or LeaderWorkerSet's
``LWS_LEADER_ADDRESS`` (port 29500); the node rank to ``NODE_RANK``, ``GROUP_RANK`` or ``LWS_WORKER_INDEX``
(otherwise the leader numbers hosts as they join). ``ROLLSERVE_CLUSTER_SECRET`` must hold the leader's secret.
The weights come from the model's source fetched on this host (into ``--model-cache``), the model folder of the
same name in this host's model store, or the leader's files streamed over the group's connection, as the
model's ``option.follower_weights`` says (``serving.worker.follower_weights``), and are checked against the
leader's before a rank loads. Exits when the group ends (0 when the leader ended it), so a supervisor restarts it
for the next group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from serving.logs import setup_logging


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--leader", help="HOST:PORT of the leader's rendezvous (default: from the environment)")
    ap.add_argument("--model-store", "-s", type=Path, default=Path("model_store"),
                    help="this host's folder of model folders (default ./model_store)")
    ap.add_argument("--model-cache", type=Path,
                    help="this host's cache of fetched and streamed weights (default SERVING_MODEL_CACHE_DIR, "
                         "else ~/.cache/rollserve/models)")
    ap.add_argument("--node-rank", type=int, help="this host's place in the group (default: from the environment)")
    ap.add_argument("--connect-timeout", type=float, default=600.0,
                    help="seconds to keep trying to reach the leader (default 600)")
    ap.add_argument("--log-format", choices=["text", "json"], default="text")


def leader_address(value: str | None, env: Mapping[str, str]) -> tuple[str, int] | None:
    """``--leader``, else torchrun's or LeaderWorkerSet's variables; None when nothing names a leader."""
    from handlers.engine.execution.parallel.cluster import DEFAULT_PORT

    if not value:
        host = env.get("MASTER_ADDR") or env.get("LWS_LEADER_ADDRESS")
        if not host:
            return None
        value = f"{host}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--leader {value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def node_rank(value: int | None, env: Mapping[str, str]) -> int | None:
    if value is not None:
        return value
    for key in ("NODE_RANK", "GROUP_RANK", "LWS_WORKER_INDEX"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def cmd_worker(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    from handlers.engine.execution.parallel.follower_host import run_follower
    from handlers.engine.execution.parallel.rendezvous import SECRET_ENV
    from serving.worker.follower_weights import WeightsPlacer

    setup_logging(args.log_format, "INFO")
    try:
        leader = leader_address(args.leader, env)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if leader is None:
        print("error: no leader: pass --leader HOST:PORT or set MASTER_ADDR (or LWS_LEADER_ADDRESS)",
              file=sys.stderr)
        return 2
    secret = env.get(SECRET_ENV, "")
    if not secret:
        print(f"error: {SECRET_ENV} is not set: the leader admits only hosts that hold its secret", file=sys.stderr)
        return 2
    placer = WeightsPlacer(args.model_store, args.model_cache or cache_root(env), env)
    return run_follower(leader, secret, placer, node_rank(args.node_rank, env), args.connect_timeout)


def cache_root(env: Mapping[str, str]) -> Path:
    """The model cache the server itself would use on this host (its ``model_cache_dir`` from the environment)."""
    from serving.sources.cache import default_root

    value = env.get("SERVING_MODEL_CACHE_DIR", "")
    return Path(value) if value else default_root()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="serving worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    sys.exit(cmd_worker(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
