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

from cardshare.docker_api import ContainerState, DockerClient, DockerError, demux_logs

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
        else:
            self._send(404, {"message": "No such container: nope"})

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
