"""SIMULATION: small HTTP helpers shared by the lab's stand-in servers (stdlib only).

The stand-ins speak HTTP/1.1 with keep-alive; JSON bodies carry a ``Content-Length``,
streams (Server-Sent Events) use chunked transfer encoding and are flushed per event.
"""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["BadChunkedBody", "Handler", "StandinServer", "read_chunked", "serve_in_thread"]


class BadChunkedBody(Exception):
    """A ``Transfer-Encoding: chunked`` request body that does not parse."""


def read_chunked(stream: io.BufferedIOBase, limit: int = 256 * 1024**2) -> bytes:
    """Read a chunked request body (RFC 9112 7.1); chunk extensions and trailers are dropped."""
    body = bytearray()
    while True:
        line = stream.readline(1024)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise BadChunkedBody(f"bad chunk size line {line[:40]!r}") from None
        if size < 0 or not line.endswith(b"\n"):
            raise BadChunkedBody(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            break
        if len(body) + size > limit:
            raise BadChunkedBody("request body too large")
        chunk = stream.read(size)
        if len(chunk) != size or stream.readline(3) not in (b"\r\n", b"\n"):
            raise BadChunkedBody("chunk cut short")
        body += chunk
    while stream.readline(8192) not in (b"\r\n", b"\n", b""):
        pass  # trailer fields
    return bytes(body)


class StandinServer(ThreadingHTTPServer):
    """A threading HTTP server whose worker threads do not block interpreter exit."""

    daemon_threads = True
    allow_reuse_address = True


class Handler(BaseHTTPRequestHandler):
    """Base handler: JSON in and out, chunked streams, quiet logs."""

    protocol_version = "HTTP/1.1"
    server_version = "cardshare-standin/0.1 (SIMULATION)"
    quiet = True

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    @property
    def path_only(self) -> str:
        return urlsplit(self.path).path

    @property
    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlsplit(self.path).query).items()}

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def read_json(self) -> Any:
        body = self.read_body()
        return json.loads(body) if body else {}

    def send_bytes(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, status: int, payload: Any) -> None:
        self.send_bytes(status, json.dumps(payload).encode())

    def start_stream(self, content_type: str = "text/event-stream; charset=utf-8") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def send_chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def send_event(self, payload: Any) -> None:
        """One SSE event ``data: <json>\\n\\n`` (or a literal string such as ``[DONE]``)."""
        text = payload if isinstance(payload, str) else json.dumps(payload)
        self.send_chunk(f"data: {text}\n\n".encode())


def serve_in_thread(server: ThreadingHTTPServer, poll_interval: float = 0.05) -> threading.Thread:
    """Run ``serve_forever`` in a daemon thread and return it (``shutdown`` waits one poll)."""
    thread = threading.Thread(
        target=server.serve_forever, args=(poll_interval,), name="http", daemon=True
    )
    thread.start()
    return thread
