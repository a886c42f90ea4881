"""A follower host's agent: joins a leader's tensor-parallel group and runs this host's ranks.

Design note: the agent connects to the leader's rendezvous (retrying while the leader starts), proves it holds
the cluster secret, says ``join`` and waits for its assignment: its ranks, the model's name and options, and the
manifest of the leader's weights. It gets its own copy (``serving.worker.follower_weights``: fetched from the
source or streamed from the leader), checks it against the manifest and tells the leader (who fails the model,
naming the file, when the copy differs), then starts the ranks on that copy and watches two things: its ranks
and the connection to the leader. Either ending ends the agent (its ranks are killed with it): a leader that
died, restarted its worker or shut down forms a new group, and the agent is restarted by whatever runs it
(LeaderWorkerSet, systemd, a shell loop), as a torchrun agent would be.
"""

from __future__ import annotations

import logging
import select
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from handlers.engine.execution.parallel.cluster import gloo_interface
from handlers.engine.execution.parallel.host_weights import FileEntry, check
from handlers.engine.execution.parallel.rank_process import RankProcess, spawn_rank
from handlers.engine.execution.parallel.rendezvous import SECRET_ENV, AuthError, connect, recv_frame, send_frame
from rollcore.errors import ConfigError

logger = logging.getLogger(__name__)


def join(leader: tuple[str, int], secret: str, timeout_s: float) -> socket.socket:
    """An authenticated connection to the leader, retried while it is not listening yet. Raises ``AuthError``
    at once (a wrong secret is not fixed by waiting), ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return connect(*leader, secret.encode())
        except AuthError:
            raise
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no leader at {leader[0]}:{leader[1]} after {timeout_s:g} s: {exc}") from exc
            time.sleep(0.5)


class Placer(Protocol):
    """How this host gets the weights of an assignment (``serving.worker.follower_weights``)."""

    def place(self, assignment: Mapping[str, Any], open_stream: Callable[[], socket.socket]) -> Any:
        """An object with ``folder`` (the local folder the ranks load) and ``how`` (words for the logs)."""


def run_follower(leader: tuple[str, int], secret: str, placer: Placer, node_rank: int | None = None,
                 connect_timeout_s: float = 600.0) -> int:
    """Serve as one follower host until the group ends. Returns the exit status: 0 when the leader ended the
    group, 1 when a rank failed, the leader went away or the weights could not be fetched, 2 when it refused
    this host or this host's copy of the weights (``placer``'s) is not the leader's."""
    try:
        sock = join(leader, secret, connect_timeout_s)
    except AuthError as exc:
        logger.error("cannot join the tensor-parallel group at %s:%d: %s", *leader, exc)
        return 2
    send_frame(sock, {"op": "join", "node_rank": node_rank})
    logger.info("joined the leader at %s:%d; waiting for an assignment", *leader)
    try:
        assignment = recv_frame(sock)["assignment"]
    except (ConnectionError, OSError):
        logger.error("the leader closed the connection before assigning ranks")
        return 1
    model_dir = _weights(assignment, sock, lambda: connect(*leader, secret.encode()), placer)
    if isinstance(model_dir, int):
        sock.close()
        return model_dir
    options = {**assignment["options"], "model_id": str(model_dir)}
    first, count = assignment["first_rank"], assignment["ranks"]
    env = {SECRET_ENV: secret, **gloo_interface(sock.getsockname()[0])}
    ranks = [spawn_rank(first + i, assignment["world_size"], leader, model_dir, options,
                        f"cuda:{i}" if assignment["gpu"] else "cpu", env) for i in range(count)]
    logger.info("running ranks %d-%d of %d for model %s", first, first + count - 1, assignment["world_size"],
                assignment["model"])
    return _watch(sock, ranks)


def _weights(assignment: Mapping[str, Any], sock: socket.socket, open_stream: Callable[[], socket.socket],
             placer: Placer) -> Path | int:
    """This host's copy of the weights, checked against the leader's manifest, and the leader told so; or the
    exit status when there is none (the leader told why: a mismatch is permanent, a failed fetch is not)."""
    entries = [FileEntry.from_wire(e) for e in assignment["weights"]["manifest"]]
    try:
        placed = placer.place(assignment, open_stream)
        num_files, num_bytes = check(placed.folder, entries, f"this host's copy ({placed.how})")
    except Exception as exc:  # noqa: BLE001 - whatever stops this host, the leader fails the model with it
        permanent = isinstance(exc, ConfigError)
        logger.error("cannot get the weights of model %s: %s", assignment["model"], exc)
        try:
            send_frame(sock, {"error": str(exc), "permanent": permanent})
        except OSError:
            pass
        return 2 if permanent else 1
    logger.info("weights of model %s verified against the leader's manifest: %d files, %.1f MiB (%s)",
                assignment["model"], num_files, num_bytes / 2**20, placed.how)
    send_frame(sock, {"ok": True, "how": placed.how, "files": num_files, "bytes": num_bytes})
    return Path(placed.folder)


def _watch(sock: socket.socket, ranks: list[RankProcess]) -> int:
    status = 0
    while True:
        done = [r.returncode for r in ranks if r.poll() is not None]
        if done:
            status = 0 if all(c == 0 for c in done) else 1
            logger.log(logging.INFO if status == 0 else logging.ERROR, "a rank exited (%s): leaving the group",
                       done)
            break
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable and not sock.recv(4096):
            logger.error("the leader went away: leaving the group")
            status = 1
            break
    for r in ranks:
        if r.poll() is None:
            r.terminate()
    for r in ranks:
        try:
            r.wait(5)
        except subprocess.TimeoutExpired:
            r.kill()
    sock.close()
    return status
