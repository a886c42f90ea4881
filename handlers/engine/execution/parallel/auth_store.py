"""``AuthStore``: a ``torch.distributed.Store`` served by rank 0's ``Rendezvous`` over one authenticated connection
(``handlers.engine.execution.parallel.rendezvous``), which gloo and NCCL use like any store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from handlers.engine.execution.parallel.rendezvous import WAIT_S, connect, recv_frame, send_frame


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` served by a ``Rendezvous``; one authenticated connection per store."""

    def __init__(self, host: str, port: int, secret: bytes, connect_timeout_s: float = 60.0) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._timeout = timedelta(seconds=WAIT_S)
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._sock = connect(host, port, secret)
                break
            except (ConnectionRefusedError, socket.timeout):
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _call(self, request: dict[str, Any]) -> Any:
        with self._lock:
            send_frame(self._sock, request)
            answer = recv_frame(self._sock)
        if "error" in answer:
            raise RuntimeError(f"rendezvous store: {answer['error']}")
        return answer.get("value")

    def set(self, key: str, value: str | bytes) -> None:
        self._call({"op": "set", "key": key, "value": value.encode() if isinstance(value, str) else bytes(value)})

    def get(self, key: str) -> bytes:
        return bytes(self._call({"op": "get", "key": key, "timeout": self._timeout.total_seconds()}))

    def add(self, key: str, amount: int) -> int:
        return int(self._call({"op": "add", "key": key, "amount": amount}))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        enc: Callable[[str | bytes], bytes] = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return bytes(self._call({"op": "compare_set", "key": key, "expected": enc(expected),
                                 "desired": enc(desired)}))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = (timeout or self._timeout).total_seconds()
        self._call({"op": "wait", "keys": list(keys), "timeout": seconds})

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)}))

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete", "key": key}))

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"}))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
