"""The Docker Engine client against a fake Engine on a unix socket in tmp_path.

The fake's answers follow the Engine API reference (v1.41): container list and inspect
documents, 204 for start/stop, 304 when already in that state, 404 with a message.
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from cardshare.docker_api import (
    ContainerState,
    DockerClient,
    DockerError,
    LogWindow,
    demux_logs,
    logs_since,
)

INSPECT: dict[str, Any] = {
    "Id": "abc123",
    "Name": "/vllm-vllm-1",
    "State": {
        "Status": "exited",
        "Running": False,
        "OOMKilled": True,
        "ExitCode": 137,
        "Error": "",
        "StartedAt": "2026-12-01T10:00:00.000000001Z",
        "Health": {"Status": "unhealthy"},
    },
}


def frame(stream: int, data: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


# A container with two starts' output in its log, as Docker keeps it across restarts: the
# first start's (before INSPECT's StartedAt) ended in a VRAM failure; the second's is 3000
# lines of 100 bytes, then its own error. (nanoseconds since the epoch, stream, line)
SECOND_START = 1796119200_000000001  # INSPECT's StartedAt
LONG_LOG = [
    (
        SECOND_START - 5_000_000_000,
        2,
        b"ValueError: ... larger than the available KV cache memory\n",
    ),
    *((SECOND_START + n, 1, b"%05d " % n + b"x" * 93 + b"\n") for n in range(3000)),
    (SECOND_START + 3000, 2, b"ModuleNotFoundError: No module named 'nope'\n"),
]


class Engine(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, str]]] = []
    running: ClassVar[dict[str, bool]] = {"abc123": False}

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        self.requests.append(("GET", self.path))
        if url.path == "/v1.41/containers/json":
            filters = json.loads(parse_qs(url.query)["filters"][0])
            labels = filters["label"]
            if "com.docker.compose.project=vllm" in labels:
                self._send(
                    200,
                    [
                        {
                            "Id": "abc123",
                            "Names": ["/vllm-vllm-1"],
                            "State": "exited",
                            "Labels": {"com.docker.compose.project": "vllm"},
                        }
                    ],
                )
            else:
                self._send(200, [])
        elif url.path == "/v1.41/containers/abc123/json":
            self._send(200, INSPECT)
        elif url.path == "/v1.41/containers/garbage/json":
            self._send(200, raw=b"<html>502 Bad Gateway</html>")
        elif url.path == "/v1.41/containers/nothttp/json":
            self.wfile.write(b"\x00\x01 not HTTP at all\r\n\r\n")
            self.close_connection = True
        elif url.path == "/v1.41/containers/abc123/logs":
            line = b"ValueError: Free memory on device\n"
            self._send(200, raw=b"\x02\x00\x00\x00" + len(line).to_bytes(4, "big") + line)
        elif url.path == "/v1.41/containers/long/logs":
            self._long_logs(parse_qs(url.query))
        else:
            self._send(404, {"message": "No such container: nope"})

    def _long_logs(self, query: dict[str, list[str]]) -> None:
        """Docker's semantics: the last ``tail`` entries, those before ``since`` left out;
        one frame an entry, sent chunked (no Content-Length), in pieces that split frames."""
        entries = LONG_LOG[-int(query["tail"][0]) :] if "tail" in query else LONG_LOG
        if "since" in query:
            sec, nsec = query["since"][0].split(".")
            since = int(sec) * 10**9 + int(nsec.ljust(9, "0"))
            entries = [e for e in entries if e[0] >= since]
        body = b"".join(frame(stream, line) for _, stream, line in entries)
        self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for at in range(0, len(body), 1000):
            piece = body[at : at + 1000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def do_POST(self) -> None:
        self.requests.append(("POST", self.path))
        url = urlparse(self.path)
        if url.path == "/v1.41/containers/abc123/start":
            was = self.running["abc123"]
            self.running["abc123"] = True
            self._send(304 if was else 204)
        elif url.path == "/v1.41/containers/abc123/stop":
            was = self.running["abc123"]
            self.running["abc123"] = False
            self._send(204 if was else 304)
        elif url.path == "/v1.41/containers/abc123/restart":
            self.running["abc123"] = True  # restarted whether it ran or not
            self._send(204)
        else:
            self._send(500, {"message": "server error"})


@pytest.fixture
def docker(tmp_path: Path) -> Iterator[DockerClient]:
    sock = str(tmp_path / "docker.sock")
    Engine.requests = []
    Engine.running = {"abc123": False}
    server = socketserver.UnixStreamServer(sock, Engine)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield DockerClient(sock, timeout=5)
    server.shutdown()
    server.server_close()


def test_find_and_inspect(docker: DockerClient) -> None:
    found = docker.find_compose_container("vllm", "vllm")
    assert (found.id, found.names, found.state) == ("abc123", ("vllm-vllm-1",), "exited")
    assert docker.inspect("abc123") == ContainerState(
        id="abc123",
        name="vllm-vllm-1",
        running=False,
        status="exited",
        oom_killed=True,
        exit_code=137,
        health="unhealthy",
        error="",
        started_at="2026-12-01T10:00:00.000000001Z",
    )


def test_start_stop_report_whether_anything_changed(docker: DockerClient) -> None:
    assert [docker.start("abc123"), docker.start("abc123")] == [True, False]
    assert [docker.stop("abc123", 7), docker.stop("abc123", 7)] == [True, False]
    assert ("POST", "/v1.41/containers/abc123/stop?t=7") in Engine.requests


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda d: d.inspect("nope"),
            "Docker Engine GET /containers/nope/json answered 404: No such container: nope",
        ),
        (
            lambda d: d.start("other"),
            "Docker Engine POST /containers/other/start answered 500: server error",
        ),
        (
            lambda d: d.find_compose_container("comfyui", "comfyui"),
            "no container with labels com.docker.compose.project=comfyui and "
            "com.docker.compose.service=comfyui: create the compose project first",
        ),
    ],
)
def test_errors_name_the_call(docker: DockerClient, call: Any, message: str) -> None:
    with pytest.raises(DockerError) as info:
        call(docker)
    assert str(info.value) == message


def test_restart_restarts_whatever_the_state(docker: DockerClient) -> None:
    docker.start("abc123")
    docker.restart("abc123", 9)
    assert ("POST", "/v1.41/containers/abc123/restart?t=9") in Engine.requests
    with pytest.raises(DockerError, match=r"^Docker Engine POST /containers/nope/restart answered"):
        docker.restart("nope", 1)


@pytest.mark.parametrize(
    ("container", "message"),
    [
        ("garbage", "Docker Engine GET /containers/garbage/json answered no JSON: b'<html>502"),
        ("nothttp", "Docker Engine at "),
    ],
)
def test_garbage_answers_are_docker_errors(
    docker: DockerClient, container: str, message: str
) -> None:
    """Not a ValueError that would escape the engine's Docker handling."""
    with pytest.raises(DockerError) as info:
        docker.inspect(container)
    assert str(info.value).startswith(message)


