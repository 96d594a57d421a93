"""Tests of ``cardshare ratchet`` (:mod:`cardshare.retrieval`), the retrieval tier's watchdog.

Against the fault suite's fake Docker Engine (``tests/faults/fake_docker.py``: a real process
on a unix socket whose containers are real processes; a restart spawns a new one with a new
``StartedAt``, and its fault rules make a restart answer 204 without restarting), a real HTTP
server standing in for OpenVINO Model Server's ``/metrics``, and synthetic ``proc`` and
``sys/fs/cgroup`` trees under a root prefix, as the lab simulates them (lab/SIMULATION.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from promtext import Exposition

from cardshare.cli import main
from cardshare.docker_api import DockerClient
from cardshare.retrieval import inflight, ratchet, resident

ROOT = Path(__file__).resolve().parents[3]
FAULTS = ROOT / "tests" / "faults"
GIB = 1024**3
OVMS_NAME = "retrieval-ovms-1"
OVMS_ID = hashlib.sha256(OVMS_NAME.encode()).hexdigest()  # the fake's container ids
OTHER_ID = "f" * 64
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]

# The families and labels of OpenVINO Model Server's default metrics (openvinotoolkit/
# model_server docs/metrics.md), laid out as its serializer writes them (docs/metrics_output.out):
# ``ovms_current_requests{name,version}`` for models, ``ovms_current_graphs{name}`` for
# MediaPipe graphs (the rerank and embeddings servables are graphs).
OVMS_METRICS = """\
# HELP ovms_requests_success Number of successful requests to a model or a DAG.
# TYPE ovms_requests_success counter
ovms_requests_success{{api="V3",interface="REST",method="Unary",name="bge-reranker-v2-m3"}} 41
# HELP ovms_current_requests Number of requests being currently processed by the model server.
# TYPE ovms_current_requests gauge
ovms_current_requests{{name="bge-reranker-v2-m3_ov_tokenizer",version="1"}} {requests}
# HELP ovms_current_graphs Number of MediaPipe graphs in process.
# TYPE ovms_current_graphs gauge
ovms_current_graphs{{name="bge-reranker-v2-m3"}} {graphs}
ovms_current_graphs{{name="bge-m3"}} 0
# HELP ovms_request_time_us Processing time of requests to a model or a DAG.
# TYPE ovms_request_time_us histogram
ovms_request_time_us_count{{interface="REST",name="bge-m3",version="1"}} 0
ovms_request_time_us_bucket{{interface="REST",name="bge-m3",version="1",le="+Inf"}} 0
"""


def ovms_metrics(requests: int = 0, graphs: int = 0) -> str:
    return OVMS_METRICS.format(requests=requests, graphs=graphs)


def memory_stat(shmem: int, anon: int = int(0.55 * GIB)) -> str:
    """A cgroup v2 ``memory.stat`` (the kernel's key order, Documentation/admin-guide/
    cgroup-v2.rst) of the seed's reranker: pinned GPU memory is shmem, all of it unevictable,
    no page cache."""
    return (
        f"anon {anon}\nfile {shmem}\nkernel 20971520\nkernel_stack 1048576\npagetables 4194304\n"
        f"sec_pagetables 0\npercpu 0\nsock 0\nvmalloc 0\nshmem {shmem}\nzswap 0\nzswapped 0\n"
        f"file_mapped {shmem}\nfile_dirty 0\nfile_writeback 0\nswapcached 0\nanon_thp 0\n"
        f"inactive_anon {anon + shmem}\nactive_anon 0\ninactive_file 0\nactive_file 0\n"
        f"unevictable {shmem}\nslab_reclaimable 0\nslab_unreclaimable 0\npgfault 1000\n"
    )


# -- the fakes ----------------------------------------------------------------------------------


def _faultkit() -> Any:
    spec = importlib.util.spec_from_file_location("faultkit", FAULTS / "faultkit.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("faultkit")
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["faultkit"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module


class Engine:
    """``tests/faults/fake_docker.py`` with the retrieval tier's container (running) and a
    container that was created and never started."""

    def __init__(self, run_dir: Path) -> None:
        self.sockdir = Path(tempfile.mkdtemp(prefix="ratchet-", dir="/tmp"))  # a short path
        self.socket = str(self.sockdir / "docker.sock")
        self.run_dir = run_dir
        run_dir.mkdir()
        (run_dir / "faults").mkdir()
        (run_dir / "settings.json").write_text(json.dumps({"card_interval": 5}))
        container = {"card_name": "retrieval/ovms", "vram_bytes": 0, "argv": SLEEPER}
        spec = {
            "socket": self.socket,
            "run_dir": str(run_dir),
            "card_file": str(run_dir / "current.json"),
            "containers": [
                {**container, "name": OVMS_NAME, "project": "retrieval", "service": "ovms",
                 "autostart": True},
                {**container, "name": "retrieval-stopped-1", "project": "retrieval",
                 "service": "stopped", "autostart": False},
            ],
        }  # fmt: skip
        (run_dir / "spec.json").write_text(json.dumps(spec))
        self.log = open(run_dir / "docker.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(FAULTS / "fake_docker.py"), str(run_dir / "spec.json")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = DockerClient(self.socket, timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.inspect()["State"]["Running"]:
                    break
            except Exception:
                assert time.monotonic() < deadline, (run_dir / "docker.log").read_text()
                time.sleep(0.02)
        self.faults = _faultkit().FaultFile(run_dir / "faults", "docker")

    def inspect(self) -> dict[str, Any]:
        doc = self.client.inspect_document(OVMS_ID)
        assert doc is not None
        return doc

    def close(self) -> None:
        self.proc.terminate()  # it kills its containers
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)


class Ovms:
    """A stand-in for the server's ``/metrics``: a status, a body, a delay before answering."""

    def __init__(self) -> None:
        self.status = 200
        self.body = ovms_metrics().encode()
        self.delay = 0.0
        self.hits = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stand_in.hits += 1
                time.sleep(stand_in.delay)
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                self.send_response(stand_in.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(stand_in.body)))
                self.end_headers()
                self.wfile.write(stand_in.body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # an answer after the client gave up (the hang) breaks the pipe: not worth a traceback
        self.server.handle_error = lambda *args: None  # type: ignore[method-assign]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class World:
    """The engine, the server's metrics, a root prefix with the container's cgroup files."""

    def __init__(self, tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.tmp = tmp
        self.capsys = capsys
        self.engine = Engine(tmp / "engine")
        self.ovms = Ovms()
        self.root = tmp / "root"
        self.state_dir = tmp / "state"
        self.textfile = tmp / "textfile" / "ratchet.prom"
        self.cgroup = f"/system.slice/docker-{OVMS_ID}.scope"

    def close(self) -> None:
        self.ovms.close()
        self.engine.close()

    @property
    def pid(self) -> int:
        return int(self.engine.inspect()["State"]["Pid"])

    @property
    def started_at(self) -> str:
        return str(self.engine.inspect()["State"]["StartedAt"])

    def resident(self, shmem: int, pid: int | None = None) -> None:
        """The container's process in its cgroup, whose memory.stat says ``shmem``."""
        proc = self.root / "proc" / str(pid or self.pid)
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "cgroup").write_text(f"0::{self.cgroup}\n")
        group = self.root / "sys" / "fs" / "cgroup" / self.cgroup.lstrip("/")
        group.mkdir(parents=True, exist_ok=True)
        (group / "memory.stat").write_text(memory_stat(shmem))

    def cli(self, *extra: str, **options: str) -> tuple[int, str, str]:
        """``cardshare ratchet`` against this world: (exit code, stdout, stderr)."""
        values = {
            "base-url": self.ovms.url,
            "bound-bytes": str(4 * GIB),
            "source": "cgroup",
            "state-dir": str(self.state_dir),
            "textfile": str(self.textfile),
            "docker-socket": self.engine.socket,
            "root": str(self.root),
            "stop-timeout": "5",
        }
        values.update({k.replace("_", "-"): v for k, v in options.items()})
        argv = ["ratchet"] + [a for k, v in values.items() for a in (f"--{k}", v)] + list(extra)
        code = main(argv)
        out = self.capsys.readouterr()
        return code, out.out, out.err

    def metrics(self) -> Exposition:
        return Exposition(self.textfile.read_text())

    def state(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.state_dir / ratchet.STATE_FILE).read_text())
        return doc


