"""Raw sockets against a server on 127.0.0.1: the slow clients of the read-timeout tests
(the proxy's and the server guard's)."""

from __future__ import annotations

import asyncio


async def send_raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client connection that has sent ``data`` (part of a request, say)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def until_closed(reader: asyncio.StreamReader, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (loop time)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    data = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.0, end - loop.time()))
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit} s; got {data!r}") from None
    return data, loop.time()
