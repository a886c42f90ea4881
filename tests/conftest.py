"""Suite-wide rules. Under ``CI=true`` a skipped test is a failed one: a client library, a service or a
version that is missing on the CI machine must turn the run red, not silently shrink it. Locally a skip
stays a skip (``.ci/run`` prints each reason with ``-rs``)."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

# The GPU decode kernel (handlers/engine/triton_decode.py) runs in these CPU tests through Triton's interpreter,
# which Triton reads once, before its first kernel is defined: so here, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")


def ci_mode() -> bool:
    """True when the suite runs under CI (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if ci_mode() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which allows no skip: {reason}"
