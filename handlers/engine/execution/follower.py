"""A follower host's agent: joins a leader's tensor-parallel group and runs this host's ranks.

Design note: the agent connects to the leader's rendezvous (retrying while the leader starts), proves it holds
the cluster secret, says ``join`` and waits for its assignment: its ranks, the model folder's name (found in
this host's model store) and the model's options. It then starts the ranks and watches two things: its ranks
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
from pathlib import Path

from handlers.engine.execution.cluster import gloo_interface, spawn_rank
from handlers.engine.execution.rendezvous import SECRET_ENV, AuthError, connect, recv_frame, send_frame

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


def run_follower(leader: tuple[str, int], model_store: Path, secret: str, node_rank: int | None = None,
                 connect_timeout_s: float = 600.0) -> int:
    """Serve as one follower host until the group ends. Returns the exit status: 0 when the leader ended the
    group, 1 when a rank failed or the leader went away, 2 when it refused this host or the model is missing."""
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
    model_dir = model_store / assignment["model"]
    if not model_dir.is_dir():
        logger.error("model folder %s is not in this host's model store %s", assignment["model"], model_store)
        return 2
    first, count = assignment["first_rank"], assignment["ranks"]
    env = {SECRET_ENV: secret, **gloo_interface(sock.getsockname()[0])}
    ranks = [spawn_rank(first + i, assignment["world_size"], leader, model_dir, assignment["options"],
                        f"cuda:{i}" if assignment["gpu"] else "cpu", env) for i in range(count)]
    logger.info("running ranks %d-%d of %d for model %s", first, first + count - 1, assignment["world_size"],
                assignment["model"])
    return _watch(sock, ranks)


def _watch(sock: socket.socket, ranks: list[subprocess.Popen[bytes]]) -> int:
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
