"""The tensor-parallel group's rendezvous: a key-value store for ``torch.distributed`` that only peers holding
the group's secret can reach, and the door through which follower hosts join a leader.

Design note: torch's ``TCPStore`` accepts anyone who can reach its port, and a group spanning hosts must listen
on the network. Here rank 0 runs ``Rendezvous``, a small threaded TCP server: every connection first proves it
knows the shared secret (HMAC-SHA256 challenge and response, both ways, the secret never sent), then speaks
length-prefixed msgpack requests. Ranks reach it through ``auth_store.AuthStore``, a ``torch.distributed.Store``
that gloo and NCCL use like any store. A follower host's agent connects the same way and sends ``join``; the
leader answers with its assignment (which ranks, which model, the options, the manifest of the weights), the
follower answers once it holds a verified copy of the weights (``handlers.engine.execution.parallel.host_weights``; it
may read the leader's shared files through a connection of its own), and the connection stays open as the follower's
lifeline: when it closes, the leader knows the follower is gone (and the follower knows the leader is).
Torch-free, like the agent that imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

logger = logging.getLogger(__name__)

SECRET_ENV = "ROLLSERVE_CLUSTER_SECRET"
NONCE = 32
_MAX_FRAME = 64 << 20
MAX_READ = 8 << 20  # bytes of a shared file one ``file`` operation returns: well under a frame
WAIT_S = 600.0  # how long a store read waits for its key (ranks of one group start within minutes)


class AuthError(Exception):
    """The other side does not hold the group's secret (or did not answer the handshake)."""


