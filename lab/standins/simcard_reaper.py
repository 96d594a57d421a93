"""SIMULATION: remove simulated DRM clients whose stand-in is gone (lab host service).

A stand-in removes its ``<root>/proc/<pid>`` entry when it stops gracefully; after a
``SIGKILL`` (``docker kill``, an OOM kill) the entry would stay and the simulated card
would look busy for ever.  On a real host the kernel closes the descriptor when the
process dies; this loop plays that part.  Every second it removes entries

* whose container (from the ``cgroup`` line) is not running, asking the Docker engine
  at ``/var/run/docker.sock`` (``GET /containers/<id>/json`` -> ``State.Running``;
  a 404 means gone), or was started again after the entry was made (``State.StartedAt``
  later than the entry's owner file: a killed process whose container was restarted
  under the same id, as the arbiter's restart of ComfyUI does), and
* that name no container but whose recorded owner pid (``cardshare-sim-owner``) is gone;
an entry whose owner file holds ``release_after`` (Unix seconds) is kept until then (a client
whose memory the driver frees late).

When the engine cannot be asked, container entries are kept (never remove on doubt).
Run as ``python3 simcard_reaper.py [--root R] [--interval S] [--once]``.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import OWNER_FILE, remove_entry, sim_root

__all__ = [
    "container_of_cgroup",
    "docker_running",
    "main",
    "pid_alive",
    "reap",
    "stale_reason",
]

DOCKER_SOCKET = "/var/run/docker.sock"
_CGROUP_RE = re.compile(r"(?:docker-|/docker/)([0-9a-f]{64})")

# container id -> running (True/False), or None when unknown
EngineLookup = Callable[[str], bool | None]
# container id -> State.StartedAt in Unix seconds, or None when unknown
StartLookup = Callable[[str], float | None]
PidLookup = Callable[[int], bool]


def container_of_cgroup(text: str) -> str | None:
    """The Docker container id named by a ``/proc/<pid>/cgroup`` text, if any."""
    match = _CGROUP_RE.search(text)
    return match.group(1) if match else None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def _inspect(container_id: str, socket_path: str) -> tuple[int, Any]:
    conn = _UnixConnection(socket_path, timeout=3)
    try:
        conn.request("GET", f"/containers/{container_id}/json")
        response = conn.getresponse()
        body = response.read()
    except OSError:
        return 0, None
    finally:
        conn.close()
    try:
        return response.status, json.loads(body) if response.status == 200 else None
    except ValueError:
        return 0, None


def docker_running(container_id: str, socket_path: str = DOCKER_SOCKET) -> bool | None:
    """Ask the engine whether a container runs: ``None`` when the engine cannot tell."""
    status, doc = _inspect(container_id, socket_path)
    if status == 404:
        return False
    try:
        return bool(doc["State"]["Running"]) if status == 200 else None
    except (KeyError, TypeError):
        return None


def docker_started_at(container_id: str, socket_path: str = DOCKER_SOCKET) -> float | None:
    """``State.StartedAt`` of a container in Unix seconds; ``None`` when unknown."""
    status, doc = _inspect(container_id, socket_path)
    try:
        text = str(doc["State"]["StartedAt"]) if status == 200 else ""
    except (KeyError, TypeError):
        return None
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z$", text)
    if not match or text.startswith("0001-"):
        return None
    seconds = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S"))
    return seconds + float(f"0.{match.group(2) or 0}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(
    pid_dir: Path,
    engine: EngineLookup,
    alive: PidLookup,
    started: StartLookup = lambda _: None,
) -> str | None:
    """Why an entry is stale (a sentence), or ``None`` to keep it."""
    owner_path = pid_dir / OWNER_FILE
    if not owner_path.exists():
        return None  # not made by a stand-in: leave it alone
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        # a client whose memory the driver frees late (the vLLM stand-in's hold knob)
        if float(json.loads(owner_path.read_text()).get("release_after", 0)) > time.time():
            return None
    container_id: str | None = None
    with contextlib.suppress(OSError):
        container_id = container_of_cgroup((pid_dir / "cgroup").read_text())
    if container_id is not None:
        running = engine(container_id)
        if running is False:
            return f"container {container_id[:12]} is not running"
        since = started(container_id) if running else None
        with contextlib.suppress(OSError):
            if since is not None and owner_path.stat().st_mtime < since - 1.0:
                return f"container {container_id[:12]} started again after the entry was made"
        return None
    try:
        owner = json.loads(owner_path.read_text())
        owner_pid = int(owner["owner_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if alive(owner_pid) else f"owner pid {owner_pid} is gone"


def reap(
    root: Path,
    engine: EngineLookup,
    alive: PidLookup = pid_alive,
    started: StartLookup = lambda _: None,
) -> list[tuple[str, str]]:
    """Remove stale entries under ``<root>/proc``; return ``(pid, reason)`` for each."""
    proc = root / "proc"
    removed: list[tuple[str, str]] = []
    try:
        entries = sorted(proc.iterdir())
    except OSError:
        return removed
    cache: dict[str, bool | None] = {}

    def cached(container_id: str) -> bool | None:
        if container_id not in cache:
            cache[container_id] = engine(container_id)
        return cache[container_id]

    for entry in entries:
        if entry.name.startswith(".gone-"):
            shutil.rmtree(entry, ignore_errors=True)  # left by an interrupted removal
            continue
        if not entry.name.isdigit():
            continue
        reason = stale_reason(entry, cached, alive, started)
        if reason is not None:
            remove_entry(entry)
            removed.append((entry.name, reason))
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simcard_reaper", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--socket", default=DOCKER_SOCKET)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args(argv)
    root = args.root or sim_root()

    def engine(container_id: str) -> bool | None:
        return docker_running(container_id, args.socket)

    while True:
        for pid, reason in reap(root, engine, started=lambda c: docker_started_at(c, args.socket)):
            print(f"SIMULATION: removed simulated client {pid}: {reason}", flush=True)
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
