"""Suite-wide rules. Under ``CI=true`` a skipped test is a failed one: a client library, a service or a
version that is missing on the CI machine must turn the run red, not silently shrink it. Locally a skip
stays a skip (``.ci/run`` prints each reason with ``-rs``)."""

from __future__ import annotations

import functools
import os
from collections.abc import Generator
from typing import Any

import pytest

# The GPU decode kernel (handlers/engine/execution/gpu/triton_decode.py) runs in these CPU tests through Triton's
# interpreter, which Triton reads once, before its first kernel is defined: so here, before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# As the launcher gives workers (serving.worker.launcher.worker_env): the engines these tests run in process see
# MKL's GEMM buffers returned to malloc, not pooled; MKL reads it when torch is imported, so before that too.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")


def _share_ssl_contexts() -> None:
    """Every ``httpx.get``/``post`` builds a client, and every client an SSL context from the CA bundle: 35 ms
    of this process's CPU per call, though the servers under test speak plain HTTP. The tests make thousands
    of such calls (polling a server's state among them), competing with the servers for the same cores; one
    context per distinct setting serves them all (an ``SSLContext`` may be shared)."""
    import httpx._transports.default as transports

    build = transports.create_ssl_context

    @functools.lru_cache(maxsize=8)
    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = shared  # type: ignore[assignment]


_share_ssl_contexts()


def ci_mode() -> bool:
    """True when the suite runs under CI (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker (``.ci/run`` runs files side by side) keeps to its share of the cores, and so do
    the servers it starts (they inherit the mask and size their workers and threads from it: ``auto``): two
    workers' servers each spinning OpenMP threads on every core made the suite slower than running alone."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    from tests.scheduling import pin

    global _own_cores
    _own_cores = pin(int(workerinput["workercount"]), int(str(workerinput["workerid"]).removeprefix("gw")))


_TIERS = {"unit": "unit", "engine": "engine", "handlers": "engine", "integration": "integration"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's tier from its folder (``-m unit``, ``-m "not matrix"``; setup.cfg lists the markers)."""
    for item in items:
        parts = item.nodeid.split("::")[0].split("/")
        tier = _TIERS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None
        if tier is not None:
            item.add_marker(tier)
        if item.nodeid.split("::")[0] in _FAMILY_FILES:
            item.add_marker("matrix")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if ci_mode() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which allows no skip: {reason}"
    if call.when == "teardown" and (start := item.stash.get(_IDLE_AT, None)) is not None:
        from tests.scheduling import idle_seconds

        report.user_properties.append((IDLE_KEY, idle_seconds() - start))


# --- the support matrix of docs/configuration.md, regenerated from a full run's family results ------------------
_FAMILY_FILES = ("tests/engine/test_families.py", "tests/integration/test_families_http.py")
_family_results: dict[str, str] = {}


def _full_run(config: pytest.Config) -> bool:
    """A run of the whole suite (as ``.ci/run`` does): no file, keyword or marker selection."""
    paths = [str(a).split("::")[0].rstrip("/") for a in config.args]
    return not config.option.keyword and not config.option.markexpr and all(p in ("tests", ".") or
                                                                            p.endswith("/tests") for p in paths)


# --- where a run's time goes: the slowest files and each xdist worker's busy time, printed at its end ------------
_file_seconds: dict[str, float] = {}
_file_idle: dict[str, float] = {}  # the seconds a file's worker's own cores sat idle (pinned workers only)
_worker_seconds: dict[str, float] = {}
_own_cores = False
IDLE_KEY = "rollserve_idle_s"
_IDLE_AT = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if _own_cores:
        from tests.scheduling import idle_seconds

        item.stash[_IDLE_AT] = idle_seconds()
    yield


def _count_time(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    for key, value in report.user_properties:
        if key == IDLE_KEY:
            _file_idle[path] = _file_idle.get(path, 0.0) + float(value)
    gateway = getattr(getattr(report, "node", None), "gateway", None)  # the xdist worker that ran it
    worker = str(getattr(gateway, "id", "main"))
    _worker_seconds[worker] = _worker_seconds.get(worker, 0.0) + report.duration


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` as tests/scheduling.py refines it: files sharing a session server on one worker,
    the longest first."""
    if config.getoption("dist") != "loadfile":
        return None
    from tests.scheduling import SuiteScheduling

    return SuiteScheduling(config, log)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The 15 files whose tests took longest (setup, call and teardown summed) and each worker's busy seconds:
    what to look at first when the suite grows slower (a fixture set up per test, a file started late).
    ``ROLLSERVE_FILE_SECONDS=PATH`` also writes each file's seconds and its cores' idle seconds there
    (tests/scheduling.py orders and places the files by them)."""
    if hasattr(config, "workerinput") or len(_file_seconds) < 2:
        return
    if record := os.environ.get("ROLLSERVE_FILE_SECONDS"):
        from tests.scheduling import write_record

        write_record(record, _file_seconds, _file_idle)
    terminalreporter.write_sep("=", "slowest files (their tests' setup + call + teardown, seconds)")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line("busy seconds per worker: " + ", ".join(
        f"{w} {s:.1f}" for w, s in sorted(_worker_seconds.items())))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _count_time(report)
    path = report.nodeid.split("::")[0]
    if path not in _FAMILY_FILES or (report.when != "call" and report.passed):
        return
    name = report.nodeid.split("::")[-1]
    state = "passed" if report.passed else "skipped" if report.skipped else "failed"
    if _family_results.get(name) in (None, "passed"):
        _family_results[name] = state
    for key, value in report.user_properties:
        if key != IDLE_KEY:
            _family_results[f"{name}#{key}"] = str(value)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not _full_run(session.config) or not _family_results:
        return  # an xdist worker (the controller sees every report), or not a full run
    from tests.support_matrix import build_table, committed_table

    table = build_table(_family_results)
    if table != committed_table():
        out = session.config.rootpath / "support-matrix.regenerated.md"
        out.write_text(table + "\n")
        session.config.get_terminal_writer().line(
            f"the support matrix of docs/configuration.md differs from this run's family results: the regenerated "
            f"table is in {out} (python -m tests.support_matrix --junit FILE rewrites it)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
