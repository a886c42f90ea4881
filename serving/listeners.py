"""The server's listening addresses, bound before anything else starts.

Design note: every listener (inference, management, metrics over HTTP; gRPC) is bound, or for gRPC probed, before
the key file is written or a model is looked at, so an address that is taken ends startup at once with nothing to
undo: ``ListenError`` carries one line naming the address, the setting that chose it (and where it was set) and
how to change it, which ``serving.cli`` prints instead of a traceback. The HTTP sockets are handed to uvicorn as
they are (the bound port is known before serving); gRPC binds its own socket later (``grpc.aio``), so its probe
also catches a port held by another process that would otherwise share it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from serving.config.server_config import ServerConfig

# The setting (config.properties key) behind each listener: what the message tells the user to change.
SETTINGS = {"inference": "inference_address", "management": "management_address", "metrics": "metrics_address",
            "grpc": "grpc_address"}


class ListenError(Exception):
    """An address the server cannot listen on; ``str()`` is the one line the command prints."""


@dataclass(slots=True)
class Listener:
    name: str  # inference, management, metrics
    host: str
    sock: socket.socket

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = ephemeral), so the bound port is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket says IPPROTO_TCP, and
    # accepted sockets take the listener's; with 0 each response's body waited ~40 ms for the head's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def http_addresses(config: ServerConfig) -> list[tuple[str, str, int]]:
    """``(name, host, port)`` of each HTTP listener the configuration asks for, inference first."""
    host, port = config.inference_host_port()
    if config.sagemaker_port is not None:  # SageMaker names the port the container must answer on
        port = config.sagemaker_port
    out = [("inference", host, port)]
    if (mhp := config.management_host_port()) is not None:
        out.append(("management", *mhp))
    if (metrics := config.metrics_host_port()) is not None:
        out.append(("metrics", *metrics))
    return out


def bind_all(config: ServerConfig) -> list[Listener]:
    """Bind every HTTP listener and probe the gRPC address; on the first that fails, close the others and raise
    ``ListenError``."""
    bound: list[Listener] = []
    addresses: list[tuple[str, str, int]] = http_addresses(config)
    if (ghp := config.grpc_host_port()) is not None:
        addresses.append(("grpc", *ghp))
    try:
        for name, host, port in addresses:
            try:
                sock = bind(host, port)
            except OSError as exc:
                raise listen_error(config, name, host, port, exc) from None
            if name == "grpc":
                sock.close()  # only a probe: grpc.aio binds the port itself (serving.frontends.grpc.grpc_server)
            else:
                bound.append(Listener(name, host, sock))
    except BaseException:
        for listener in bound:
            listener.sock.close()
        raise
    return bound


def listen_error(config: ServerConfig, name: str, host: str, port: int, exc: BaseException) -> ListenError:
    """The one line for a listener that cannot bind: where, which setting (and where it was set), how to change."""
    reason = (exc.strerror or str(exc)).lower() if isinstance(exc, OSError) else str(exc)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if name == "inference" and config.sagemaker_port is not None:
        setting, source = "SAGEMAKER_BIND_TO_PORT", config.sources.get("sagemaker_port", "env SAGEMAKER_BIND_TO_PORT")
        fix = "set another port in env SAGEMAKER_BIND_TO_PORT"
    else:
        setting = SETTINGS[name]
        source = config.sources.get(setting, "default")
        fix = f"set {setting} in config.properties or env SERVING_{setting.upper()} (port 0: any free port)"
    origin = "the default" if source == "default" else source
    return ListenError(f"rollserve: cannot listen on {address} ({setting}, from {origin}): {reason}; {fix}")
