"""A real Prometheus (Debian package ``prometheus``; .ci/setup-services installs it) on loopback, configured
with examples/observability/prometheus.yml, scrapes rollserve every second while load runs; through
Prometheus's HTTP API ``up`` is 1 and every query of the Grafana dashboard in examples/observability returns
data."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import REPO, ServerProcess

DASHBOARD = REPO / "examples" / "observability" / "grafana-dashboard.json"
PROMETHEUS_YML = REPO / "examples" / "observability" / "prometheus.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def example_config(target: str) -> str:
    """examples/observability/prometheus.yml as shipped, pointed at ``target`` and scraping every second."""
    text = PROMETHEUS_YML.read_text()
    for old, new in (('"127.0.0.1:8081"', f'"{target}"'), ("scrape_interval: 5s", "scrape_interval: 1s"),
                     ("evaluation_interval: 15s", "evaluation_interval: 1s")):
        assert text.count(old) == 1, f"prometheus.yml no longer has {old!r}: update this test with it"
        text = text.replace(old, new)
    return text


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", ())]
    return [e.replace("$__rate_interval", "1m").replace("$model", ".*") for e in exprs]


@pytest.fixture()
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:  # a skip: printed by .ci/run (-rs), and a failure under CI=true (tests/conftest.py)
        pytest.skip("the prometheus binary is absent (apt-get install prometheus, or run .ci/setup-services as root)")
    return binary


@pytest.fixture()
def rollserve(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path / "rollserve", models={
        "echo": {"option.entryPoint": "echo", "batch_size": "4", "max_batch_delay": "20"},
        "llm": {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "8"}})
    yield s
    s.stop()


@pytest.fixture()
def prometheus(tmp_path: Path, prometheus_binary: str, rollserve: ServerProcess) -> Iterator[str]:
    port = free_port()
    target = rollserve.mgmt.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(example_config(target))
    # the shipped config reads the management token from this file (relative to the config's folder)
    (config.parent / "rollserve-management-token").write_text(rollserve.tokens["management"] + "\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(url: str, expr: str) -> list[dict[str, object]]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body.get("status") == "success", (expr, body)
    return list(body["data"]["result"])


def load(server: ServerProcess) -> None:
    def echo(i: int) -> None:
        httpx.post(server.url + "/predictions/echo", json={"inputs": f"hello number {i}"}, timeout=60)

    def llm(i: int) -> None:
        body = {"inputs": f"once upon a time {i}", "parameters": {"max_new_tokens": 6}, "stream": i % 2 == 0}
        httpx.post(server.url + "/predictions/llm", json=body, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(echo, range(12)))
        list(pool.map(llm, range(6)))
    httpx.post(server.url + "/predictions/echo", content=b"{broken", timeout=10)
    httpx.post(server.url + "/predictions/absent", json={"inputs": "x"}, timeout=10)


def test_prometheus_scrapes_rollserve_and_every_dashboard_query_has_data(
        prometheus: str, rollserve: ServerProcess) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    deadline = time.monotonic() + 90
    missing: list[str] = queries
    rounds = 0
    while missing and time.monotonic() < deadline:
        if rounds < 3:  # load while Prometheus scrapes, so rates span several samples
            load(rollserve)
        rounds += 1
        time.sleep(1.0)
        up = query(prometheus, 'up{job="rollserve"}')
        if not up or up[0]["value"][1] != "1":  # type: ignore[index]
            continue
        missing = [q for q in queries if not query(prometheus, q)]
    assert not missing, f"dashboard queries without data: {missing}"
    assert query(prometheus, 'up{job="rollserve"}')[0]["value"][1] == "1"  # type: ignore[index]