@pytest.fixture
def world(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[World]:
    w = World(tmp_path, capsys)
    try:
        yield w
    finally:
        w.close()


WHO = f"retrieval/ovms (container {OVMS_ID[:12]})"


def _counters(m: Exposition) -> tuple[float, float, float]:
    return (
        m("cardshare_retrieval_restarts_total"),
        m("cardshare_retrieval_restart_deferrals_total", reason="in_flight"),
        m("cardshare_retrieval_restart_deferrals_total", reason="in_flight_unknown"),
    )


# -- whole runs ---------------------------------------------------------------------------------


def test_under_the_bound_nothing_happens(world: World) -> None:
    world.resident(3 * GIB)
    before = world.started_at
    code, out, err = world.cli()
    assert (code, err) == (0, "")
    assert out == (
        f"ratchet: resident 3.00 GiB <= bound 4.00 GiB, 0 in flight: nothing to do for {WHO}\n"
    )
    assert world.started_at == before
    m = world.metrics()
    assert m("cardshare_retrieval_watchdog_up") == 1
    assert m("cardshare_retrieval_resident_bytes", source="cgroup") == 3 * GIB
    assert m("cardshare_retrieval_resident_bound_bytes") == 4 * GIB
    assert m("cardshare_retrieval_in_flight") == 0
    assert m.series("cardshare_retrieval_cgroup_memory_stat_bytes") == {
        frozenset({("key", "shmem")}): 3 * GIB,
        frozenset({("key", "unevictable")}): 3 * GIB,
        frozenset({("key", "anon")}): int(0.55 * GIB),
    }
    assert _counters(m) == (0, 0, 0)
    assert m.series("cardshare_retrieval_last_restart_timestamp_seconds") == {}
    assert abs(m("cardshare_retrieval_watchdog_last_run_timestamp_seconds") - time.time()) < 60
    assert world.state()["last_resident_bytes"] == 3 * GIB


def test_over_the_bound_and_idle_restarts(world: World) -> None:
    shmem = int(5.11 * GIB)
    old_pid = world.pid
    world.resident(shmem)
    before = world.started_at
    t0 = time.time()
    code, out, err = world.cli()
    assert (code, err) == (0, "")
    after = world.started_at
    assert after != before
    assert world.pid != old_pid  # a new process: the pool is back to its baseline
    assert out == (
        f"ratchet: resident 5.11 GiB > bound 4.00 GiB, 0 in flight: restarting {WHO}\n"
        f"restarted: StartedAt {before} -> {after}\n"
    )
    state = world.state()
    assert state["restarts_total"] == 1
    assert state["deferrals_total"] == {"in_flight": 0, "in_flight_unknown": 0}
    assert t0 <= state["last_restart"] <= time.time()
    assert state["last_resident_bytes"] == shmem
    m = world.metrics()
    assert m.types["cardshare_retrieval_restarts"] == "counter"
    assert m.types["cardshare_retrieval_restart_deferrals"] == "counter"
    assert _counters(m) == (1, 0, 0)
    assert m("cardshare_retrieval_last_restart_timestamp_seconds") == pytest.approx(
        state["last_restart"], abs=0.001
    )
    assert m("cardshare_retrieval_resident_bytes", source="cgroup") == shmem
    # the next minute: the fresh server is back at its baseline; the counter carries on
    world.resident(int(1.71 * GIB), pid=world.pid)
    code, out, err = world.cli()
    assert (code, err) == (0, "")
    assert out.startswith("ratchet: resident 1.71 GiB <= bound 4.00 GiB, 0 in flight: nothing")
    assert _counters(world.metrics()) == (1, 0, 0)
    assert world.started_at == after


@pytest.mark.parametrize(("requests", "graphs", "shown"), [(1, 0, "1"), (0, 2, "2"), (1, 1, "2")])
def test_requests_in_flight_defer(world: World, requests: int, graphs: int, shown: str) -> None:
    world.resident(5 * GIB)
    world.ovms.body = ovms_metrics(requests, graphs).encode()
    before = world.started_at
    code, out, err = world.cli()
    assert (code, err) == (0, "")
    assert out == (
        f"ratchet: resident 5.00 GiB > bound 4.00 GiB, {shown} in flight: deferring the restart "
        f"of {WHO} to a later run\n"
    )
    assert world.started_at == before
    m = world.metrics()
    assert _counters(m) == (0, 1, 0)
    assert m("cardshare_retrieval_in_flight") == int(shown)
    assert world.state()["deferrals_total"] == {"in_flight": 1, "in_flight_unknown": 0}


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("refused", "GET {url}/metrics: connection refused"),
        ("hang", "GET {url}/metrics: no answer within 0.3 s"),
        ("status 500", "GET {url}/metrics answered 500"),
        ("status 404", "GET {url}/metrics answered 404"),
        (
            "garbage",
            "GET {url}/metrics: not a usable exposition: line 1: not a metric name: "
            "'<html><body>502 Bad Gateway</body></html>'",
        ),
        ("not utf-8", "GET {url}/metrics: the answer is not UTF-8 text"),
        (
            "truncated",
            "GET {url}/metrics: not a usable exposition: line 9: unterminated value of label "
            "name at column 34: 'ovms_current_graphs{{name=\"bge-rer'",
        ),
        (
            "metrics without the gauges",
            "GET {url}/metrics: not a usable exposition: the metrics name neither "
            "ovms_current_requests nor ovms_current_graphs (is the server started with "
            "--metrics_enable, and --metrics_list, if given, listing them?)",
        ),
    ],
)
def test_in_flight_unknown_defers(
    world: World, monkeypatch: pytest.MonkeyPatch, case: str, why: str
) -> None:
    monkeypatch.setattr(inflight, "METRICS_TIMEOUT_SECONDS", 0.3)
    world.resident(5 * GIB)
    url = world.ovms.url
    if case == "refused":
        url = _closed_port_url()
    elif case == "hang":
        world.ovms.delay = 1.5
    elif case.startswith("status"):
        world.ovms.status = int(case.split()[1])
        world.ovms.body = b"internal error"
    elif case == "garbage":
        world.ovms.body = b"<html><body>502 Bad Gateway</body></html>\n"
    elif case == "not utf-8":
        world.ovms.body = b"ovms_current_graphs 0\n\xff\xfe\n"
    elif case == "truncated":
        text = ovms_metrics()
        world.ovms.body = text[: text.index('ovms_current_graphs{name="bge-rer') + 33].encode()
    else:
        world.ovms.body = b'# TYPE ovms_streams gauge\novms_streams{name="bge-m3",version="1"} 1\n'
    before = world.started_at
    started = time.monotonic()
    code, out, err = world.cli(base_url=url)
    assert time.monotonic() - started < 3
    assert (code, err) == (0, "")
    assert out == (
        f"ratchet: resident 5.00 GiB > bound 4.00 GiB, in flight unknown ({why.format(url=url)}): "
        f"deferring the restart of {WHO} to a later run\n"
    )
    assert world.started_at == before
    m = world.metrics()
    assert _counters(m) == (0, 0, 1)
    assert m.series("cardshare_retrieval_in_flight") == {}  # absent, never NaN
    assert m("cardshare_retrieval_watchdog_up") == 1


