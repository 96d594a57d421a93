"""Helpers shared by the stand-in tests (HTTP client, tiny fdinfo parser)."""

from __future__ import annotations

import http.client
import json
from typing import Any

PDEV = "0000:03:00.0"
VRAM_TOTAL = 32 * 1024**3


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to a stand-in on localhost: ``(status, headers, body)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    sent = dict(headers or {})
    if body is not None and raw is None:
        sent.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=data, headers=sent)
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, payload


def parse_fdinfo(text: str) -> dict[str, str]:
    """A tiny fdinfo parser for the tests: ``key:<tab>value`` lines."""
    pairs = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        assert sep, f"line without a colon: {line!r}"
        pairs[key] = value.strip()
    return pairs


def wait_for(predicate: Any, what: str, limit: float = 10.0) -> Any:
    """Poll ``predicate`` until it returns a truthy value (a bound, not a timing assertion)."""
    import time

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """Check a PNG's signature and every chunk's CRC; return width, height and raw rows."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    kinds = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert (depth, color) == (8, 2)
    rows = zlib.decompress(idat)
    assert len(rows) == height * (1 + 3 * width)
    return width, height, rows