def test_logs_are_demultiplexed(docker: DockerClient) -> None:
    assert docker.logs_tail("abc123") == "ValueError: Free memory on device\n"


def test_logs_window_is_the_last_bytes_of_the_last_start(docker: DockerClient) -> None:
    text = docker.logs_window("long", 64 * 1024, since="2026-12-01T10:00:00.000000001Z")
    # the tail Docker counts in lines is asked for generously, the start by its StartedAt
    assert Engine.requests[-1] == (
        "GET",
        "/v1.41/containers/long/logs?stdout=1&stderr=1&tail=4096&since=1796119200.000000001",
    )
    lines = text.splitlines()
    assert lines[-1] == "ModuleNotFoundError: No module named 'nope'"
    # whole lines, within the window: 64 KiB of 100-byte lines
    assert len(text.encode()) <= 64 * 1024
    assert len(lines) == (64 * 1024 - 44) // 100 + 1
    assert all(len(line) == 99 for line in lines[:-1])
    # the earlier start's failure is not this start's
    assert "KV cache" not in docker.logs_window(
        "long", 10**6, since=docker.inspect("abc123").started_at
    )
    assert "KV cache" in docker.logs_window("long", 10**6)


def test_logs_window_of_a_missing_container(docker: DockerClient) -> None:
    with pytest.raises(DockerError) as info:
        docker.logs_window("nope", 1024)
    assert str(info.value) == (
        "Docker Engine GET /containers/nope/logs answered 404: No such container: nope"
    )


