"""SageMaker stateful sessions on /invocations (serving/frontends/http/sessions.py): a model served by two rolling-batch
workers with the prefix cache on; a multi-turn session's turns all go to one worker (each answer names it in
X-Worker-Id) and the later turns find the earlier ones' blocks in that worker's prefix cache (the
rollserve_prefix_cache_hits counter rises); NEW_SESSION and CLOSE answer AWS's headers, an unknown or closed
session id is a 400 naming the header, and the store's bounds hold."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion

from serving.frontends.http.sessions import SessionStore
from tests.integration.harness import ServerProcess

MODEL = "chat"
SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture
def server(two_workers_server: ServerProcess) -> ServerProcess:
    return two_workers_server  # conftest.py: shared with the routing tests


def invoke(server: ServerProcess, body: dict[str, object], session: str | None = None) -> httpx.Response:
    headers = {**server.inference_headers, **({SESSION: session} if session is not None else {})}
    return httpx.post(f"{server.url}/invocations", json=body, headers=headers, timeout=120)


def prefix_hits(server: ServerProcess) -> float:
    text = httpx.get(f"{server.mgmt}/metrics", headers=server.mgmt_headers, timeout=30).text
    return sum(float(m) for m in re.findall(rf'^rollserve_prefix_cache_hits_total{{model="{MODEL}"[^}}]*}} (\S+)$',
                                             text, re.M))


def test_a_session_stays_on_one_worker_and_hits_its_prefix_cache(server: ServerProcess) -> None:
    assert len(server.describe(MODEL)["workers"]) == 2
    opened = invoke(server, {"requestType": "NEW_SESSION"})
    assert opened.status_code == 200, opened.text
    header = opened.headers["X-Amzn-SageMaker-New-Session-Id"]
    match = re.fullmatch(r"([0-9a-f]{32}); Expires=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)", header)
    assert match is not None, header
    session = match.group(1)
    assert opened.json() == {"session_id": session, "expires": match.group(2), "model": MODEL}
    hits_before = prefix_hits(server)
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly. " * 8}]
    workers = set()
    for turn in ("Hello there", "What is two plus two?", "And three plus three?", "Thank you"):
        messages.append({"role": "user", "content": turn})
        r = invoke(server, {"messages": messages, "max_tokens": 4, "temperature": 0}, session)
        assert r.status_code == 200, r.text
        answer = ChatCompletion.model_validate(r.json())
        workers.add(r.headers["X-Worker-Id"])
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    assert len(workers) == 1, workers
    assert prefix_hits(server) > hits_before
    closed = invoke(server, {"requestType": "CLOSE"}, session)
    assert closed.status_code == 200, closed.text
    assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session
    again = invoke(server, {"messages": messages, "max_tokens": 2}, session)
    assert again.status_code == 400
    assert SESSION in again.json()["error"] and "unknown, closed or expired" in again.json()["error"]


def test_session_errors_name_the_header_or_field(server: ServerProcess) -> None:
    unknown = invoke(server, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, "no-such-session")
    assert unknown.status_code == 400 and unknown.json()["error"].startswith(SESSION)
    close_without = invoke(server, {"requestType": "CLOSE"})
    assert close_without.status_code == 400 and SESSION in close_without.json()["error"]
    bad_kind = invoke(server, {"requestType": "RESET"})
    assert bad_kind.status_code == 400 and bad_kind.json()["error"].startswith("'requestType' must be")
    plain = invoke(server, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})  # no session: as before
    assert plain.status_code == 200 and set(plain.json()) == {"generated_text"}
    assert plain.headers["X-Worker-Id"] in {"1", "2", "3", "4"}


def test_the_store_is_bounded_by_count_and_time(tmp_path: Path) -> None:
    now = [1000.0]
    ended: list[str] = []
    store = SessionStore(max_sessions=2, ttl_s=60, clock=lambda: now[0], on_end=lambda s: ended.append(s.id))
    a, b = store.open("m"), store.open("m")
    with pytest.raises(Exception, match="2 sessions are open"):
        store.open("m")
    store.close(a.id, "m")
    c = store.open("m")
    now[0] += 61  # both b and c expired
    assert len(store) == 0 and ended == [a.id, b.id, c.id]
    with pytest.raises(Exception, match=SESSION):
        store.get(b.id, "m")