def test_deferrals_add_up_and_unknown_under_the_bound_is_no_deferral(world: World) -> None:
    world.resident(5 * GIB)
    world.ovms.status = 503
    for _ in range(3):
        assert world.cli()[0] == 0
    world.ovms.status = 200
    world.ovms.body = ovms_metrics(requests=2).encode()
    assert world.cli()[0] == 0
    assert _counters(world.metrics()) == (0, 1, 3)
    world.resident(3 * GIB)
    world.ovms.status = 503
    code, out, _ = world.cli()
    assert code == 0
    assert out.startswith("ratchet: resident 3.00 GiB <= bound 4.00 GiB, in flight unknown")
    assert _counters(world.metrics()) == (0, 1, 3)


def test_a_restart_that_restarts_nothing_is_an_error(world: World) -> None:
    world.resident(5 * GIB)
    before = world.started_at
    rule = world.engine.faults.add("restart:ovms", "status", status=204)  # 204, nothing done
    code, out, err = world.cli()
    assert world.engine.faults.hits(rule) == 1
    assert code == 1
    assert out == f"ratchet: resident 5.00 GiB > bound 4.00 GiB, 0 in flight: restarting {WHO}\n"
    assert err == (
        f"cardshare: error: restart of {WHO} was answered but State.StartedAt is still {before}: "
        "nothing restarted\n"
    )
    assert world.started_at == before
    m = world.metrics()
    assert _counters(m) == (0, 0, 0)
    assert m.series("cardshare_retrieval_last_restart_timestamp_seconds") == {}