@pytest.mark.parametrize(
    ("started_at", "since"),
    [
        ("2026-12-01T10:00:00.000000001Z", "1796119200.000000001"),
        ("2026-12-01T10:00:00.5Z", "1796119200.500000000"),
        ("2026-12-01T10:00:00Z", "1796119200.000000000"),
        ("2026-12-01T11:00:00.25+01:00", "1796119200.250000000"),
        ("0001-01-01T00:00:00Z", None),  # never started
        ("", None),
        ("yesterday", None),
    ],
)
def test_logs_since(started_at: str, since: str | None) -> None:
    assert logs_since(started_at) == since


def _frames(lines: list[bytes]) -> bytes:
    return b"".join(frame(1 + n % 2, line) for n, line in enumerate(lines))


@pytest.mark.parametrize("piece", [1, 3, 8, 9, 1000])
def test_log_window_reads_frames_split_anywhere(piece: int) -> None:
    raw = _frames([b"first\n", b"", b"second line\n", b"\xc3\xa9t\xc3\xa9\n"])
    window = LogWindow(1024)
    for at in range(0, len(raw), piece):
        window.feed(raw[at : at + piece])
    assert window.text() == demux_logs(raw) == "first\nsecond line\n\u00e9t\u00e9\n"


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"plain tty output\n", "plain tty output\n"),
        (b"tty\n", "tty\n"),  # shorter than a frame header
        (b"", ""),
        # frames, then something that is not one: the rest is kept as it came
        (frame(1, b"ok\n") + b"not a frame\n", "ok\nnot a frame\n"),
    ],
)
def test_log_window_raw_text(raw: bytes, text: str) -> None:
    window = LogWindow(1024)
    window.feed(raw)
    assert window.text() == text


def test_log_window_holds_at_most_twice_its_size() -> None:
    window = LogWindow(1000)
    held = 0
    for n in range(20_000):  # 2 MB of 100-byte lines
        window.feed(frame(1, b"%05d " % n + b"y" * 93 + b"\n"))
        held = max(held, window.held)
    assert held <= 2000
    text = window.text()
    assert text.startswith("19991 ") and text.endswith("19999 " + "y" * 93 + "\n")
    assert len(text) == 900


def test_log_window_of_one_long_line_keeps_its_end() -> None:
    window = LogWindow(10)
    window.feed(frame(1, b"a" * 100 + b"\n"))
    assert window.text() == "a" * 9 + "\n"


def test_log_window_size_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^max_bytes must be 1 or more, got 0$"):
        LogWindow(0)


def test_no_engine_is_a_clear_error(tmp_path: Path) -> None:
    client = DockerClient(str(tmp_path / "missing.sock"), timeout=1)
    with pytest.raises(DockerError, match=r"^Docker Engine at .*missing\.sock did not answer GET"):
        client.inspect("abc123")


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        (b"\x01\x00\x00\x00\x00\x00\x00\x03abc\x02\x00\x00\x00\x00\x00\x00\x02de", "abcde"),
        (b"plain tty output\n", "plain tty output\n"),
        (b"", ""),
    ],
)
def test_demux_logs(raw: bytes, text: str) -> None:
    assert demux_logs(raw) == text
