"""A fake Docker Engine API on a unix socket, whose containers are real processes.

``python fake_docker.py SPEC.json``. The spec names the socket, the run directory, the card
file and the containers (name, compose project/service, argv, the card client's name and
VRAM). What the arbiter's client (``cardshare.docker_api``, API ``v1.41``) relies on, with
Docker's semantics (facts.md, "Verified against real servers"):

* ``GET /v1.NN/containers/json?all=1&filters={"label": ["k=v", ...]}`` (without ``all``
  only running containers), ``GET /containers/<id|name>/json`` (``State.Running``,
  ``Status``, ``OOMKilled``, ``ExitCode``, ``StartedAt``, ``FinishedAt``, ``Pid``; no
  ``Health``: the containers define no healthcheck), 404 ``{"message": "No such
  container: x"}``;
* ``POST .../start``: 204 after the process is spawned, 304 when it already runs;
* ``POST .../stop?t=N``: SIGTERM, SIGKILL after N seconds, 204; 304 when not running;
* ``POST .../restart?t=N``: stop (when running) and start: a new process (ComfyUI's
  in-memory history is really lost) and a new ``StartedAt``; 204;
* ``GET .../logs?stdout=1&stderr=1&tail=N``: multiplexed frames (8-byte headers).

Fault rules (faultkit.py) apply to every Engine call: routes ``list``, ``inspect``,
``start``, ``stop``, ``restart``, ``logs``, qualified by the compose service
(``stop:vllm``). ``/_fake/...`` is the test's control API and is never faulted:
``GET /_fake/containers``; ``POST /_fake/crash?name=comfyui&signal=9&oom=0&respawn=0``
(kill the process as a crash would; ``respawn=1`` restarts it as a restart policy does,
cancelled by any later stop, start or restart). Setting ``<service>_restart_policy``
``on-failure`` restarts a container whose process exits non-zero by itself.

A "recorder" thread writes the card file (``current.json``, the recorder's schema) every
``card_interval`` seconds: a running container's client holds its VRAM, and keeps it for
``<service>_release_seconds`` after its process exited; a running process may report less
in the spec's ``vram_file`` (the fake ComfyUI after ``/free``). Card fault rules (route
``current.json``): ``garbage``, ``missing``, ``stale``, ``foreign`` (Plex on the card),
``badshape`` (JSON without a scan time), counted in writes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultkit import App, FaultFile, Reply, Request, Route, Rule, Settings, UnixServer

PROJECT = "com.docker.compose.project"
SERVICE = "com.docker.compose.service"
NEVER = "0001-01-01T00:00:00Z"


def rfc3339(t: float) -> str:
    """Docker's timestamps: RFC 3339 with nanoseconds, UTC."""
    dt = datetime.datetime.fromtimestamp(t, datetime.UTC)
    nanos = round((t - int(t)) * 1e9) % 1_000_000_000
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


def human(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, int(seconds))} seconds" if seconds >= 1 else "Less than a second"
    return f"{int(seconds // 60)} minutes"


class Container:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.service: str = spec["service"]
        self.id = hashlib.sha256(self.name.encode()).hexdigest()
        self.created = time.time()
        self.proc: subprocess.Popen[bytes] | None = None
        self.running = False
        self.status = "created"
        self.exit_code = 0
        self.oom_killed = False
        self.oom_next = False
        self.started_at = NEVER
        self.finished_at = NEVER
        # when a crash killed the process: Docker's FinishedAt is the exit time containerd
        # reports, not the later moment the daemon (here the reaper thread) took the event
        self.crashed_at: float | None = None
        self.released_at = 0.0  # when its VRAM leaves the card (after the process exited)
        self.respawn_pending = False
        self.stopping = False  # a stop or restart through the API: never a restart policy's
        self.starts = 0
        self.logs: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=4000)


