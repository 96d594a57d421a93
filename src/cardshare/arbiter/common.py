"""What the engine and its collaborators share: the alerts and their sink, why a container is
not running, a phase action's result, the clocks and the engine's pace, the card data as last
read. A leaf: the engine and its collaborators import it, it imports none of them."""

from __future__ import annotations

import asyncio
import errno
import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from cardshare.arbiter.cardview import CardSource, CardView
from cardshare.arbiter.edges import Containers, Role
from cardshare.arbiter.rules import describe_client
from cardshare.arbiter.states import Outcome
from cardshare.docker_api import DockerError
from cardshare.errors import LOG_WINDOW_BYTES, ErrorKind, classify_tail, oom_killed_message

log = logging.getLogger("cardshare.arbiter")

T = TypeVar("T")


class Alert(StrEnum):
    """What can go wrong, as the status, the metrics and the alert rules name it."""

    LLM_NOT_READY = "llm_not_ready"
    LLM_INSUFFICIENT_VRAM = "llm_insufficient_vram"
    LLM_OOM_KILLED = "llm_oom_killed"
    LLM_RELEASE_TIMEOUT = "llm_release_timeout"
    LLM_STOP_FAILED = "llm_stop_failed"  # in a row: swaps to image back off
    IMAGE_NOT_READY = "image_not_ready"
    IMAGE_START_FAILED = "image_start_failed"  # in a row: swaps to image back off
    IMAGE_STOP_FAILED = "image_stop_failed"  # vLLM stays stopped until ComfyUI is
    IMAGE_CRASHED = "image_crashed"  # ComfyUI exited or hung under a job
    # comfyui_max_restarts_per_hour spent: the card went back to vLLM, the jobs wait
    IMAGE_RESTART_LIMIT = "image_restart_limit"
    IMAGE_RELEASE_TIMEOUT = "image_release_timeout"
    IMAGE_OOM_KILLED = "image_oom_killed"
    DOCKER = "docker"
    CARD_DATA = "card_data"
    STORAGE = "storage"  # the data directory is full, read-only or failing
    ENGINE_ERROR = "engine_error"  # an unexpected error in the arbiter itself


ALERT_NAMES = tuple(a.value for a in Alert)


class Alerts(dict[str, str]):
    """The alerts raised now, name to message; ``raised`` counts, by name, the alerts raised
    since the start (and the engine's failed steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: Counter[str] = Counter()

    def set(self, name: Alert, message: str) -> None:
        if self.get(name) != message:
            log.warning("alert %s: %s", name, message)
        if name not in self:
            self.raised[name] += 1
        self[name] = message

    def drop(self, *names: Alert) -> None:
        for name in names:
            if self.pop(name, None) is not None:
                log.info("alert %s cleared", name)


class FailureKind(StrEnum):
    """Why a container is not running, from the engine's inspect and the log's tail."""

    OOM_KILLED = "oom_killed"  # the host memory cap (State.OOMKilled)
    INSUFFICIENT_VRAM = "insufficient_vram"  # the card's memory (the log says so)
    EXITED = "exited"
    UNKNOWN = "unknown"  # the container could not be inspected


@dataclass(frozen=True)
class ContainerFailure:
    kind: FailureKind
    message: str


async def container_failure(
    containers: Containers, role: Role, alerts: Alerts
) -> ContainerFailure | None:
    """Why the role's container is not running (OOMKilled, VRAM, exit code), else None."""
    try:
        st = await containers.state(role)
    except DockerError as exc:
        alerts.set(Alert.DOCKER, str(exc))
        return ContainerFailure(FailureKind.UNKNOWN, f"cannot inspect the {role} container")
    alerts.drop(Alert.DOCKER)
    # "restarting": it exited and its restart policy starts it again (Docker reports it
    # running meanwhile): a failure all the same, read from its log
    if st.running and st.status != "restarting":
        return None
    if st.oom_killed:
        return ContainerFailure(FailureKind.OOM_KILLED, oom_killed_message(st.name or role))
    try:  # the last start's output, bounded in bytes: the cause is mid-log in real vLLM
        tail = await containers.logs_tail(role, LOG_WINDOW_BYTES, since=st.started_at)
    except DockerError:
        tail = ""
    # the log as a whole: a message wrapped over two lines still matches
    verdict = classify_tail(tail)
    if verdict.kind is ErrorKind.INSUFFICIENT_VRAM:
        return ContainerFailure(
            FailureKind.INSUFFICIENT_VRAM, f"insufficient VRAM: {verdict.excerpt[:400]}"
        )
    status = st.status or "not running"
    error = f": {verdict.excerpt[:400]}" if verdict.excerpt else ""
    return ContainerFailure(
        FailureKind.EXITED,
        f"container {st.name or role} is {status} (exit code {st.exit_code}){error}",
    )


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO}


def is_storage_error(exc: BaseException) -> bool:
    """A fault of the data directory (full, read-only, I/O) or of the database."""
    if isinstance(exc, sqlite3.Error):
        return True
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


class Clock(Protocol):
    """Two clocks: ``now`` (the wall clock) for what people read and what is persisted or
    compared with another process's times (the database, the card data's scan times, the
    proxy's); ``monotonic`` for every timeout, deadline, backoff and "since" the engine
    decides on, so that a step of the wall clock neither leaves a hung job untimed nor fails
    a healthy one."""

    def now(self) -> float: ...
    def monotonic(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Result:
    outcome: Outcome
    reason: str


class Pace:
    """The engine's heartbeat (the healthcheck reads its age) and the time the phase in hand
    spent waiting (on containers, on the clock), recorded with its transition."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.heartbeat = clock.now()  # wall clock: shown
        self.heartbeat_mono = clock.monotonic()  # its age is read on this
        self.waited = 0.0

    def beat(self) -> None:
        """The engine is making progress."""
        self.heartbeat = self.clock.now()
        self.heartbeat_mono = self.clock.monotonic()

    def age(self) -> float:
        return max(0.0, self.clock.monotonic() - self.heartbeat_mono)

    async def sleep(self, seconds: float) -> None:
        self.beat()
        await self.clock.sleep(seconds)
        self.beat()

    async def waiting(self, aw: Awaitable[T]) -> T:
        """Await a container stop/start/readiness call, counting its time as waited."""
        start = self.clock.monotonic()
        try:
            return await aw
        finally:
            self.waited += self.clock.monotonic() - start
            self.beat()

    async def pause(self, seconds: float) -> None:
        await self.waiting(self.sleep(seconds))


class CardWatch:
    """The card data as last read: every read goes through here, so that the status, the
    engine and its collaborators see the same latest view."""

    def __init__(self, source: CardSource, llm_names: tuple[str, ...]) -> None:
        self.source = source
        self.llm_names = llm_names
        self.last: CardView | None = None

    async def read(self, newer_than: float | None) -> CardView:
        view = await self.source.read(newer_than)
        self.last = view
        return view

    def others(self) -> str:
        if self.last is None:
            return "unknown"
        others = self.last.others(self.llm_names)
        return "; ".join(describe_client(c.name, c.vram_bytes, c.busy_engines) for c in others) or (
            "none"
        )