def test_a_restart_the_engine_refuses_is_an_error(world: World) -> None:
    world.resident(5 * GIB)
    world.engine.faults.add("restart:ovms", "status", status=500, body="driver failed")
    code, out, err = world.cli()
    assert code == 1
    assert out.endswith(f": restarting {WHO}\n")
    assert err == (
        f"cardshare: error: restart of {WHO} failed: Docker Engine POST "
        f"/containers/{OVMS_ID}/restart answered 500: driver failed\n"
    )
    assert world.state()["restarts_total"] == 0


def test_dry_run_never_restarts(world: World) -> None:
    world.resident(5 * GIB)
    before = world.started_at
    code, out, err = world.cli("--dry-run")
    assert (code, err) == (0, "")
    assert out == (
        f"ratchet: resident 5.00 GiB > bound 4.00 GiB, 0 in flight: would restart {WHO} "
        "(dry run: not restarting)\n"
    )
    assert world.started_at == before
    assert _counters(world.metrics()) == (0, 0, 0)


@pytest.mark.parametrize(
    ("service", "line"),
    [
        (
            "nothing",
            "ratchet: no container of retrieval/nothing (labels com.docker.compose.project="
            "retrieval, com.docker.compose.service=nothing): nothing to do\n",
        ),
        (
            "stopped",
            "ratchet: retrieval/stopped (container {id}) is created, not running: nothing to do\n",
        ),
    ],
)
def test_no_running_container_is_nothing_to_do(world: World, service: str, line: str) -> None:
    code, out, err = world.cli(service=service)
    assert (code, err) == (0, "")
    stopped_id = hashlib.sha256(b"retrieval-stopped-1").hexdigest()[:12]
    assert out == line.format(id=stopped_id)
    m = world.metrics()
    assert m("cardshare_retrieval_watchdog_up") == 0
    assert m.series("cardshare_retrieval_resident_bytes") == {}
    assert m("cardshare_retrieval_resident_bound_bytes") == 4 * GIB
    assert world.engine.inspect()["State"]["Running"]  # the other one was left alone
    assert world.ovms.hits == 0


