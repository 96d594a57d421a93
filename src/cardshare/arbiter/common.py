"""The arbiter's shared vocabulary: the alerts, why a container is not running, a phase
action's result and the clocks. A leaf: the engine and its collaborators import it, it
imports none of them."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from cardshare.arbiter.states import Outcome


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
