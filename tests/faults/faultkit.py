"""Fault injection shared by the fake servers of ``tests/faults`` and the tests driving them.

Each fake service (``docker``, ``vllm``, ``comfyui``, ``card``) reads its rules from
``<faults_dir>/<service>.json`` at every request, under an ``flock``: a test arms or clears a
fault at any moment, and a fault outlives a restart of the fake process (a ComfyUI
"container" restarted by the arbiter keeps its rules). Standard library only, so that the
fake processes start fast.

A rule: ``{"id", "route", "kind", "remaining", "when", ...}``

* ``route``: the fake's name for a call (``"GET /queue"``, ``"POST /prompt"``, ``"stop"``),
  optionally qualified (``"stop:vllm"``: only the vllm container's), or ``"*"``;
* ``kind``: ``exception`` (connection reset, no answer), ``close`` (closed without an
  answer), ``garbage`` (bytes that are not HTTP), ``badjson`` (HTTP 200 whose body is not
  JSON), ``hang`` (no answer for ``seconds``, then the connection is closed), ``status``
  (an error answer with ``status``; ``badjson`` answers ``body``, then ``repeat`` ``times``
  times and ``suffix`` when given: a large answer from a small rule), ``delay``
  (``min``..``max`` seconds of latency, then the normal answer), or a service's own kinds
  (ComfyUI's ``execute`` route: ``crash_before_save``, ``crash_after_save``, ``exec_error``,
  ``exec_hang``; the card's ``current.json``: ``garbage``, ``missing``, ``stale``,
  ``foreign``, ``badshape``);
* ``remaining``: how many more calls it hits (``None``: until cleared);
* ``when``: ``before`` (the call is not performed) or ``after`` (performed, answer lost).

Every hit is counted in the file's ``hits`` (by rule id), so a test can prove its fault
really fired.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import ThreadingMixIn, UnixStreamServer
from typing import Any
from urllib.parse import SplitResult, urlsplit

Rule = dict[str, Any]

GENERIC_KINDS = ("exception", "close", "garbage", "badjson", "hang", "status", "delay")
GARBAGE = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03 not HTTP at all \xff\xfe\r\n\r\n"


class FaultFile:
    """The rules of one fake service, in a JSON file shared by processes."""

    def __init__(self, directory: Path, service: str) -> None:
        self.path = Path(directory) / f"{service}.json"
        self.lock_path = Path(directory) / f".{service}.lock"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.lock_path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return {"rules": [], "hits": {}}
        doc.setdefault("rules", [])
        doc.setdefault("hits", {})
        return doc

    def _write(self, doc: dict[str, Any]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, self.path)

    # -- the tests' side -------------------------------------------------------------------

    def add(self, route: str, kind: str, remaining: int | None = 1, **extra: Any) -> str:
        rule: Rule = {
            "id": uuid.uuid4().hex[:8],
            "route": route,
            "kind": kind,
            "remaining": remaining,
            "when": "before",
            **extra,
        }
        with self._locked():
            doc = self._read()
            doc["rules"].append(rule)
            self._write(doc)
        return str(rule["id"])

    def clear(self, rule_id: str | None = None) -> None:
        with self._locked():
            doc = self._read()
            doc["rules"] = [r for r in doc["rules"] if rule_id is not None and r["id"] != rule_id]
            self._write(doc)

    def hits(self, rule_id: str | None = None) -> int:
        doc = self._read()
        if rule_id is None:
            return sum(int(n) for n in doc["hits"].values())
        return int(doc["hits"].get(rule_id, 0))

    def active(self) -> list[Rule]:
        return list(self._read()["rules"])

    # -- the fakes' side -------------------------------------------------------------------

    def take(self, route: str, qualifier: str | None = None) -> tuple[Rule | None, Rule | None]:
        """The fault rule and the latency rule that apply to one call (each may be None);
        counts the hit and consumes one of ``remaining``."""
        try:
            if self.path.stat().st_size <= len('{"rules": [], "hits": {}}'):
                return None, None
        except FileNotFoundError:
            return None, None
        names = {route, "*"} | ({f"{route}:{qualifier}"} if qualifier else set())
        with self._locked():
            doc = self._read()
            fault = next(
                (r for r in doc["rules"] if r["route"] in names and r["kind"] != "delay"), None
            )
            delay = next(
                (r for r in doc["rules"] if r["route"] in names and r["kind"] == "delay"), None
            )
            if fault is None and delay is None:
                return None, None
            for rule in (fault, delay):
                if rule is None:
                    continue
                doc["hits"][rule["id"]] = int(doc["hits"].get(rule["id"], 0)) + 1
                if rule["kind"] != "delay":
                    doc.setdefault("first_hit", {}).setdefault(rule["id"], time.time())
                if rule.get("remaining") is not None:
                    rule["remaining"] = int(rule["remaining"]) - 1
                    if rule["remaining"] <= 0:
                        doc["rules"] = [r for r in doc["rules"] if r["id"] != rule["id"]]
            self._write(doc)
        return fault, delay


class Settings:
    """Tunables of the fakes in one JSON file, re-read when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._mtime = -1.0
        self._doc: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            try:
                mtime = self.path.stat().st_mtime_ns
            except FileNotFoundError:
                return default
            if mtime != self._mtime:
                try:
                    self._doc = json.loads(self.path.read_text(encoding="utf-8"))
                    self._mtime = mtime
                except ValueError:
                    pass
            return self._doc.get(key, default)

    def seconds(self, key: str, default: float = 0.0) -> float:
        """A number, or a uniform draw from a ``[min, max]`` pair."""
        value = self.get(key, default)
        if isinstance(value, list | tuple):
            return random.uniform(float(value[0]), float(value[1]))
        return float(value)

    @staticmethod
    def update(path: Path, **values: Any) -> None:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            doc = {}
        doc.update(values)
        tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)