def test_the_engine_api_failing_is_exit_1(world: World) -> None:
    missing = str(world.tmp / "no-docker.sock")
    code, out, err = world.cli(docker_socket=missing)
    assert (code, out) == (1, "")
    assert err == (
        f"cardshare: error: Docker Engine API: Docker Engine at {missing} did not answer GET "
        "/containers/json: FileNotFoundError: [Errno 2] No such file or directory\n"
    )
    m = world.metrics()
    assert m("cardshare_retrieval_watchdog_up") == 0
    assert _counters(m) == (0, 0, 0)


@pytest.mark.parametrize("damage", ["no cgroup file", "no memory.stat", "cgroup v1", "no shmem"])
def test_unreadable_cgroup_names_the_path(world: World, damage: str) -> None:
    pid = world.pid
    world.resident(5 * GIB)
    cgroup_file = world.root / "proc" / str(pid) / "cgroup"
    stat_file = world.root / "sys" / "fs" / "cgroup" / world.cgroup.lstrip("/") / "memory.stat"
    if damage == "no cgroup file":
        cgroup_file.unlink()
        message = f"cannot read the server's cgroup file {cgroup_file}: no such file"
    elif damage == "no memory.stat":
        stat_file.unlink()
        message = f"cannot read the server's cgroup memory.stat {stat_file}: no such file"
    elif damage == "cgroup v1":
        cgroup_file.write_text(f"12:memory:/docker/{OVMS_ID}\n1:name=systemd:/docker/{OVMS_ID}\n")
        message = (
            f"{cgroup_file} has no cgroup v2 line (0::<path>): a cgroup v1 host; --source cgroup "
            "needs cgroup v2 (or use --source fdinfo)"
        )
    else:
        stat_file.write_text("anon 1\nfile 2\n")
        message = f"{stat_file} has no shmem line"
    code, out, err = world.cli()
    assert (code, out, err) == (1, "", f"cardshare: error: {message}\n")
    m = world.metrics()
    assert m("cardshare_retrieval_watchdog_up") == 0
    assert m.series("cardshare_retrieval_resident_bytes") == {}