def _mac(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    return hmac.new(secret, b"rollserve-rendezvous/" + role + b"/" + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return bytes(data)


def send_frame(sock: socket.socket, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_frame(sock: socket.socket) -> Any:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if size > _MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes refused")
    return msgpack.unpackb(_recv_exact(sock, size), raw=False)


def accept_handshake(sock: socket.socket, secret: bytes) -> None:
    """Server side: the client must answer our nonce; then we answer its nonce. Raises ``AuthError``."""
    nonce = os.urandom(NONCE)
    sock.sendall(nonce)
    answer = _recv_exact(sock, 32 + NONCE)
    if not hmac.compare_digest(answer[:32], _mac(secret, nonce, b"client")):
        sock.sendall(b"\x00")
        raise AuthError("wrong cluster secret")
    sock.sendall(b"\x01" + _mac(secret, answer[32:], b"server"))


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Client side of ``accept_handshake``. Raises ``AuthError`` when either side lacks the secret."""
    nonce = _recv_exact(sock, NONCE)
    mine = os.urandom(NONCE)
    sock.sendall(_mac(secret, nonce, b"client") + mine)
    try:
        verdict = _recv_exact(sock, 1)
    except ConnectionError:
        raise AuthError("the leader closed the connection during the handshake") from None
    if verdict != b"\x01":
        raise AuthError("the leader refused this peer: wrong cluster secret")
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(secret, mine, b"server")):
        raise AuthError("the leader does not hold the cluster secret")


def connect(host: str, port: int, secret: bytes, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Follower:
    """A follower host's agent, connected and authenticated, waiting for (or holding) its assignment."""

    def __init__(self, sock: socket.socket, address: tuple[str, int], node_rank: int | None) -> None:
        self.sock = sock
        self.address = address
        self.node_rank = node_rank
        self.local_address = sock.getsockname()[0]  # the leader's address on the follower's network


class Rendezvous:
    """Rank 0's server: the store of one tensor-parallel group and the door for follower hosts."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.secret = secret
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._followers: list[Follower] = []
        self._lost: list[str] = []
        self._shared: dict[str, Path] = {}  # the weight files peers may read (``share``)
        self._closed = False
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept_loop, name="rendezvous", daemon=True).start()

    # ------------------------------------------------------------------ followers
    def wait_followers(self, count: int, log_every_s: float = 30.0) -> list[Follower]:
        """Block until ``count`` follower hosts have joined; returns them ordered by node rank (requested ranks
        first, then the order they joined)."""
        last_log = 0.0
        with self._cond:
            while len(self._followers) < count:
                if time.monotonic() - last_log >= log_every_s:
                    logger.info("waiting for %d follower host(s) on port %d (%d joined)", count, self.port,
                                len(self._followers))
                    last_log = time.monotonic()
                self._cond.wait(1.0)
            joined = list(self._followers)
        return sorted(joined, key=lambda f: (f.node_rank is None, f.node_rank or 0))

    def share(self, files: dict[str, Path]) -> None:
        """Let peers read these files (relative name -> path) with the ``file`` operation, and no other."""
        self._shared = dict(files)

    def assign(self, follower: Follower, assignment: dict[str, Any]) -> None:
        """Send ``follower`` its assignment (it then gets the weights: ``weights_answer``)."""
        send_frame(follower.sock, {"assignment": assignment})

    def weights_answer(self, follower: Follower) -> dict[str, Any]:
        """Wait for ``follower``'s answer about the weights (``{"ok": ...}`` or ``{"error": ..., "permanent":
        ...}``); on success its connection becomes its watched lifeline. Raises ``ConnectionError`` when the
        follower leaves first."""
        try:
            answer = recv_frame(follower.sock)
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            raise ConnectionError(f"follower host {follower.address[0]} left while getting the weights: "
                                  f"{exc or type(exc).__name__}") from None
        if answer.get("ok"):
            threading.Thread(target=self._watch, args=(follower,), name="follower-watch", daemon=True).start()
        return answer

    @property
    def lost(self) -> list[str]:
        """Followers whose connection closed after they joined (their hosts' ranks are gone)."""
        with self._cond:
            return list(self._lost)

    def _watch(self, follower: Follower) -> None:
        try:
            while follower.sock.recv(4096):
                pass
        except OSError:
            pass
        if not self._closed:
            logger.error("follower host %s:%d left the tensor-parallel group", *follower.address)
            with self._cond:
                self._lost.append(f"{follower.address[0]}:{follower.address[1]}")

    # ------------------------------------------------------------------ server
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, address), name="rendezvous-peer",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, address: tuple[str, int]) -> None:
        sock.settimeout(10.0)
        try:
            accept_handshake(sock, self.secret)
        except AuthError as exc:
            logger.error("refused a peer from %s:%d: %s", address[0], address[1], exc)
            sock.close()
            return
        except (OSError, ConnectionError):
            sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                request = recv_frame(sock)
                if request.get("op") == "join":
                    with self._cond:
                        self._followers.append(Follower(sock, address, request.get("node_rank")))
                        self._cond.notify_all()
                    logger.info("follower host %s:%d joined (node rank %s)", address[0], address[1],
                                request.get("node_rank", "any"))
                    return  # the socket now belongs to the follower's watch
                send_frame(sock, self._answer(request))
        except (OSError, ConnectionError, ValueError, msgpack.UnpackException):
            sock.close()

    def _answer(self, r: dict[str, Any]) -> dict[str, Any]:
        op, data = r.get("op"), self._data
        with self._cond:
            if op == "set":
                data[r["key"]] = r["value"]
                self._cond.notify_all()
                return {"ok": True}
            if op in ("get", "wait"):
                keys = [r["key"]] if op == "get" else r["keys"]
                timeout = float(r.get("timeout") or WAIT_S)
                if not self._cond.wait_for(lambda: all(k in data for k in keys), timeout):
                    return {"error": f"timed out after {timeout:g} s waiting for {keys}"}
                return {"value": data[keys[0]]} if op == "get" else {"ok": True}
            if op == "add":
                value = int(data.get(r["key"], b"0")) + int(r["amount"])
                data[r["key"]] = str(value).encode()
                self._cond.notify_all()
                return {"value": value}
            if op == "compare_set":
                current = data.get(r["key"])
                if (current is None and not r["expected"]) or current == r["expected"]:
                    data[r["key"]] = current = r["desired"]
                    self._cond.notify_all()
                return {"value": current if current is not None else r["expected"]}
            if op == "check":
                return {"value": all(k in data for k in r["keys"])}
            if op == "delete":
                return {"value": data.pop(r["key"], None) is not None}
            if op == "num_keys":
                return {"value": len(data)}
        if op == "file":  # outside the lock: a read of a large file must not hold up the store
            try:
                return {"data": self._read_shared(str(r["name"]), int(r["offset"]), int(r["length"]))}
            except KeyError:
                return {"error": f"{r['name']!r} is not among the leader's weight files"}
            except OSError as exc:
                return {"error": f"{r['name']}: {exc.strerror or exc}"}
        return {"error": f"unknown store operation {op!r}"}

    def _read_shared(self, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of the shared file ``name`` from ``offset``; KeyError for any other name."""
        with self._shared[name].open("rb") as f:
            f.seek(offset)
            return f.read(min(length, MAX_READ))

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._cond:
            followers = list(self._followers)
        for f in followers:
            try:
                f.sock.close()
            except OSError:
                pass