class Docker(App):
    service = "docker"

    def __init__(self, spec: dict[str, Any]) -> None:
        self.run_dir = Path(spec["run_dir"])
        self.settings = Settings(self.run_dir / "settings.json")
        self.card_faults = FaultFile(self.run_dir / "faults", "card")
        self.card_file = Path(spec["card_file"])
        self.lock = threading.RLock()
        self.containers = [Container(c) for c in spec["containers"]]
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.card_writes = 0

    # -- lookups ---------------------------------------------------------------------------

    def find(self, ref: str) -> Container | None:
        for c in self.containers:
            if ref in (c.id, c.name) or (len(ref) >= 12 and c.id.startswith(ref)):
                return c
        return None

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, c: Container) -> None:
        """Start the container's process (the lock is held)."""
        if c.spec.get("vram_file"):  # a new process has allocated nothing it could report
            Path(c.spec["vram_file"]).unlink(missing_ok=True)
        log = open(self.run_dir / "logs" / f"{c.service}.log", "ab")  # noqa: SIM115
        log.write(f"--- start {rfc3339(time.time())}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            c.spec["argv"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **c.spec.get("env", {})},
        )
        c.proc = proc
        c.running = True
        c.status = "running"
        c.exit_code = 0
        c.oom_killed = False
        c.started_at = rfc3339(time.time())
        c.finished_at = NEVER
        c.released_at = 0.0
        c.starts += 1
        for stream, pipe in ((1, proc.stdout), (2, proc.stderr)):
            threading.Thread(target=self._pump, args=(c, stream, pipe, log), daemon=True).start()
        threading.Thread(target=self._reap, args=(c, proc), daemon=True).start()

    def _pump(self, c: Container, stream: int, pipe: Any, log: Any) -> None:
        for line in iter(pipe.readline, b""):
            c.logs.append((stream, line))
            try:
                log.write(line)
                log.flush()
            except ValueError:
                return

    def _reap(self, c: Container, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self.lock:
            current = c.proc is proc and c.running
            self._exited(c, proc, code)
            policy = self.settings.get(f"{c.service}_restart_policy", "no")
            if current and not c.stopping and code != 0 and policy == "on-failure":
                c.respawn_pending = True  # as Docker's restart policy does after a crash
            respawn = c.respawn_pending
        if respawn:
            time.sleep(0.05)
            with self.lock:
                if c.respawn_pending and not c.running:
                    c.respawn_pending = False
                    self._spawn(c)

    def _exited(self, c: Container, proc: subprocess.Popen[bytes], code: int) -> None:
        if c.proc is not proc or not c.running:
            return
        c.running = False
        c.status = "exited"
        c.exit_code = 128 - code if code < 0 else code
        c.oom_killed = c.oom_next
        c.oom_next = False
        c.finished_at = rfc3339(c.crashed_at if c.crashed_at is not None else time.time())
        c.crashed_at = None
        c.released_at = time.time() + self.settings.seconds(f"{c.service}_release_seconds", 0.0)

    def _stop(self, c: Container, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; returns once the process has exited."""
        proc = c.proc
        assert proc is not None
        c.stopping = True
        try:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        with self.lock:
            self._exited(c, proc, code)
            c.stopping = False

    def shutdown(self) -> None:
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()

    # -- the Engine API --------------------------------------------------------------------

    def route(self, method: str, path: str, query: str) -> Route | None:
        if path.startswith("/_fake/"):
            return "", None, self.control
        m = re.fullmatch(r"(?:/v1\.\d+)?(/.*)", path)
        path = m.group(1) if m else path
        if method == "GET" and path == "/_ping":
            return "ping", None, lambda _: Reply.text("OK")
        if method == "GET" and path == "/containers/json":
            return "list", self._listed_service(query), self.list_containers
        m = re.fullmatch(r"/containers/([^/]+)/(json|start|stop|restart|logs)", path)
        if m is None:
            return None
        ref, action = m.groups()
        c = self.find(ref)
        qualifier = c.service if c else None
        handlers = {
            ("GET", "json"): ("inspect", self.inspect),
            ("POST", "start"): ("start", self.start),
            ("POST", "stop"): ("stop", self.stop),
            ("POST", "restart"): ("restart", self.restart),
            ("GET", "logs"): ("logs", self.logs),
        }
        found = handlers.get((method, action))
        if found is None:
            return None
        name, handler = found
        return name, qualifier, lambda request: handler(request, ref)

    @staticmethod
    def _listed_service(query: str) -> str | None:
        try:
            labels = json.loads(parse_qs(query).get("filters", ["{}"])[0]).get("label", [])
        except ValueError:
            return None
        for label in labels:
            if label.startswith(SERVICE + "="):
                return str(label.split("=", 1)[1])
        return None

    def error_reply(self, status: int, rule: Rule) -> Reply:
        message = rule.get("body") or {
            404: "No such container: injected",
            400: "bad parameter",
            409: "conflict",
        }.get(status, "injected engine error")
        return Reply.json({"message": message}, status)

    @staticmethod
    def _missing(ref: str) -> Reply:
        return Reply.json({"message": f"No such container: {ref}"}, 404)

    def list_containers(self, request: Request) -> Reply:
        q = parse_qs(request.url.query)
        show_all = q.get("all", ["0"])[0] in ("1", "true", "True")
        try:
            filters = json.loads(q.get("filters", ["{}"])[0])
        except ValueError:
            return Reply.json({"message": "invalid filter"}, 400)
        wanted = filters.get("label", [])
        if isinstance(wanted, dict):  # the older map form {"k=v": true}
            wanted = [k for k, v in wanted.items() if v]
        out = []
        with self.lock:
            for c in self.containers:
                labels = self._labels(c)
                if not show_all and not c.running:
                    continue
                if not all(self._label_match(labels, w) for w in wanted):
                    continue
                out.append(
                    {
                        "Id": c.id,
                        "Names": [f"/{c.name}"],
                        "Image": c.spec.get("image", c.service),
                        "ImageID": "sha256:" + hashlib.sha256(c.service.encode()).hexdigest(),
                        "Command": " ".join(c.spec["argv"][:2]),
                        "Created": int(c.created),
                        "Ports": [],
                        "Labels": labels,
                        "State": c.status,
                        "Status": self._status_text(c),
                        "HostConfig": {"NetworkMode": "host"},
                        "Mounts": [],
                    }
                )
        return Reply.json(out)

    @staticmethod
    def _label_match(labels: dict[str, str], wanted: str) -> bool:
        key, eq, value = wanted.partition("=")
        return key in labels and (not eq or labels[key] == value)

    @staticmethod
    def _labels(c: Container) -> dict[str, str]:
        return {
            PROJECT: c.spec["project"],
            SERVICE: c.service,
            "com.docker.compose.container-number": "1",
            "com.docker.compose.oneoff": "False",
        }

    @staticmethod
    def _status_text(c: Container) -> str:
        if c.running:
            return "Up " + human(time.time() - _parse_time(c.started_at))
        if c.status == "created":
            return "Created"
        return f"Exited ({c.exit_code}) " + human(time.time() - _parse_time(c.finished_at))

    def inspect(self, _: Request, ref: str) -> Reply:
        c = self.find(ref)
        if c is None:
            return self._missing(ref)
        with self.lock:
            pid = c.proc.pid if c.running and c.proc else 0
            doc = {
                "Id": c.id,
                "Created": rfc3339(c.created),
                "Path": c.spec["argv"][0],
                "Args": c.spec["argv"][1:],
                "State": {
                    "Status": c.status,
                    "Running": c.running,
                    "Paused": False,
                    "Restarting": False,
                    "OOMKilled": c.oom_killed,
                    "Dead": False,
                    "Pid": pid,
                    "ExitCode": c.exit_code,
                    "Error": "",
                    "StartedAt": c.started_at,
                    "FinishedAt": c.finished_at,
                },
                "Image": "sha256:" + hashlib.sha256(c.service.encode()).hexdigest(),
                "Name": f"/{c.name}",
                "RestartCount": 0,
                "Config": {"Image": c.spec.get("image", c.service), "Labels": self._labels(c)},
                "HostConfig": {"NetworkMode": "host", "RestartPolicy": {"Name": "no"}},
            }
        return Reply.json(doc)

    def start(self, _: Request, ref: str) -> Reply:
        c = self.find(ref)
        if c is None:
            return self._missing(ref)
        time.sleep(self.settings.seconds("docker_start_seconds", 0.0))
        with self.lock:
            c.respawn_pending = False
            if c.running:
                return Reply(304, b"")
            self._spawn(c)
        return Reply(204, b"")

    def _timeout(self, request: Request) -> float:
        try:
            return float(parse_qs(request.url.query).get("t", ["10"])[0])
        except ValueError:
            return 10.0

    def stop(self, request: Request, ref: str) -> Reply:
        c = self.find(ref)
        if c is None:
            return self._missing(ref)
        with self.lock:
            c.respawn_pending = False
            if not c.running:
                return Reply(304, b"")
        self._stop(c, self._timeout(request))
        return Reply(204, b"")

    def restart(self, request: Request, ref: str) -> Reply:
        c = self.find(ref)
        if c is None:
            return self._missing(ref)
        with self.lock:
            c.respawn_pending = False
            running = c.running
        if running:
            self._stop(c, self._timeout(request))
        time.sleep(self.settings.seconds("docker_start_seconds", 0.0))
        with self.lock:
            if not c.running:
                self._spawn(c)
        return Reply(204, b"")

    def logs(self, request: Request, ref: str) -> Reply:
        c = self.find(ref)
        if c is None:
            return self._missing(ref)
        q = parse_qs(request.url.query)
        streams = {1} if q.get("stdout", ["0"])[0] in ("1", "true") else set()
        if q.get("stderr", ["0"])[0] in ("1", "true"):
            streams.add(2)
        lines = [(s, line) for s, line in list(c.logs) if s in streams]
        tail = q.get("tail", ["all"])[0]
        if tail != "all":
            lines = lines[-int(tail) :] if int(tail) > 0 else []
        body = b"".join(bytes([s, 0, 0, 0]) + len(d).to_bytes(4, "big") + d for s, d in lines)
        return Reply(200, body, "application/vnd.docker.multiplexed-stream")

    # -- control (never faulted) ----------------------------------------------------------

    def control(self, request: Request) -> Reply:
        q = {k: v[0] for k, v in parse_qs(request.url.query).items()}
        path = request.url.path
        if path == "/_fake/containers":
            with self.lock:
                return Reply.json(
                    {
                        c.service: {
                            "running": c.running,
                            "status": c.status,
                            "exit_code": c.exit_code,
                            "started_at": c.started_at,
                            "starts": c.starts,
                            "pid": c.proc.pid if c.proc and c.running else None,
                            "vram": self._vram(c, time.time()),
                        }
                        for c in self.containers
                    }
                )
        if path == "/_fake/crash":
            c = self.find(q.get("name", "")) or next(
                (x for x in self.containers if x.service == q.get("name")), None
            )
            if c is None:
                return self._missing(q.get("name", ""))
            with self.lock:
                if not c.running or c.proc is None:
                    return Reply.json({"crashed": False})
                c.oom_next = q.get("oom") == "1"
                c.respawn_pending = q.get("respawn") == "1"
                c.crashed_at = time.time()
                c.proc.send_signal(int(q.get("signal", "9")))
            print(f"{rfc3339(c.crashed_at)} crash {c.name} (pid {c.proc.pid})", flush=True)
            return Reply.json({"crashed": True})
        return Reply.text("404: Not Found", 404)

    # -- the card file --------------------------------------------------------------------

    def _vram(self, c: Container, now: float) -> int:
        """The container's ``vram_bytes`` while it runs and until its release after an exit;
        a running process may report less in its ``vram_file`` (ComfyUI after /free)."""
        holds = c.running or (c.status == "exited" and now < c.released_at)
        if not holds:
            return 0
        if c.running and c.spec.get("vram_file"):
            with contextlib.suppress(OSError, ValueError):
                return int(Path(c.spec["vram_file"]).read_text(encoding="utf-8"))
        return int(c.spec.get("vram_bytes", 0))

    def card_loop(self) -> None:
        while True:
            try:
                self.write_card()
            except Exception as exc:  # the recorder must keep going
                print(f"card writer: {exc!r}", file=sys.stderr, flush=True)
            time.sleep(self.settings.seconds("card_interval", 0.05))

    def write_card(self) -> None:
        now = time.time()
        fault, _ = self.card_faults.take("current.json")
        kind = fault["kind"] if fault else None
        if kind == "stale":
            return
        if kind == "missing":
            self.card_file.unlink(missing_ok=True)
            return
        clients = []
        with self.lock:
            for c in self.containers:
                vram = self._vram(c, now)
                if vram:
                    clients.append(
                        {
                            "name": c.spec["card_name"],
                            "vram_bytes": vram,
                            "system_bytes": 0,
                            "gtt_bytes": 196608,
                            "engines": dict(c.spec.get("engines", {})) if c.running else {},
                            "pids": [c.proc.pid] if c.proc else [],
                            "containers": [c.id],
                            "commands": ["python3"],
                            "drm_client_ids": [3],
                        }
                    )
        if kind == "foreign":
            clients.append(
                {
                    "name": "plex/plex",
                    "vram_bytes": 2 * 2**30,
                    "system_bytes": 0,
                    "gtt_bytes": 0,
                    "engines": {"vcs": 0.4, "vecs": 0.1},
                    "pids": [4242],
                    "containers": ["f" * 64],
                    "commands": ["Plex Transcoder"],
                    "drm_client_ids": [9],
                }
            )
        clients.sort(key=lambda x: x["name"])
        doc: dict[str, Any] = {
            "schema": 1,
            "timestamp": rfc3339(now)[:19] + "Z",
            "timestamp_unix": round(now, 3),
            "interval_seconds": 0.05,
            "host": "fake",
            "cards": {
                "0000:03:00.0": {
                    "driver": "xe",
                    "vram_total_bytes": 32 * 2**30,
                    "vram_used_bytes": sum(x["vram_bytes"] for x in clients),
                    "clients": clients,
                }
            },
            "stats": {"processes": 10, "descriptors": 100, "drm_descriptors": len(clients)},
        }
        if kind == "badshape":
            del doc["timestamp"], doc["timestamp_unix"]
        data = json.dumps(doc, indent=1).encode()
        if kind == "garbage":
            data = data[: len(data) // 2]
        tmp = self.card_file.with_name(f".{self.card_file.name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, self.card_file)
        self.card_writes += 1


def _parse_time(text: str) -> float:
    if text == NEVER:
        return time.time()
    return datetime.datetime.fromisoformat(text[:26] + "+00:00").timestamp()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    docker = Docker(spec)
    sock = spec["socket"]
    if os.path.exists(sock):
        os.unlink(sock)
    server = UnixServer(sock, docker, FaultFile(Path(spec["run_dir"]) / "faults", "docker"))

    def on_term(signum: int, frame: Any) -> None:
        docker.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    with docker.lock:
        for c in docker.containers:
            if c.spec.get("autostart"):
                docker._spawn(c)
    docker.write_card()
    threading.Thread(target=docker.card_loop, daemon=True).start()
    print(f"fake docker listening on {sock}", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