def _fdinfo(client_id: int, key: str, size: str) -> str:
    return (
        "pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1070\ndrm-driver:\txe\n"
        f"drm-client-id:\t{client_id}\ndrm-pdev:\t0000:03:00.0\ndrm-resident-gtt:\t192 KiB\n"
        f"{key}:\t{size}\n"
    )


def test_fdinfo_counts_only_this_containers_clients(world: World, rec_tree: Any) -> None:
    t = rec_tree  # under tmp_path/root: the world's root
    assert t.root == world.root
    mine = f"0::/system.slice/docker-{OVMS_ID}.scope\n"
    t.process(100001, comm="ovms", cgroup=mine)
    t.drm_fd(100001, 5, _fdinfo(3, "drm-resident-vram0", "3 GiB"))
    t.drm_fd(100001, 6, _fdinfo(3, "drm-resident-vram0", "3 GiB"))  # dup(): counted once
    t.process(100002, comm="ovms", cgroup=mine)
    t.drm_fd(100002, 4, _fdinfo(4, "drm-memory-vram0", "2 GiB"))  # the older key
    t.process(100003, comm="vllm", cgroup=f"0::/system.slice/docker-{OTHER_ID}.scope\n")
    t.drm_fd(100003, 4, _fdinfo(5, "drm-resident-vram0", "20 GiB"))
    t.process(100004, comm="python3")  # no container
    t.drm_fd(100004, 4, _fdinfo(6, "drm-resident-vram0", "7 GiB"))
    before = world.started_at
    out = io.StringIO()
    err = io.StringIO()
    config = ratchet.RatchetConfig(
        bound_bytes=4 * GIB,
        source="fdinfo",
        state_dir=world.state_dir,
        textfile=world.textfile,
        base_url=world.ovms.url,
        docker_socket=world.engine.socket,
        root=str(world.root),
        dry_run=True,
        json=True,
        is_drm=t.is_drm,
    )
    assert ratchet.run(config, out, err) == 0
    assert err.getvalue() == ""
    doc = json.loads(out.getvalue())
    assert (doc["resident_bytes"], doc["drm_clients"], doc["action"]) == (
        5 * GIB,
        2,
        "would_restart",
    )
    assert doc["log"] == [
        f"ratchet: resident 5.00 GiB > bound 4.00 GiB, 0 in flight: would restart {WHO} "
        "(dry run: not restarting)"
    ]
    assert doc["container_id"] == OVMS_ID
    assert world.started_at == before
    m = world.metrics()
    assert m("cardshare_retrieval_resident_bytes", source="fdinfo") == 5 * GIB
    assert m.series("cardshare_retrieval_cgroup_memory_stat_bytes") == {}


def test_an_unusable_state_starts_again_from_zero(world: World) -> None:
    world.resident(5 * GIB)
    world.ovms.status = 500
    world.state_dir.mkdir()
    path = world.state_dir / ratchet.STATE_FILE
    path.write_text('{"version": 1, "restarts_total": -3')
    code, _, err = world.cli()
    assert code == 0
    assert err.startswith(f"ratchet: state {path} unreadable (")
    assert err.endswith("): counters start again from 0\n")
    assert world.state()["deferrals_total"] == {"in_flight": 0, "in_flight_unknown": 1}


# -- the pure parts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resident", "in_flight", "expected"),
    [
        (4 * GIB, None, ratchet.Decision("none")),  # at the bound: nothing
        (4 * GIB + 1, 0.0, ratchet.Decision("restart")),
        (4 * GIB + 1, 1.0, ratchet.Decision("defer", "in_flight")),
        (4 * GIB + 1, None, ratchet.Decision("defer", "in_flight_unknown")),
        (0, 3.0, ratchet.Decision("none")),
    ],
)
def test_decide(resident: int, in_flight: float | None, expected: ratchet.Decision) -> None:
    assert ratchet.decide(resident, 4 * GIB, in_flight) == expected


