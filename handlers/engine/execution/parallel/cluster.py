"""Where a tensor-parallel group's ranks run: how many hosts, read from the variables torchrun and
LeaderWorkerSet set (or rollserve's own), which network interface the ranks meet on, and starting a rank
process (torch-free: a follower host's agent runs only this and the rendezvous).

Design note: the leader (rank 0's host: the frontend and the scheduler) learns the layout from its environment,
as a launcher sets it: ``ROLLSERVE_TP_NODES`` if set, else LeaderWorkerSet's ``LWS_GROUP_SIZE``, else
torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``; the rendezvous listens on ``MASTER_PORT`` (torchrun's, default
29500). Several hosts need ``ROLLSERVE_CLUSTER_SECRET``: without it the group would have to trust anyone who
reaches the port, so the model is refused instead.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from handlers.engine.execution.parallel.rendezvous import SECRET_ENV

DEFAULT_PORT = 29500
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int  # hosts in the group, the leader's included
    port: int  # the rendezvous port on the leader
    secret: str
    bind: str  # the address the rendezvous listens on


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not an integer") from None


def host_count(env: Mapping[str, str]) -> tuple[int, str]:
    """How many hosts the group spans and which variable said so (1, "" when none did)."""
    for key in ("ROLLSERVE_TP_NODES", "LWS_GROUP_SIZE"):
        n = _int(env, key)
        if n is not None:
            return n, key
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    if world is not None and local:
        return world // local, "WORLD_SIZE/LOCAL_WORLD_SIZE"
    return 1, ""


def leader_spec(env: Mapping[str, str], world_size: int) -> ClusterSpec | None:
    """The group's layout for a leader with ``world_size`` ranks, or None when every rank runs on this host.
    Raises ValueError when the layout cannot hold the ranks or the secret is missing."""
    nodes, source = host_count(env)
    if nodes <= 1:
        return None
    if world_size % nodes:
        raise ValueError(f"tensor_parallel_degree={world_size} does not split over {nodes} hosts ({source})")
    secret = env.get(SECRET_ENV, "")
    if not secret:
        raise ValueError(f"tensor parallelism over {nodes} hosts ({source}) needs {SECRET_ENV}: the followers "
                         "prove they hold it before they may join")
    return ClusterSpec(nodes, _int(env, "MASTER_PORT") or DEFAULT_PORT, secret,
                       env.get("ROLLSERVE_CLUSTER_BIND", "0.0.0.0"))


def gloo_interface(address: str) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` for the interface holding ``address`` (gloo otherwise picks the interface of the
    host name, which another host may not reach); empty when the user chose one or none matches."""
    import fcntl
    import os

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


def spawn_rank(rank: int, world_size: int, store: tuple[str, int], model_dir: Path, options: Mapping[str, str],
               device: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start rank ``rank`` as a child process that dies with this one; ``env`` carries the group's secret
    (never the command line, which other users of the host can read)."""
    return subprocess.Popen(
        [sys.executable, "-m", "handlers.engine.execution.parallel.ranks", "--rank", str(rank), "--world-size",
         str(world_size), "--store", f"{store[0]}:{store[1]}", "--model-dir", str(model_dir),
         "--options", json.dumps(dict(options)), "--device", device],
        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, env={**os.environ, **env})


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when its parent dies, so no rank is orphaned."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
