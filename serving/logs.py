"""Log setup for the frontend and the worker processes (text or JSON lines, one handler on stderr)."""

from __future__ import annotations

import logging
import sys


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
