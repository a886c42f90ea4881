"""Loopback servers for the model-source tests: a real S3-protocol server (moto's), a fault proxy in front of it,
and a small model hub serving repositories from a folder.

Design note: the fetchers are tested against servers speaking the real protocols over real sockets, not against
mocked clients, so what is checked is what boto3 and huggingface_hub actually send and accept. Each helper is a
context manager yielding the endpoint URL (``http://127.0.0.1:<port>``); an end-to-end test can start them the
same way and point ``AWS_ENDPOINT_URL`` / ``HF_ENDPOINT`` at them.

The hub serves ``root/<org>/<name>/<revision>/<files...>``: each revision a folder (``main`` is the default),
its commit hash ``sha1("<org>/<name>@<revision>")``. It implements what huggingface_hub uses to list and fetch:
``GET /api/models/<repo>[/revision/<rev>]`` (``siblings`` with sizes), ``GET /api/models/<repo>/tree/<rev>``,
and ``HEAD``/``GET /<repo>/resolve/<rev>/<path>`` with ``X-Repo-Commit``, ``ETag``, ``Content-Length`` and byte
ranges, with the hub's ``X-Error-Code`` on a missing repository, revision or file.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import re
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from moto.server import ThreadedMotoServer


class _Server(ThreadingHTTPServer):
    """Keeps its open connections, so that stopping it also ends the kept-alive ones (a client's next request
    then finds nothing listening, as after a real server went away)."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self.lock:
            for sock in self.open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Run ``handler`` on a loopback port in a thread; yields the base URL."""
    server = _Server(handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        server.drop_connections()
        thread.join()


class _Quiet(BaseHTTPRequestHandler):
    """A handler that does not log each request to stderr."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Requests are not logged: the tests assert on outcomes."""


# ---- S3 -------------------------------------------------------------------------------------------------------


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3-protocol server on a free loopback port, its state reset on entry and exit, its request log
    quiet; yields its URL."""
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        _moto_reset(url)
        yield url
    finally:
        _moto_reset(url)
        server.stop()
        werkzeug.setLevel(level)


def _moto_reset(url: str) -> None:
    """Forget every bucket (moto's backends are process-wide)."""
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10).close()


@contextmanager
def s3_fault_proxy(upstream: str, *, truncate: Collection[str] = (), short: Collection[str] = (),
                   corrupt: Collection[str] = (), deny: bool = False, seen: list[str] | None = None) -> Iterator[str]:
    """A forwarding proxy in front of ``upstream`` (path-style S3). A GET of an object named in ``truncate``
    (``"bucket/key"``) gets the full ``Content-Length`` but half the body, then the connection closes; one named
    in ``short`` gets half the body with a matching ``Content-Length`` and no checksum (the listing still says
    the full size); one in ``corrupt`` gets its body with the first byte flipped;
    with ``deny`` every request gets S3's 403 AccessDenied; ``seen`` gets each request's ``"METHOD path"``
    (query left out). Yields the proxy's URL."""
    target = urllib.parse.urlsplit(upstream)

    class Proxy(_Quiet):
        def _forward(self) -> None:
            if seen is not None:
                seen.append(f"{self.command} {urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)}")
            if deny:
                body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            length = int(self.headers.get("Content-Length") or 0)
            payload = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=payload, headers=headers)
                response = conn.getresponse()
                body = response.read()
            finally:
                conn.close()
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
            cut = self.command == "GET" and path in truncate
            shorten = self.command == "GET" and path in short
            if shorten:
                body = body[: len(body) // 2]
            if self.command == "GET" and path in corrupt and body:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            self.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() in ("connection", "transfer-encoding", "content-length") or (
                        shorten and name.lower().startswith("x-amz-checksum-")):  # a body without its checksum
                    continue
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            if cut:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body[: len(body) // 2] if cut else body)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    with _serving(Proxy) as url:
        yield url


# ---- the hub --------------------------------------------------------------------------------------------------


def commit_of(repo_id: str, revision: str) -> str:
    """The commit hash the hub server reports for ``repo_id`` at ``revision``."""
    return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@contextmanager
def hub_server(root: Path, *, truncate: Collection[str] = (), short: Collection[str] = (),
               token: str | None = None, seen: list[str] | None = None) -> Iterator[str]:
    """A model hub serving the repositories under ``root`` (see the module docstring); yields its URL. A GET of a
    file named in ``truncate`` (its path in the repository) sends the full ``Content-Length`` but half the
    requested bytes, then closes the connection; a file named in ``short`` is served (HEAD and GET) as its first
    half, while the listing reports its full size. With ``token``, a request without ``Authorization: Bearer
    <token>`` gets the hub's 401 (a private repository). ``seen`` gets each request's ``"METHOD path"``."""

    class Hub(_Quiet):
        def _error(self, status: int, code: str | None, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _revision(self, repo_id: str, rev: str) -> tuple[Path, str] | None:
            """The folder and commit of ``rev`` (a folder name or a commit hash), or None after answering."""
            repo = root / repo_id
            if not repo.is_dir() or (token is not None and self.headers.get("Authorization") != f"Bearer {token}"):
                status, message = (401, "Invalid username or password.") if token else (404, "Repository not found")
                self._error(status, "RepoNotFound", message)
                return None
            for folder in sorted(p for p in repo.iterdir() if p.is_dir()):
                if rev in (folder.name, commit_of(repo_id, folder.name)):
                    return folder, commit_of(repo_id, folder.name)
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None

        def _json(self, payload: object) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            if seen is not None:
                seen.append(f"GET {path}")
            if (m := _API.match(path)) is not None:
                found = self._revision(m["repo"], m["rev"] or "main")
                if found is not None:
                    folder, commit = found
                    files = sorted(p for p in folder.rglob("*") if p.is_file())
                    names = [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in files]
                    if m["kind"] == "tree":
                        self._json([{"type": "file", "path": n, "size": s, "oid": commit} for n, s in names])
                    else:
                        self._json({"id": m["repo"], "modelId": m["repo"], "sha": commit, "private": token is not None,
                                    "siblings": [{"rfilename": n, "size": s} for n, s in names]})
                return
            self._resolve(path)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            if seen is not None:
                seen.append(f"HEAD {urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)}")
            self._resolve(urllib.parse.unquote(urllib.parse.urlsplit(self.path).path))

        def _resolve(self, path: str) -> None:
            if (m := _RESOLVE.match(path)) is None:
                self._error(404, None, "Not found")
                return
            found = self._revision(m["repo"], m["rev"])
            if found is None:
                return
            folder, commit = found
            file = folder / m["path"]
            if ".." in Path(m["path"]).parts or not file.is_file():
                self._error(404, "EntryNotFound", "Entry not found")
                return
            data = file.read_bytes()
            if m["path"] in short:
                data = data[: len(data) // 2]
            start, end, status = 0, len(data), 200
            if (r := _RANGE.match(self.headers.get("Range", ""))) is not None:
                start, end, status = int(r[1]), min(int(r[2]) + 1 if r[2] else len(data), len(data)), 206
            cut = self.command == "GET" and m["path"] in truncate
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            if cut:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data[start : start + (end - start) // 2] if cut else data[start:end])

    with _serving(Hub) as url:
        yield url
