"""A minimal Docker Engine API client over the unix socket (standard library only).

Only what the arbiter needs: list containers by label, inspect, start, stop with a
timeout, and the end of a container's logs (a tail in lines, or the last bytes of one start's
output, read as a stream in bounded memory). Blocking calls: async callers run them in a
thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

API_VERSION = "v1.41"  # Docker 20.10 and newer accept it
_CHUNK = 64 * 1024  # a streamed answer is read this much at a time
COMPOSE_PROJECT_LABEL = "com.docker.compose.project"
COMPOSE_SERVICE_LABEL = "com.docker.compose.service"


class DockerError(Exception):
    """An Engine API call failed; ``status`` is the HTTP status (0 when none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ContainerSummary:
    id: str
    names: tuple[str, ...]
    state: str
    labels: dict[str, str]


@dataclass(frozen=True)
class ContainerState:
    """The parts of ``GET /containers/<id>/json`` the arbiter reads."""

    id: str
    name: str
    running: bool
    status: str
    oom_killed: bool
    exit_code: int
    health: str  # none | starting | healthy | unhealthy
    error: str
    started_at: str = ""  # State.StartedAt: a restart is proven by a new value
    finished_at: str = ""  # State.FinishedAt: when it last exited (year 1 when it never did)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def parse_container_state(data: dict[str, Any]) -> ContainerState:
    """Pure: the inspect document to a :class:`ContainerState`."""
    state = data.get("State") or {}
    health = state.get("Health") or {}
    return ContainerState(
        id=str(data.get("Id", "")),
        name=str(data.get("Name", "")).lstrip("/"),
        running=bool(state.get("Running", False)),
        status=str(state.get("Status", "")),
        oom_killed=bool(state.get("OOMKilled", False)),
        exit_code=int(state.get("ExitCode", 0) or 0),
        health=str(health.get("Status", "none")) if health else "none",
        error=str(state.get("Error", "") or ""),
        started_at=str(state.get("StartedAt", "") or ""),
        finished_at=str(state.get("FinishedAt", "") or ""),
    )


def docker_time(value: str) -> float | None:
    """Pure: an inspect time (RFC 3339, nanoseconds, ``Z``) as epoch seconds; None for an empty
    value, one that does not parse, or Docker's "never" (``0001-01-01T00:00:00Z``)."""
    if not value or value.startswith("0001-"):
        return None
    try:
        # fromisoformat keeps microseconds of the nine digits Docker writes
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def demux_logs(raw: bytes) -> str:
    """Decode the Engine's multiplexed log stream (8-byte frame headers) to text.

    A container started with a TTY sends raw text instead: returned as is.
    """
    out: list[bytes] = []
    pos = 0
    while pos + 8 <= len(raw):
        kind = raw[pos]
        if kind not in (0, 1, 2) or raw[pos + 1 : pos + 4] != b"\x00\x00\x00":
            return raw.decode("utf-8", "replace")
        size = int.from_bytes(raw[pos + 4 : pos + 8], "big")
        out.append(raw[pos + 8 : pos + 8 + size])
        pos += 8 + size
    if pos != len(raw):
        return raw.decode("utf-8", "replace")
    return b"".join(out).decode("utf-8", "replace")


_START_RE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


def logs_since(started_at: str) -> str | None:
    """Pure: an inspect ``StartedAt`` as the logs API's ``since`` (``seconds.nanoseconds``,
    exact), or None for an empty value, one that does not parse, or Docker's "never"."""
    found = _START_RE.fullmatch(started_at)
    if found is None or started_at.startswith("0001-"):
        return None
    zone = "+00:00" if found[3] == "Z" else found[3]
    whole = datetime.fromisoformat(found[1] + zone)
    return f"{int(whole.timestamp())}.{(found[2] or '').ljust(9, '0')}"


class LogWindow:
    """The last ``max_bytes`` of a container's output, fed the Engine's log stream in chunks as
    they arrive: multiplexed frames (8-byte headers) or a TTY container's raw text (told apart
    by the first header, as :func:`demux_logs` does). It holds at most twice ``max_bytes``
    whatever the stream's length. :meth:`text` starts at a line's start when the front was
    cut (a partial first line is dropped)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be 1 or more, got {max_bytes}")
        self.max_bytes = max_bytes
        self._kept = bytearray()
        self._header = bytearray()  # a frame header not yet whole
        self._left = 0  # payload bytes of the current frame still to come
        self._raw: bool | None = None  # undecided until the first header
        self._cut = False

    def _keep(self, data: bytes | bytearray | memoryview) -> None:
        self._kept += data
        if len(self._kept) > 2 * self.max_bytes:
            del self._kept[: len(self._kept) - self.max_bytes]
            self._cut = True

    @property
    def held(self) -> int:
        """Bytes held now (at most twice ``max_bytes``)."""
        return len(self._kept) + len(self._header)

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        pos = 0
        while pos < len(view):
            if self._raw:
                self._keep(view[pos:])
                return
            if self._left:
                take = min(self._left, len(view) - pos)
                self._keep(view[pos : pos + take])
                pos += take
                self._left -= take
                continue
            need = 8 - len(self._header)
            self._header += view[pos : pos + need]
            pos += need
            if len(self._header) < 8:
                return
            header = bytes(self._header)
            self._header.clear()
            if header[0] not in (0, 1, 2) or header[1:4] != b"\x00\x00\x00":
                # not a frame: a TTY's raw text (or, mid-stream, no longer frames): kept as is
                self._raw = True
                self._keep(header)
                continue
            self._raw = False
            self._left = int.from_bytes(header[4:8], "big")

    def text(self) -> str:
        """What was kept, decoded (UTF-8, undecodable bytes replaced)."""
        if self._raw is None and self._header:  # raw text shorter than a frame header
            self._keep(self._header)
            self._header.clear()
        data = bytes(self._kept[-self.max_bytes :])
        if self._cut or len(self._kept) > self.max_bytes:
            newline = data.find(b"\n")
            if 0 <= newline < len(data) - 1:
                data = data[newline + 1 :]
        return data.decode("utf-8", "replace")


class DockerClient:
    def __init__(self, socket_path: str = "/var/run/docker.sock", timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def _request(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        timeout: float = 0.0,
        sink: Callable[[bytes], None] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body); with ``sink``, a 200 answer's body goes to it in chunks instead (the
        body returned is empty) and an error's body is read up to 64 KiB."""
        url = f"/{API_VERSION}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        conn = _UnixHTTPConnection(self.socket_path, timeout or self.timeout)
        try:
            conn.request(method, url, headers={"Host": "docker"})
            resp = conn.getresponse()
            if sink is None:
                return resp.status, resp.read()
            if resp.status != 200:
                return resp.status, resp.read(_CHUNK)
            while chunk := resp.read(_CHUNK):
                sink(chunk)
            return resp.status, b""
        except (OSError, http.client.HTTPException) as exc:
            # refused, reset, timed out (a hang), or an answer that is not HTTP (garbage)
            raise DockerError(
                f"Docker Engine at {self.socket_path} did not answer {method} {path}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            conn.close()

    @staticmethod
    def _fail(method: str, path: str, status: int, body: bytes) -> DockerError:
        try:
            message = str(json.loads(body).get("message", ""))
        except (ValueError, AttributeError):
            message = body.decode("utf-8", "replace")[:200]
        return DockerError(f"Docker Engine {method} {path} answered {status}: {message}", status)

    def list_containers(self, labels: dict[str, str]) -> list[ContainerSummary]:
        """All containers (running or not) carrying every label ``key=value``."""
        filters = json.dumps({"label": [f"{k}={v}" for k, v in sorted(labels.items())]})
        path = "/containers/json"
        status, body = self._request("GET", path, {"all": "1", "filters": filters})
        if status != 200:
            raise self._fail("GET", path, status, body)
        return [
            ContainerSummary(
                id=str(item.get("Id", "")),
                names=tuple(str(n).lstrip("/") for n in item.get("Names") or ()),
                state=str(item.get("State", "")),
                labels={str(k): str(v) for k, v in (item.get("Labels") or {}).items()},
            )
            for item in _json_list(body, f"GET {path}")
        ]

    def find_compose_container(self, project: str, service: str) -> ContainerSummary:
        found = self.list_containers(
            {COMPOSE_PROJECT_LABEL: project, COMPOSE_SERVICE_LABEL: service}
        )
        if not found:
            raise DockerError(
                f"no container with labels {COMPOSE_PROJECT_LABEL}={project} and "
                f"{COMPOSE_SERVICE_LABEL}={service}: create the compose project first"
            )
        return found[0]

    def _inspect(self, container_id: str, missing_ok: bool) -> dict[str, Any] | None:
        path = f"/containers/{container_id}/json"
        status, body = self._request("GET", path)
        if status == 404 and missing_ok:
            return None
        if status != 200:
            raise self._fail("GET", path, status, body)
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise DockerError(f"Docker Engine GET {path} answered no JSON: {body[:100]!r}") from exc
        if not isinstance(doc, dict):
            raise DockerError(f"Docker Engine GET {path} answered a {type(doc).__name__}")
        return doc

    def inspect_document(self, container_id: str) -> dict[str, Any] | None:
        """The engine's whole inspect document, or None when no such container exists."""
        return self._inspect(container_id, missing_ok=True)

    def inspect(self, container_id: str) -> ContainerState:
        doc = self._inspect(container_id, missing_ok=False)
        assert doc is not None  # missing_ok=False raises instead
        return parse_container_state(doc)

    def start(self, container_id: str) -> bool:
        """Start; True when it was started, False when it was already running (304)."""
        path = f"/containers/{container_id}/start"
        status, body = self._request("POST", path)
        if status == 204:
            return True
        if status == 304:
            return False
        raise self._fail("POST", path, status, body)

    def stop(self, container_id: str, timeout_seconds: int) -> bool:
        """Stop (SIGTERM, then SIGKILL after the timeout); False when already stopped."""
        path = f"/containers/{container_id}/stop"
        status, body = self._request(
            "POST", path, {"t": str(timeout_seconds)}, timeout=self.timeout + timeout_seconds
        )
        if status == 204:
            return True
        if status == 304:
            return False
        raise self._fail("POST", path, status, body)

    def restart(self, container_id: str, timeout_seconds: int) -> None:
        """Stop (SIGTERM, SIGKILL after the timeout) and start again, running or not."""
        path = f"/containers/{container_id}/restart"
        status, body = self._request(
            "POST", path, {"t": str(timeout_seconds)}, timeout=self.timeout + timeout_seconds
        )
        if status != 204:
            raise self._fail("POST", path, status, body)

    def logs_tail(self, container_id: str, lines: int = 50) -> str:
        path = f"/containers/{container_id}/logs"
        status, body = self._request(
            "GET", path, {"stdout": "1", "stderr": "1", "tail": str(lines)}
        )
        if status != 200:
            raise self._fail("GET", path, status, body)
        return demux_logs(body)

    def logs_window(self, container_id: str, max_bytes: int, since: str = "") -> str:
        """The last ``max_bytes`` of the container's output (stdout and stderr as written),
        from whole lines, of its start at ``since`` (an inspect ``StartedAt``; the output of
        earlier starts, a restart policy's, is left out) or of all starts when ``since`` is
        empty or "never".

        Docker's ``tail`` counts lines only: ``max_bytes // 16`` lines are asked for (the
        window in bytes, unless lines average under 16 bytes) and the answer is read as a
        stream through a :class:`LogWindow`, so a log of long lines costs reading, never
        memory.
        """
        path = f"/containers/{container_id}/logs"
        query = {"stdout": "1", "stderr": "1", "tail": str(max(1, max_bytes // 16))}
        start = logs_since(since)
        if start is not None:
            query["since"] = start
        window = LogWindow(max_bytes)
        status, body = self._request("GET", path, query, sink=window.feed)
        if status != 200:
            raise self._fail("GET", path, status, body)
        return window.text()


def _json_list(body: bytes, what: str) -> list[dict[str, Any]]:
    """A JSON list of objects, or a DockerError naming the call (never a bare ValueError)."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise DockerError(f"Docker Engine {what} answered no JSON: {body[:100]!r}") from exc
    if not isinstance(doc, list) or not all(isinstance(item, dict) for item in doc):
        raise DockerError(f"Docker Engine {what} answered no list of objects: {body[:100]!r}")
    return doc