# -- HTTP -----------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, doc: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(doc).encode())

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = "text/plain") -> Reply:
        return cls(status, text.encode(), f"{content_type}; charset=utf-8")


@dataclass
class Request:
    method: str
    url: SplitResult
    headers: Any
    body: bytes


# (route name, qualifier, handler) for a request, or None (404)
Route = tuple[str, str | None, Callable[[Request], Reply]]


class App:
    """A fake service: routes requests and says how it answers an injected error."""

    service = "app"

    def route(self, method: str, path: str, query: str) -> Route | None:
        raise NotImplementedError

    def error_reply(self, status: int, rule: Rule) -> Reply:
        if rule.get("body") is not None:
            return Reply(status, str(rule["body"]).encode(), "text/plain; charset=utf-8")
        return Reply.text(f"{status}: injected error", status)


class FaultyHandler(BaseHTTPRequestHandler):
    """One request: route it, apply the fault rules, answer (or not)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else Nagle and delayed ACKs add ~40 ms per answer
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return bytes(data)
                data += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        body = self._body()
        app: App = self.server.app
        found = app.route(method, url.path, url.query)
        if found is None:
            self._send(Reply.text("404: Not Found", 404))
            return
        name, qualifier, handler = found
        fault, delay = self.server.faults.take(name, qualifier) if name else (None, None)
        pause = 0.0
        if delay is not None:
            pause = random.uniform(float(delay.get("min", 0)), float(delay.get("max", 0)))
        split = random.random()
        if pause:
            time.sleep(pause * split)  # part before the answer is computed, part after
        if fault is not None and fault.get("when", "before") == "before":
            self._fault(fault)
            return
        try:
            reply = handler(Request(method, url, self.headers, body))
        except Exception as exc:  # a fake's bug must show, not hang the client
            print(f"{app.service}: {method} {self.path}: {exc!r}", file=sys.stderr, flush=True)
            reply = Reply.text(f"500: {exc!r}", 500)
        if fault is not None:
            self._fault(fault)
            return
        if pause:
            time.sleep(pause * (1 - split))
        self._send(reply)

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        if reply.status not in (204, 304):
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.end_headers()
        if reply.status not in (204, 304) and self.command != "HEAD":
            self.wfile.write(reply.body)

    def _fault(self, rule: Rule) -> None:
        kind = rule["kind"]
        if kind == "status":  # an answer: the connection stays open for the next request
            status = int(rule.get("status", 500))
            self._send(self.server.app.error_reply(status, rule))
            return
        if kind == "badjson":
            body = str(rule.get("body", '{"truncated": [1, 2')).encode()
            if rule.get("repeat"):  # a large answer: body, repeat x times, suffix
                body += str(rule["repeat"]).encode() * int(rule.get("times", 1))
                body += str(rule.get("suffix", "")).encode()
            self._send(Reply(200, body, "application/json"))
            return
        self.close_connection = True
        if kind == "garbage":
            with contextlib.suppress(OSError):
                self.wfile.write(GARBAGE)
                self.connection.shutdown(socket.SHUT_RDWR)
        elif kind == "hang":
            time.sleep(float(rule.get("seconds", 5.0)))
            self._reset()
        elif kind == "close":  # an orderly close (FIN) without an answer
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
        else:  # "exception" and anything unknown: reset, no answer
            self._reset()

    def _reset(self) -> None:
        with contextlib.suppress(OSError):
            if self.connection.family in (socket.AF_INET, socket.AF_INET6):
                # SO_LINGER 0: close() sends a RST (connection reset by peer)
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
            self.connection.close()


class UnixFaultyHandler(FaultyHandler):
    disable_nagle_algorithm = False  # no TCP_NODELAY on a unix socket


class _Quiet:
    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError | ValueError):
            super().handle_error(request, client_address)  # type: ignore[misc]


class TcpServer(_Quiet, ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, port: int, app: App, faults: FaultFile) -> None:
        self.app = app
        self.faults = faults
        super().__init__(("127.0.0.1", port), FaultyHandler)


class UnixServer(_Quiet, ThreadingMixIn, UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, path: str, app: App, faults: FaultFile) -> None:
        self.app = app
        self.faults = faults
        super().__init__(path, UnixFaultyHandler)

    def get_request(self) -> tuple[Any, Any]:
        request, _ = super().get_request()
        return request, ("unix", 0)  # BaseHTTPRequestHandler wants a (host, port)


def set_parent_death_signal() -> None:
    """In a child (preexec_fn): die with the parent, so no fake outlives a crashed test."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
