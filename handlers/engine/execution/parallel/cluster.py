"""Where a tensor-parallel group's ranks run: how many hosts, read from the variables torchrun and
LeaderWorkerSet set (or rollserve's own) and which network interface the ranks meet on (torch-free: a follower
host's agent runs only this, the rendezvous and ``rank_process``).

Design note: the leader (rank 0's host: the frontend and the scheduler) learns the layout from its environment,
as a launcher sets it: ``ROLLSERVE_TP_NODES`` if set, else LeaderWorkerSet's ``LWS_GROUP_SIZE``, else
torchrun's ``WORLD_SIZE / LOCAL_WORLD_SIZE``; the rendezvous listens on ``MASTER_PORT`` (torchrun's, default
29500). Several hosts need ``ROLLSERVE_CLUSTER_SECRET``: without it the group would have to trust anyone who
reaches the port, so the model is refused instead.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

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
