"""The HTTP listeners' sockets: connections accepted from them by the event loop (as uvicorn serves them) send each
write at once. With Nagle's algorithm on, a response's body waited for the client's delayed ACK of its head
(~40 ms a request on a kept-alive connection)."""

from __future__ import annotations

import asyncio
import socket

from serving.listeners import bind


def test_connections_accepted_from_a_listener_have_nagle_off() -> None:
    async def main() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=sock)  # uvicorn's loop.create_server(sock=...)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            nodelay = await asyncio.wait_for(seen, 30)
            writer.close()
        return nodelay

    assert asyncio.run(main()) == 1
