"""simcard_reaper.py: stale simulated clients go, live ones stay."""

from __future__ import annotations

import json
import os
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import simcard
import simcard_reaper as reaper

RUNNING = "1" * 64
STOPPED = "2" * 64
UNKNOWN = "3" * 64
GONE = "4" * 64


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"0::/system.slice/docker-{RUNNING}.scope\n", RUNNING),
        (f"12:memory:/docker/{STOPPED}\n", STOPPED),
        ("0::/user.slice/cardshare-sim.scope\n", None),
        ("", None),
    ],
)
def test_container_of_cgroup(text: str, expected: str | None) -> None:
    assert reaper.container_of_cgroup(text) == expected


def register(root: Path, container_id: str | None) -> simcard.SimClient:
    client = simcard.SimClient("x", ["x"], root=root, container_id=container_id)
    client.register(vram=1024)
    client._stop.set()  # freeze the writer thread: the test plays the killed stand-in
    return client


def engine(container_id: str) -> bool | None:
    return {RUNNING: True, STOPPED: False, UNKNOWN: None}.get(container_id, False)


def test_reap_removes_only_stale_entries(card_root: Path) -> None:
    live = register(card_root, RUNNING)
    stopped = register(card_root, STOPPED)
    unknown = register(card_root, UNKNOWN)
    orphan = register(card_root, None)
    local = register(card_root, None)
    foreign = card_root / "proc" / "4242"
    foreign.mkdir()
    (card_root / "proc" / ".gone-1-abc").mkdir()
    owner = json.loads((orphan.pid_dir / simcard.OWNER_FILE).read_text())  # type: ignore[operator]
    owner["owner_pid"] = 999999999
    (orphan.pid_dir / simcard.OWNER_FILE).write_text(json.dumps(owner))  # type: ignore[operator]

    removed = reaper.reap(card_root, engine, alive=lambda pid: pid != 999999999)

    assert sorted(removed) == sorted([
        (str(stopped.pid), f"container {STOPPED[:12]} is not running"),
        (str(orphan.pid), "owner pid 999999999 is gone"),
    ])  # fmt: skip
    names = {p.name for p in (card_root / "proc").iterdir()}
    assert names == {str(live.pid), str(unknown.pid), str(local.pid), "4242"}


class FakeEngine(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == f"/containers/{RUNNING}/json":
            state = {"Running": True, "StartedAt": "2026-12-01T13:00:00.250000000Z"}
            body = json.dumps({"State": state}).encode()
            self.send_response(200)
        elif self.path == f"/containers/{STOPPED}/json":
            body = json.dumps({"State": {"Running": False}}).encode()
            self.send_response(200)
        elif self.path == f"/containers/{UNKNOWN}/json":
            body = b"{}"
            self.send_response(500)
        else:
            body = b'{"message": "No such container"}'
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return

    def address_string(self) -> str:
        return "unix"


@pytest.fixture
def docker_socket(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "docker.sock")
    server = socketserver.ThreadingUnixStreamServer(path, FakeEngine)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield path
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("container_id", "running"),
    [(RUNNING, True), (STOPPED, False), (GONE, False), (UNKNOWN, None)],
)
def test_docker_running_asks_the_engine(
    docker_socket: str, container_id: str, running: bool | None
) -> None:
    assert reaper.docker_running(container_id, docker_socket) is running


def test_docker_running_without_engine_is_unknown(tmp_path: Path) -> None:
    assert reaper.docker_running(RUNNING, str(tmp_path / "absent.sock")) is None


def test_main_once(card_root: Path, docker_socket: str, capsys: pytest.CaptureFixture[str]) -> None:
    stopped = register(card_root, STOPPED)
    code = reaper.main(["--root", str(card_root), "--socket", docker_socket, "--once"])
    assert code == 0
    assert capsys.readouterr().out == (
        f"SIMULATION: removed simulated client {stopped.pid}: "
        f"container {STOPPED[:12]} is not running\n"
    )
    assert not any(p.name.isdigit() for p in (card_root / "proc").iterdir())


def test_reap_removes_the_entry_of_a_container_started_again(card_root: Path) -> None:
    """ComfyUI SIGKILLed and its container restarted under the same id (the arbiter's
    restart): the dead process's entry goes, as the kernel would have closed its file; an
    entry made after the start stays."""
    old = register(card_root, RUNNING)
    owner = old.pid_dir / simcard.OWNER_FILE  # type: ignore[operator]
    made = owner.stat().st_mtime
    removed = reaper.reap(card_root, engine, started=lambda _: made + 30)
    assert removed == [
        (str(old.pid), f"container {RUNNING[:12]} started again after the entry was made")
    ]
    new = register(card_root, RUNNING)
    new_owner = new.pid_dir / simcard.OWNER_FILE  # type: ignore[operator]
    os.utime(new_owner, (made + 60, made + 60))  # registered after that start
    assert reaper.reap(card_root, engine, started=lambda _: made + 30) == []
    assert new.pid_dir.exists()  # type: ignore[union-attr]


def test_docker_started_at_asks_the_engine(docker_socket: str) -> None:
    import calendar
    import time

    expected = calendar.timegm(time.strptime("2026-12-01T13:00:00", "%Y-%m-%dT%H:%M:%S"))
    assert reaper.docker_started_at(RUNNING, docker_socket) == expected + 0.25
    assert reaper.docker_started_at(STOPPED, docker_socket) is None  # no StartedAt given
    assert reaper.docker_started_at(GONE, docker_socket) is None