def test_parse_exposition_accepts_the_format() -> None:
    text = (
        "# a comment\n"
        "# HELP m_total help with \\\\ and \\n escapes\n"
        "# TYPE m_total counter\n"
        'm_total{a="x\\"y\\\\z\\n",b="",} 1.5e3 1700000000000\n'
        'm_total { a = "1" } +Inf\n'
        "nan_metric NaN\n"
        "neg -0.5\n"
        "\n"
    )
    expo = inflight.parse_exposition(text)
    assert expo.types == {"m_total": "counter"}
    assert [(s.name, s.labels) for s in expo.samples] == [
        ("m_total", {"a": 'x"y\\z\n', "b": ""}),
        ("m_total", {"a": "1"}),
        ("nan_metric", {}),
        ("neg", {}),
    ]
    values = [s.value for s in expo.samples]
    assert values[:2] == [1500.0, math.inf] and math.isnan(values[2]) and values[3] == -0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html>", "line 1: not a metric name: '<html>'"),
        ("m", "line 1: expected a space and a value: 'm'"),
        ("m 1_000", "line 1: expected a value [timestamp]: 'm 1_000'"),
        ("m infinity", "line 1: expected a value [timestamp]: 'm infinity'"),
        ("m 1 2 3", "line 1: expected a value [timestamp]: 'm 1 2 3'"),
        ("m 1 1.5", "line 1: bad timestamp: 'm 1 1.5'"),
        ("m 1\r", "line 1: expected a value [timestamp]: 'm 1\\r'"),
        ('m{a="1"', "line 1: expected , or } at column 8: 'm{a=\"1\"'"),
        ('m{a="1",a="2"} 1', 'line 1: label a given twice at column 14: \'m{a="1",a="2"} 1\''),
        (
            'm{a="\\t"} 1',
            "line 1: bad escape in the value of label a at column 6: 'm{a=\"\\\\t\"} 1'",
        ),
        ('m{1a="x"} 1', "line 1: expected a label name at column 3: 'm{1a=\"x\"} 1'"),
        ("m{a=x} 1", "line 1: expected the quoted value of label a at column 5: 'm{a=x} 1'"),
        ('m{a:"x"} 1', "line 1: expected = after label a at column 4: 'm{a:\"x\"} 1'"),
        ("# TYPE m gauge\n# TYPE m gauge", "line 2: m typed twice"),
        ("# TYPE m widget", "line 1: bad TYPE line: '# TYPE m widget'"),
        ("# HELP 1m help", "line 1: bad metric name '1m'"),
    ],
)
def test_parse_exposition_refuses(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        inflight.parse_exposition(text)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ovms_metrics(), 0.0),
        (ovms_metrics(requests=2, graphs=3), 5.0),
        ("# TYPE ovms_current_graphs gauge\n", 0.0),  # declared, no graph yet: idle
        ('ovms_current_graphs{name="g"} 1\n', 1.0),  # untyped samples count
        ("ovms_streams 4\n", "the metrics name neither"),
        ("# TYPE ovms_current_requests counter\n", "ovms_current_requests is a counter"),
        ("ovms_current_graphs NaN\n", "ovms_current_graphs{} is nan"),
        ('ovms_current_requests{name="m"} -1\n', "ovms_current_requests{'name': 'm'} is -1.0"),
    ],
)
def test_in_flight_of(text: str, expected: float | str) -> None:
    expo = inflight.parse_exposition(text)
    if isinstance(expected, float):
        assert inflight.in_flight_of(expo) == expected
    else:
        with pytest.raises(
            ValueError, match="^" + expected.replace("{", "\\{").replace("(", "\\(")
        ):
            inflight.in_flight_of(expo)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"0::/system.slice/docker-{OVMS_ID}.scope\n", f"/system.slice/docker-{OVMS_ID}.scope"),
        ("12:memory:/docker/x\n0::/a/b\n", "/a/b"),
        ("12:memory:/docker/x\n1:name=systemd:/docker/x\n", None),
        ("", None),
    ],
)
def test_cgroup_v2_path(text: str, expected: str | None) -> None:
    assert resident.cgroup_v2_path(text) == expected


def test_parse_memory_stat() -> None:
    stat = resident.parse_memory_stat(memory_stat(5 * GIB))
    assert (stat["shmem"], stat["unevictable"], stat["anon"]) == (5 * GIB, 5 * GIB, 590558003)
    with pytest.raises(ValueError, match=re.escape("line 2 is not '<key> <count>': 'shmem lots'")):
        resident.parse_memory_stat("anon 1\nshmem lots\n")


