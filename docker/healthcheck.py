"""The container image's HEALTHCHECK: ``GET`` the server's liveness route on its inference listener.

Exit 0 when it answers 200, 1 otherwise. The address comes from the real config loader with the container's
environment (``SERVING_INFERENCE_ADDRESS``, ``SAGEMAKER_BIND_TO_PORT``), so a port changed there is probed
where the server listens; a wildcard bind (``0.0.0.0``, ``::``) is reached over loopback. Liveness, not
readiness: a server whose model is still loading, or failed to, is alive and must not be restarted for it
(``/ping`` is readiness). Health routes need no token (``serving.frontends.http.http_guard.HEALTH_PATHS``).
Only the image's Python: slim images carry no curl. A ``--config FILE`` given on the command line is not seen
here; set a changed inference address through the environment instead.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping

from serving.config.server_config import load_server_config

LIVENESS_ROUTE = "/health/live"
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def liveness_url(env: Mapping[str, str]) -> str:
    """The liveness URL of the inference listener the server started with ``env`` binds."""
    config = load_server_config(None, env=env)
    host, port = config.inference_host_port()
    if config.sagemaker_port is not None:  # the server binds this port instead (serving.server)
        port = config.sagemaker_port
    host = _WILDCARDS.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{LIVENESS_ROUTE}"


def main() -> int:
    try:
        with urllib.request.urlopen(liveness_url(os.environ), timeout=5) as answer:
            return 0 if answer.status == 200 else 1
    except Exception as exc:  # any failure is "not live"
        print(f"healthcheck: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
