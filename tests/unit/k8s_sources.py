"""``serving k8s`` asks a fetched model's source for its size (serving/deploy/source_size.py). Tests that are not
about that point every source at nothing, so no test reaches a real registry, bucket or hub and each sees the
same answer: the size cannot be known, the stated default applies."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sources_out_of_reach(mp: pytest.MonkeyPatch, empty: Path) -> None:
    """pip: no index, find-links an empty folder; S3 and the hub: a closed loopback port."""
    nowhere = f"http://127.0.0.1:{closed_port()}"
    for name, value in {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty), "AWS_ENDPOINT_URL": nowhere,
                        "HF_ENDPOINT": nowhere, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(name, value)
    mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