def test_the_metrics_timeout_is_five_seconds() -> None:
    assert inflight.METRICS_TIMEOUT_SECONDS == 5.0


# -- the command line and the zipapp ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--source", "cgroup", "--state-dir", "s", "--textfile", "t"], "--bound-bytes"),
        (["--bound-bytes", "0", "--source", "cgroup", "--state-dir", "s", "--textfile", "t"],
         "expected 1 or more, got 0"),
        (["--bound-bytes", "1", "--source", "rss", "--state-dir", "s", "--textfile", "t"],
         "invalid choice: 'rss'"),
        (["--bound-bytes", "1", "--source", "cgroup", "--textfile", "t"], "--state-dir"),
        (["--bound-bytes", "1", "--source", "cgroup", "--state-dir", "s"], "--textfile"),
        (["--bound-bytes", "1", "--source", "cgroup", "--state-dir", "s", "--textfile", "t",
          "--base-url", "127.0.0.1:8000"], "expected OpenVINO Model Server's REST address"),
        (["--bound-bytes", "1", "--source", "cgroup", "--state-dir", "s", "--textfile", "t",
          "--stop-timeout", "-1"], "expected 0 or more, got -1"),
    ],
)  # fmt: skip
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ratchet", *argv]) == 2
    assert message in capsys.readouterr().err


def _builder() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_zipapp
    finally:
        sys.path.pop(0)
    return build_zipapp


def test_the_zipapp_carries_the_watchdog(tmp_path: Path) -> None:
    builder = _builder()
    for module in ("retrieval/ratchet.py", "retrieval/resident.py", "retrieval/inflight.py"):
        source = (ROOT / "src" / "cardshare" / module).read_text()
        assert builder.foreign_imports(source, module) == []
        assert module in builder.MODULES
    pyz = builder.build(tmp_path / "cardshare.pyz")
    missing = str(tmp_path / "no-docker.sock")
    run = subprocess.run(
        [sys.executable, "-I", str(pyz), "ratchet", "--bound-bytes", "1", "--source", "cgroup",
         "--state-dir", str(tmp_path / "s"), "--textfile", str(tmp_path / "t.prom"),
         "--docker-socket", missing],
        capture_output=True,
        text=True,
        check=False,
        env={},
    )  # fmt: skip
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr.startswith(f"cardshare: error: Docker Engine API: Docker Engine at {missing}")
    assert "cardshare_retrieval_watchdog_up 0\n" in (tmp_path / "t.prom").read_text()


def test_the_run_never_waits_for_more_than_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """fetch_in_flight on its own: a hanging server costs the timeout, not more."""
    ovms = Ovms()
    ovms.delay = 2.0
    try:
        started = time.monotonic()
        value, why = inflight.fetch_in_flight(ovms.url, timeout=0.2)
        assert time.monotonic() - started < 1.5
        assert (value, why) == (None, f"GET {ovms.url}/metrics: no answer within 0.2 s")
    finally:
        ovms.close()


# -- two runs at once ---------------------------------------------------------------------------


def _hold_lock(world: World) -> int:
    import fcntl
    import os

    world.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(world.state_dir / ratchet.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_run_while_another_holds_the_lock_skips(world: World) -> None:
    import os

    world.resident(5 * GIB)
    fd = _hold_lock(world)
    try:
        code, out, _ = world.cli()
        assert code == 0 and out.endswith(": skipped\n") and "another run holds" in out
        assert world.state_dir.joinpath(ratchet.STATE_FILE).exists() is False
    finally:
        os.close(fd)


def test_a_dry_run_waits_for_the_other_run_and_answers_json(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import threading

    world.resident(3 * GIB)
    fd = _hold_lock(world)
    threading.Timer(0.5, os.close, (fd,)).start()  # the timer's run ends half a second later
    code, out, err = world.cli("--dry-run", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["resident_bytes"] == 3 * GIB and doc["dry_run"] is True
    # one that still finds it held after its wait says so, as JSON
    monkeypatch.setattr(ratchet, "DRY_RUN_LOCK_WAIT_SECONDS", 0.2)
    fd = _hold_lock(world)
    try:
        code, out, _ = world.cli("--dry-run", "--json")
        assert code == 0
        assert "another run holds" in json.loads(out)["skipped"]
    finally:
        os.close(fd)
