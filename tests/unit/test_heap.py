"""``serving.heap``: glibc's malloc_trim gives a fragmented heap's free pages back (the frontend runs it
periodically: the soak's RSS drift)."""

from __future__ import annotations

import asyncio
import inspect
import queue
import subprocess
import sys
import textwrap
from typing import Any

from rollcore.types import GenerationRequest
from serving.heap import IdleTrim, malloc_trim, trim_periodically
from serving.ipc.messages import Batch, BatchResult, Message, Shutdown
from serving.worker.main import serve_dynamic


def fragment_and_trim(trim: Any) -> int:
    """Fragment the C heap, call ``trim(0)``; returns the KiB of RSS it gave back. Self-contained: a child
    process runs its source too."""
    import ctypes
    from pathlib import Path

    def rss_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 96 MiB of 8 KiB blocks (below the mmap threshold: they live in the heap), then free all but one in 64:
    # the kept blocks pin the heap's top, so free() alone cannot give the pages back
    blocks = [libc.malloc(8192) for _ in range(12288)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, 8192)  # touch: resident
    kept = blocks[::64]
    for i, b in enumerate(blocks):
        if i % 64:
            libc.free(b)
    before = rss_kib()
    trim(0)
    after = rss_kib()
    for b in kept:
        libc.free(b)
    return before - after


def test_malloc_trim_returns_the_free_pages_of_a_fragmented_heap() -> None:
    trim = malloc_trim()
    assert trim is not None  # glibc: the machines this server runs on
    assert fragment_and_trim(trim) > 64 * 1024  # most of the 94.5 MiB freed went back


def test_idle_trim_gives_back_a_workers_kept_heap() -> None:
    """In a worker's configuration (``keep_freed_memory``: glibc never trims on free), ``IdleTrim`` still gives
    the freed pages back. Run in a child: the malloc settings are process-wide."""
    code = inspect.getsource(fragment_and_trim) + textwrap.dedent("""
        from handlers.engine.planning.cpu import keep_freed_memory
        from serving.heap import IdleTrim

        assert keep_freed_memory()
        idle = IdleTrim(every_s=0.0)
        print(fragment_and_trim(lambda pad: idle()))
    """)
    out = subprocess.run([sys.executable, "-c", "from typing import Any\n" + code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 64 * 1024, out.stdout


def test_idle_trim_runs_at_most_once_per_period() -> None:
    now = [100.0]
    calls: list[int] = []
    idle = IdleTrim(every_s=30.0, trim=lambda pad: calls.append(pad) or 1, clock=lambda: now[0])
    assert not idle()  # the period counts from the start
    now[0] += 29.9
    assert not idle()
    now[0] += 0.2
    assert idle() and calls == [0]
    assert not idle()
    now[0] += 30.0
    assert idle() and calls == [0, 0]


class _Conn:
    def __init__(self, msgs: list[Message | None]) -> None:
        self.inbox: queue.Queue[Message | None] = queue.Queue()
        for m in msgs:
            self.inbox.put(m)
        self.sent: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)


class _Echo:
    def handle(self, inputs: list[Any]) -> list[Any]:
        from handlers.base import Output

        return [Output(request_id=i.request_id, text=i.prompt) for i in inputs]


def _batch(batch_id: int) -> Batch:
    return Batch(batch_id=batch_id, requests=[GenerationRequest(request_id=f"r{batch_id}", model="m", prompt="hi")])


def test_the_dynamic_worker_trims_only_when_no_batch_waits() -> None:
    """Two batches queued back to back, then one alone: the idle hook runs after the second and the third
    (each time the inbox is empty), never between the first two."""
    events: list[str] = []
    conn = _Conn([_batch(1), _batch(2)])


    def idle() -> None:
        events.append(f"idle after {len(conn.sent)}")
        if len(conn.sent) == 2:
            conn.inbox.put(_batch(3))
        else:
            conn.inbox.put(Shutdown())

    serve_dynamic(conn, _Echo(), idle=idle)  # type: ignore[arg-type]
    assert [m.batch_id for m in conn.sent if isinstance(m, BatchResult)] == [1, 2, 3]
    assert events == ["idle after 2", "idle after 3"]


def test_trim_periodically_runs_until_cancelled() -> None:
    async def main() -> bool:
        task = asyncio.create_task(trim_periodically(0.01))
        await asyncio.sleep(0.05)
        running = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return running and task.cancelled()

    assert asyncio.run(main())
