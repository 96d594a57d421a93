"""``cardshare ratchet``: restart OpenVINO Model Server when its resident floor passes a bound.

The reranker's memory never comes back: the pool OpenVINO allocates on the GPU grows to the
largest request served since the server started and stays there, so the resident floor
ratchets up request after request, and only a restart returns it to the baseline.  One run of
this watchdog (a hardened systemd timer runs it once a minute, like the recorder's scan):

1. finds the server's container by its compose labels (:mod:`cardshare.docker_api`); none, or
   not running: nothing to do (``up`` 0, exit 0);
2. reads its resident memory (:mod:`cardshare.retrieval.resident`), by ``source``:

   ``cgroup`` (integrated GPU: pinned GPU memory is shmem-backed host memory, unevictable in
   the container's cgroup)
       ``shmem`` of ``<root>/sys/fs/cgroup<path>/memory.stat``, ``<path>`` from the ``0::``
       line of ``<root>/proc/<State.Pid>/cgroup`` (cgroup v2 only); ``unevictable`` and
       ``anon`` are exported beside it;
   ``fdinfo`` (discrete card)
       the resident VRAM (:attr:`cardshare.fdinfo.FdInfo.vram_bytes`: ``drm-resident-vram0``,
       else ``drm-memory-vram0``, over every VRAM region) of the DRM clients found under
       ``<root>/proc`` (:func:`cardshare.recorder.scan.scan_proc`) whose naming process
       (:func:`cardshare.naming.naming_pid`, as the recorder attributes a client) is in this
       container's cgroup;

3. reads the requests in flight (:mod:`cardshare.retrieval.inflight`) from the server's
   ``/metrics`` (``--metrics_enable``):
   ``ovms_current_requests`` (models) plus ``ovms_current_graphs`` (MediaPipe graphs, which
   serve ``/v3/rerank`` and ``/v3/embeddings``).  Unreachable, an error status, no answer
   within :data:`METRICS_TIMEOUT_SECONDS`, a text that is not a valid exposition, or one that
   names neither family: in flight is *unknown*;
4. decides (:func:`decide`): at or under the bound nothing happens; over it, with nothing in
   flight, the container is restarted through the Engine API (``--stop-timeout`` seconds of
   SIGTERM before SIGKILL) and the restart is proven by a new ``State.StartedAt`` (a restart
   that restarted nothing is an error); over it with requests in flight, or in flight unknown,
   the restart is deferred to the next run and the deferral counted by reason.  ``dry_run``
   decides and logs, and never restarts.

Each run prints one line (journald) saying what it read and why it acted, and after a restart
``restarted: StartedAt <old> -> <new>``.  It keeps its counters in ``<state-dir>/ratchet.json``
and writes a Prometheus textfile (both replaced atomically, :mod:`cardshare.atomicfile`):

``cardshare_retrieval_watchdog_up``
    1 when the container was found running and its resident memory read;
``cardshare_retrieval_watchdog_last_run_timestamp_seconds``
``cardshare_retrieval_resident_bytes{source}``
    absent when it could not be read;
``cardshare_retrieval_cgroup_memory_stat_bytes{key}``
    ``shmem``, ``unevictable``, ``anon`` (source ``cgroup`` only);
``cardshare_retrieval_resident_bound_bytes``
``cardshare_retrieval_in_flight``
    absent (never NaN) when unknown or not read;
``cardshare_retrieval_restarts_total``
``cardshare_retrieval_restart_deferrals_total{reason="in_flight|in_flight_unknown"}``
``cardshare_retrieval_last_restart_timestamp_seconds``
    absent before the first restart.

Exit status: 0 when the run did its job (nothing to do, a deferral, a proven restart, no
container); 1 with one line on stderr when the Engine API fails, the resident memory cannot be
read (the message names the file), a restart restarted nothing, or an output cannot be written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from cardshare import atomicfile, promtext
from cardshare.docker_api import (
    COMPOSE_PROJECT_LABEL,
    COMPOSE_SERVICE_LABEL,
    ContainerSummary,
    DockerClient,
    DockerError,
)
from cardshare.recorder.procfs import IsDrm, is_drm_char_device
from cardshare.retrieval.inflight import METRICS_TIMEOUT_SECONDS, fetch_in_flight
from cardshare.retrieval.resident import RatchetError, read_cgroup_memory, read_fdinfo_resident

Source = Literal["cgroup", "fdinfo"]

STATE_FILE = "ratchet.json"
LOCK_FILE = "ratchet.lock"
# how long a dry run waits for a run of the timer to let the lock go (a run takes seconds)
DRY_RUN_LOCK_WAIT_SECONDS = 60.0
STATE_VERSION = 1
DEFER_REASONS = ("in_flight", "in_flight_unknown")
#: The keys of the cgroup's ``memory.stat`` exported; ``shmem`` is the resident figure.
MEMORY_STAT_KEYS = ("shmem", "unevictable", "anon")
_ONEOFF_LABEL = "com.docker.compose.oneoff"


# -- the decision ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    """``none`` (at or under the bound), ``restart``, or ``defer`` with its ``reason``."""

    action: Literal["none", "restart", "defer"]
    reason: str | None = None


def decide(resident: int, bound: int, in_flight: float | None) -> Decision:
    """Pure: restart only over the bound and only when nothing is known to be in flight."""
    if resident <= bound:
        return Decision("none")
    if in_flight is None:
        return Decision("defer", "in_flight_unknown")
    if in_flight > 0:
        return Decision("defer", "in_flight")
    return Decision("restart")


# -- state and metrics ----------------------------------------------------------------------


def _fresh_state() -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "restarts_total": 0,
        "deferrals_total": dict.fromkeys(DEFER_REASONS, 0),
        "last_restart": None,
        "last_resident_bytes": None,
        "last_resident_source": None,
        "last_run": None,
        "container_id": None,
    }


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _time(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def load_state(path: Path) -> tuple[dict[str, Any], str]:
    """The state in ``path`` (fresh when missing), and a warning when it was unusable (its
    counters then start again from 0, which Prometheus takes as a counter reset)."""
    state = _fresh_state()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return state, ""
    except (OSError, UnicodeError, ValueError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return state, f"state {path} unreadable ({detail}): counters start again from 0"
    deferrals = doc.get("deferrals_total") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("version") != STATE_VERSION
        or not _count(doc.get("restarts_total"))
        or not isinstance(deferrals, dict)
        or not all(_count(deferrals.get(r, 0)) for r in DEFER_REASONS)
        or not _time(doc.get("last_restart"))
    ):
        return state, f"state {path} is not a ratchet state: counters start again from 0"
    state.update({k: v for k, v in doc.items() if k in state})
    state["deferrals_total"] = {r: int(deferrals.get(r, 0)) for r in DEFER_REASONS}
    return state, ""


# (name, type, help); counters end in ``_total``.
_METRICS = (
    (
        "cardshare_retrieval_watchdog_up",
        "gauge",
        "1 when the last watchdog run found the server's container running and read its "
        "resident memory.",
    ),
    (
        "cardshare_retrieval_watchdog_last_run_timestamp_seconds",
        "gauge",
        "Time of the last watchdog run (Unix seconds).",
    ),
    (
        "cardshare_retrieval_resident_bytes",
        "gauge",
        "Resident memory of the server: its cgroup's shmem (source cgroup) or its DRM "
        "clients' resident VRAM (source fdinfo).",
    ),
    (
        "cardshare_retrieval_cgroup_memory_stat_bytes",
        "gauge",
        "memory.stat of the server's cgroup (source cgroup): shmem, unevictable, anon.",
    ),
    (
        "cardshare_retrieval_resident_bound_bytes",
        "gauge",
        "Resident memory above which the watchdog restarts the server when it is idle.",
    ),
    (
        "cardshare_retrieval_in_flight",
        "gauge",
        "Requests and MediaPipe graphs in process (ovms_current_requests + "
        "ovms_current_graphs); absent when unknown.",
    ),
    (
        "cardshare_retrieval_restarts_total",
        "counter",
        "Restarts of the server by the watchdog, each proven by a new State.StartedAt.",
    ),
    (
        "cardshare_retrieval_restart_deferrals_total",
        "counter",
        "Runs over the bound that did not restart: requests in flight, or in flight unknown.",
    ),
    (
        "cardshare_retrieval_last_restart_timestamp_seconds",
        "gauge",
        "Time of the watchdog's last restart of the server (Unix seconds).",
    ),
)


def _whole(value: float) -> float:
    """A count of finite ``value`` as an integer when it is one: 3 in flight, not 3.0."""
    return int(value) if float(value).is_integer() else value


def render_metrics(
    state: Mapping[str, Any],
    *,
    now: float,
    up: bool,
    bound: int,
    source: str,
    resident: int | None,
    memory_stat: Mapping[str, int],
    in_flight: float | None,
) -> str:
    """The Prometheus textfile of one run (the text format the recorder writes)."""
    samples: dict[str, list[promtext.Sample]] = {name: [] for name, _, _ in _METRICS}
    samples["cardshare_retrieval_watchdog_up"].append(({}, int(up)))
    samples["cardshare_retrieval_watchdog_last_run_timestamp_seconds"].append(({}, now))
    if resident is not None:
        samples["cardshare_retrieval_resident_bytes"].append(({"source": source}, resident))
    for key in MEMORY_STAT_KEYS:
        if key in memory_stat:
            samples["cardshare_retrieval_cgroup_memory_stat_bytes"].append(
                ({"key": key}, memory_stat[key])
            )
    samples["cardshare_retrieval_resident_bound_bytes"].append(({}, bound))
    if in_flight is not None:
        samples["cardshare_retrieval_in_flight"].append(({}, _whole(in_flight)))
    samples["cardshare_retrieval_restarts_total"].append(({}, state["restarts_total"]))
    for reason in DEFER_REASONS:
        samples["cardshare_retrieval_restart_deferrals_total"].append(
            ({"reason": reason}, state["deferrals_total"][reason])
        )
    if state.get("last_restart") is not None:
        samples["cardshare_retrieval_last_restart_timestamp_seconds"].append(
            ({}, float(state["last_restart"]))
        )
    timestamps = {name: 3 for name, _, _ in _METRICS if name.endswith("_timestamp_seconds")}
    return promtext.render(_METRICS, samples, timestamps)


# -- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatchetConfig:
    """Everything one run needs (the CLI's options); the defaults are those of a real host."""

    bound_bytes: int
    source: Source
    state_dir: Path
    textfile: Path
    project: str = "retrieval"
    service: str = "ovms"
    base_url: str = "http://127.0.0.1:8000"
    docker_socket: str = "/var/run/docker.sock"
    root: str = "/"
    stop_timeout: int = 30
    dry_run: bool = False
    json: bool = False
    metrics_timeout: float = METRICS_TIMEOUT_SECONDS
    docker_timeout: float = 30.0
    is_drm: IsDrm = is_drm_char_device
    clock: Callable[[], float] = field(default=time.time)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def _flight_text(in_flight: float | None, why: str) -> str:
    if in_flight is None:
        return f"in flight unknown ({why})"
    return f"{promtext.number(_whole(in_flight))} in flight"


@dataclass
class _Run:
    """What one run saw and did (the ``--json`` document)."""

    project: str
    service: str
    source: str
    bound_bytes: int
    dry_run: bool
    container_id: str | None = None
    up: bool = False
    resident_bytes: int | None = None
    memory_stat: dict[str, int] = field(default_factory=dict)
    drm_clients: int | None = None
    in_flight: float | None = None
    in_flight_error: str = ""
    action: str = "none"
    deferral_reason: str | None = None
    started_at_before: str | None = None
    started_at_after: str | None = None
    error: str = ""
    lines: list[str] = field(default_factory=list)

    def log(self, line: str) -> None:
        self.lines.append(line)


@contextlib.contextmanager
def _run_lock(path: Path, wait_seconds: float = 0.0) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path``, waiting up to ``wait_seconds`` for another run
    to let it go; yields False when that run still holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RatchetError(f"cannot open lock file {path}: {exc.strerror or exc}") from None
    try:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        yield True
    finally:
        os.close(fd)


def _pick(found: list[ContainerSummary], where: str) -> ContainerSummary | None:
    """The service's container: one-off containers (``docker compose run``) are not it; of
    several, the running one (two running is an error: which one would be restarted?)."""
    candidates = [c for c in found if c.labels.get(_ONEOFF_LABEL, "False") != "True"]
    running = [c for c in candidates if c.state == "running"]
    if len(running) > 1:
        ids = ", ".join(c.id[:12] for c in running)
        raise RatchetError(f"{len(running)} running containers of {where} ({ids}): expected one")
    if running:
        return running[0]
    return candidates[0] if candidates else None


def _observe(config: RatchetConfig, docker: DockerClient, run: _Run) -> dict[str, Any] | None:
    """Find the container and read its resident memory and the work in flight; returns its
    inspect document, or None when there is nothing to watch."""
    where = f"{config.project}/{config.service}"
    found = docker.list_containers(
        {COMPOSE_PROJECT_LABEL: config.project, COMPOSE_SERVICE_LABEL: config.service}
    )
    summary = _pick(found, where)
    doc = docker.inspect_document(summary.id) if summary is not None else None
    if summary is None or doc is None:
        run.action = "not_found"
        run.log(
            f"ratchet: no container of {where} (labels {COMPOSE_PROJECT_LABEL}={config.project},"
            f" {COMPOSE_SERVICE_LABEL}={config.service}): nothing to do"
        )
        return None
    run.container_id = str(doc.get("Id") or summary.id)
    raw_state = doc.get("State")
    state: dict[str, Any] = raw_state if isinstance(raw_state, dict) else {}
    run.started_at_before = str(state.get("StartedAt") or "")
    if not state.get("Running"):
        run.action = "not_running"
        status = state.get("Status") or summary.state or "not running"
        run.log(
            f"ratchet: {where} (container {run.container_id[:12]}) is {status}, not running: "
            "nothing to do"
        )
        return None
    if config.source == "cgroup":
        pid = state.get("Pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise RatchetError(
                f"{where} (container {run.container_id[:12]}) runs but the Engine names no "
                f"process (State.Pid {pid!r})"
            )
        run.memory_stat = {
            k: v for k, v in read_cgroup_memory(config.root, pid).items() if k in MEMORY_STAT_KEYS
        }
        run.resident_bytes = run.memory_stat["shmem"]
    else:
        run.resident_bytes, run.drm_clients = read_fdinfo_resident(
            config.root, run.container_id, config.is_drm
        )
    run.up = True
    run.in_flight, run.in_flight_error = fetch_in_flight(config.base_url, config.metrics_timeout)
    return doc


def _act(config: RatchetConfig, docker: DockerClient, run: _Run, state: dict[str, Any]) -> int:
    """Decide and act on what :func:`_observe` read; returns the exit status."""
    assert run.resident_bytes is not None and run.container_id is not None
    where = f"{config.project}/{config.service}"
    who = f"{where} (container {run.container_id[:12]})"
    what = (
        f"ratchet: resident {_gib(run.resident_bytes)} "
        f"{'>' if run.resident_bytes > config.bound_bytes else '<='} bound "
        f"{_gib(config.bound_bytes)}, {_flight_text(run.in_flight, run.in_flight_error)}"
    )
    decision = decide(run.resident_bytes, config.bound_bytes, run.in_flight)
    if decision.action == "none":
        run.action = "under_bound"
        run.log(f"{what}: nothing to do for {who}")
        return 0
    if decision.action == "defer":
        assert decision.reason is not None
        run.action = "defer"
        run.deferral_reason = decision.reason
        state["deferrals_total"][decision.reason] += 1
        dry = " (dry run)" if config.dry_run else ""
        run.log(f"{what}: deferring the restart of {who} to a later run{dry}")
        return 0
    if config.dry_run:
        run.action = "would_restart"
        run.log(f"{what}: would restart {who} (dry run: not restarting)")
        return 0
    run.action = "restart"
    run.log(f"{what}: restarting {who}")
    before = run.started_at_before or ""
    try:
        docker.restart(run.container_id, config.stop_timeout)
        after_doc = docker.inspect_document(run.container_id)
    except DockerError as exc:
        raise RatchetError(f"restart of {who} failed: {exc}") from None
    after_state = after_doc.get("State") if after_doc is not None else None
    if not isinstance(after_state, dict):
        raise RatchetError(f"restart of {who}: the container is gone after the restart")
    after = str(after_state.get("StartedAt") or "")
    run.started_at_after = after
    if not after or after == before:
        raise RatchetError(
            f"restart of {who} was answered but State.StartedAt is still {before or '(empty)'}: "
            "nothing restarted"
        )
    run.action = "restarted"
    state["restarts_total"] += 1
    state["last_restart"] = config.clock()
    if not after_state.get("Running"):
        status = after_state.get("Status") or "not running"
        run.log(f"restarted: StartedAt {before} -> {after}, but it is {status} now")
        raise RatchetError(f"{who} restarted (StartedAt {after}) and is {status} now")
    run.log(f"restarted: StartedAt {before} -> {after}")
    return 0


def run(config: RatchetConfig, out: TextIO, err: TextIO) -> int:
    """One run of the watchdog (see the module); returns the exit status."""
    now = config.clock()
    record = _Run(
        project=config.project,
        service=config.service,
        source=config.source,
        bound_bytes=config.bound_bytes,
        dry_run=config.dry_run,
    )
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        err.write(f"cardshare: error: cannot create {config.state_dir}: {exc.strerror or exc}\n")
        return 1
    # the timer's run skips when another holds the lock (the next minute comes); a dry run is
    # someone asking now (the retrieval role's probe): it waits for the other run to end
    wait = DRY_RUN_LOCK_WAIT_SECONDS if config.dry_run else 0.0
    try:
        with _run_lock(config.state_dir / LOCK_FILE, wait) as locked:
            if not locked:
                skipped = f"another run holds {config.state_dir / LOCK_FILE}"
                if config.json:
                    out.write(json.dumps({"skipped": skipped}, sort_keys=True) + "\n")
                else:
                    out.write(f"ratchet: {skipped}: skipped\n")
                return 0
            return _locked_run(config, record, now, out, err)
    except RatchetError as exc:
        err.write(f"cardshare: error: {exc}\n")
        return 1


def _locked_run(config: RatchetConfig, run: _Run, now: float, out: TextIO, err: TextIO) -> int:
    state_path = config.state_dir / STATE_FILE
    state, warning = load_state(state_path)
    if warning:
        err.write(f"ratchet: {warning}\n")
    docker = DockerClient(config.docker_socket, timeout=config.docker_timeout)
    code = 0
    try:
        if _observe(config, docker, run) is not None:
            code = _act(config, docker, run, state)
    except DockerError as exc:
        run.error = f"Docker Engine API: {exc}"
    except RatchetError as exc:
        run.error = str(exc)
    if run.error:
        code = 1
    state["last_run"] = now
    state["container_id"] = run.container_id
    if run.resident_bytes is not None:
        state["last_resident_bytes"] = run.resident_bytes
        state["last_resident_source"] = config.source
    text = render_metrics(
        state,
        now=now,
        up=run.up,
        bound=config.bound_bytes,
        source=config.source,
        resident=run.resident_bytes,
        memory_stat=run.memory_stat,
        in_flight=run.in_flight,
    )
    try:
        atomicfile.write_atomic(
            state_path, (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()
        )
    except OSError as exc:
        raise RatchetError(f"cannot write {state_path}: {exc.strerror or exc}") from None
    try:
        atomicfile.write_atomic(config.textfile, text.encode(), make_parents=True)
    except OSError as exc:
        raise RatchetError(f"cannot write {config.textfile}: {exc.strerror or exc}") from None
    if config.json:
        doc = {k: v for k, v in vars(run).items() if k != "lines"}
        doc["log"] = run.lines
        doc["state"] = state
        out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        out.write("".join(line + "\n" for line in run.lines))
    out.flush()
    if run.error:
        err.write(f"cardshare: error: {run.error}\n")
    return code
