"""Log setup for the frontend and the worker processes (text or JSON lines, one handler on stderr).

Design note: the frontend runs one uvicorn server per HTTP listener (inference, management, metrics), and each
logs its lifecycle ("Started server process [pid]", "Shutting down", "Finished server process [pid]") to the
one ``uvicorn.error`` logger, so every such line came out once per listener, word for word. ``OncePerProcess``
lets each through once; the composition root's own lines name each listener.
"""

from __future__ import annotations

import logging
import sys

# uvicorn's lines about the whole process, which every uvicorn server in it logs alike.
UVICORN_PROCESS_LINES = frozenset({
    "Started server process [%d]", "Finished server process [%d]", "Shutting down",
    "Waiting for connections to close. (CTRL+C to force quit)",
    "Waiting for background tasks to complete. (CTRL+C to force quit)"})


class OncePerProcess(logging.Filter):
    """Drops a uvicorn process line already written (the same words from another listener's server)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or record.msg not in UVICORN_PROCESS_LINES:
            return True
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def setup_logging(fmt: str, level: str = "INFO", process_tag: str = "") -> None:
    """Route all logging to stderr as text or JSON (python-json-logger); ``process_tag`` marks workers."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        fields = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
        handler.setFormatter(JsonFormatter(fields, static_fields={"proc": process_tag} if process_tag else None))
    else:
        tag = f" {process_tag}[%(process)d]" if process_tag else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s{tag} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, OncePerProcess) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(OncePerProcess())
