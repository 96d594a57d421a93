"""The steps of a swap, each phase's work on the containers: vLLM stopped (backing off while
Docker refuses) and its memory seen leaving the card; ComfyUI started and seen answering
(backing off while it fails), restarted within its hourly budget, stopped; vLLM seen ready,
its weights read ahead meanwhile. The engine decides when; these do the work."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cardshare.arbiter.common import (
    Alert,
    Alerts,
    Clock,
    ContainerFailure,
    FailureKind,
    Pace,
    Result,
    container_failure,
)
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import ComfyApi, Containers, LlmApi, Rejected, Role, Unavailable
from cardshare.arbiter.jobs import Jobs
from cardshare.arbiter.prewarm import PrewarmReport, prewarm
from cardshare.arbiter.reclaim import Reclaim
from cardshare.arbiter.rules import llm_retry_delay
from cardshare.arbiter.states import Outcome
from cardshare.arbiter.store import Store
from cardshare.arbiter.yielding import YieldingTenants
from cardshare.docker_api import DockerError, docker_time

log = logging.getLogger("cardshare.arbiter")

# comfyui_max_restarts_per_hour counts the restarts of this long
RESTART_WINDOW_SECONDS = 3600.0


@dataclass
class Swaps:
    config: Config
    store: Store
    containers: Containers
    llm: LlmApi
    comfy: ComfyApi
    clock: Clock
    alerts: Alerts
    pace: Pace
    reclaim: Reclaim
    jobs: Jobs
    yielders: YieldingTenants
    phase_since: Callable[[], float]  # when the engine's phase in hand began (wall clock)
    meminfo: Callable[[], int]  # MemAvailable, for the pre-warm
    image_failures: int = 0  # ComfyUI failed to come up, in a row
    image_retry_at: float = 0.0
    image_failure: str = ""
    image_stop_failures: int = 0
    llm_stop_failures: int = 0  # stops of vLLM for a swap that failed, in a row
    llm_stop_retry_at: float = 0.0
    llm_stop_failure: str = ""
    # when ComfyUI was restarted, last hour
    image_restarts: deque[float] = field(default_factory=deque)
    # vLLM's weights read ahead while the last image job runs
    prewarm_task: asyncio.Future[PrewarmReport] | None = None
    prewarm_report: PrewarmReport = field(default_factory=PrewarmReport)

    async def _stop(self, role: Role) -> Result:
        try:
            await self.pace.waiting(self.containers.stop(role, self.config.stop_timeout_seconds))
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return Result(Outcome.FAILED, f"stopping the {role} container failed: {exc}")
        self.alerts.drop(Alert.DOCKER)
        return Result(Outcome.OK, f"{role} container stopped")

    async def _start(self, role: Role) -> Result:
        try:
            await self.pace.waiting(self.containers.start(role))
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return Result(Outcome.FAILED, f"starting the {role} container failed: {exc}")
        self.alerts.drop(Alert.DOCKER)
        return Result(Outcome.OK, f"{role} container started")

    async def stop_llm(self) -> Result:
        result = await self._stop("llm")
        if result.outcome is Outcome.OK:
            self.llm_stop_failures = 0
            self.llm_stop_failure = ""
            self.alerts.drop(Alert.LLM_STOP_FAILED)
            await self._report_llm_gone_before_the_swap()
            return result
        # back to serving, and the next swap backs off: a stop Docker keeps refusing was tried
        # again at every poll (and its alert came and went with each try)
        self.llm_stop_failures += 1
        self.llm_stop_failure = result.reason
        delay = llm_retry_delay(
            self.llm_stop_failures,
            self.config.llm_retry_backoff_seconds,
            self.config.llm_retry_backoff_max_seconds,
        )
        self.llm_stop_retry_at = self.clock.monotonic() + delay
        self.alerts.set(
            Alert.LLM_STOP_FAILED,
            f"vLLM could not be stopped for a swap to image {self.llm_stop_failures} time(s) in "
            f"a row (last: {result.reason}); it keeps serving, next try in {delay:g} s; "
            f"{self.store.queue_length()} job(s) kept queued",
        )
        return result

    async def _report_llm_gone_before_the_swap(self) -> None:
        """A vLLM that exited before this swap began (a crash between the serving loop's last
        look and the decision to swap) is reported, not absorbed by the swap's own stop. Read
        after the stop, which waits for the exit, so an exit the engine had not taken in yet
        is seen too; Docker's FinishedAt is the time the process exited. One that exited after
        the phase began was stopped by this phase (also a swap resumed after a restart of the
        arbiter) and is not reported."""
        try:
            st = await self.pace.waiting(self.containers.state("llm"))
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return
        finished = docker_time(st.finished_at)
        if st.running or finished is None or finished >= self.phase_since():
            return
        self.reclaim.llm_failures += 1
        self.alerts.set(
            Alert.LLM_NOT_READY,
            f"vLLM stopped while serving, before the swap to image: container "
            f"{st.name or 'llm'} exited with code {st.exit_code}; "
            "it starts again when the card comes back",
        )

    async def wait_llm_release(self) -> Result:
        return await self.reclaim.wait_release(
            self.config.llm_names,
            self.config.llm_release_timeout_seconds,
            Alert.LLM_RELEASE_TIMEOUT,
        )

    def _image_failed(self, result: Result) -> Result:
        """ComfyUI did not come up: count it, and back the next swap to image off."""
        self.image_failures += 1
        self.image_failure = result.reason
        delay = llm_retry_delay(
            self.image_failures,
            self.config.image_retry_backoff_seconds,
            self.config.image_retry_backoff_max_seconds,
        )
        self.image_retry_at = self.clock.monotonic() + delay
        if self.image_failures >= 2:
            self.alerts.set(
                Alert.IMAGE_START_FAILED,
                f"ComfyUI failed to come up {self.image_failures} times in a row "
                f"(last: {result.reason}); next try in {delay:g} s; "
                f"{self.store.queue_length()} job(s) kept queued",
            )
        return result

    async def start_image(self) -> Result:
        result = await self._start("image")
        if result.outcome is Outcome.FAILED:
            self.alerts.set(Alert.IMAGE_NOT_READY, result.reason)
            return self._image_failed(result)
        return result

    async def wait_image_ready(self) -> Result:
        deadline = self.clock.monotonic() + self.config.image_ready_timeout_seconds
        while True:
            if await self.pace.waiting(self.comfy.ready()):
                self.alerts.drop(
                    Alert.IMAGE_NOT_READY,
                    Alert.IMAGE_OOM_KILLED,
                    Alert.IMAGE_START_FAILED,
                    Alert.IMAGE_RESTART_LIMIT,
                )
                self.image_failures = 0
                self.image_failure = ""
                self.jobs.comfy_unanswered = 0
                self.reclaim.comfy_signature = None  # a new process: no models loaded
                return Result(Outcome.OK, "ComfyUI answers /object_info")
            failure = await self.pace.waiting(
                container_failure(self.containers, "image", self.alerts)
            )
            if failure is not None and failure.kind is not FailureKind.UNKNOWN:
                name = (
                    Alert.IMAGE_OOM_KILLED
                    if failure.kind is FailureKind.OOM_KILLED
                    else Alert.IMAGE_NOT_READY
                )
                self.alerts.set(name, f"ComfyUI did not start: {failure.message}")
                return self._image_failed(
                    Result(Outcome.FAILED, f"ComfyUI did not start: {failure.message}")
                )
            if self.clock.monotonic() >= deadline:
                message = (
                    f"ComfyUI did not answer /object_info within "
                    f"{self.config.image_ready_timeout_seconds:g} s"
                )
                self.alerts.set(Alert.IMAGE_NOT_READY, message)
                return self._image_failed(Result(Outcome.TIMEOUT, message))
            await self.pace.pause(self.config.poll_interval_seconds)

    def maybe_prewarm(self) -> None:
        """Start reading vLLM's weights once per image period: with the last job (or at the
        handback when jobs are left for later)."""
        if not self.config.prewarm_paths or self.prewarm_task is not None:
            return
        self.prewarm_report = PrewarmReport()
        self.prewarm_task = asyncio.ensure_future(
            prewarm(
                [Path(p) for p in self.config.prewarm_paths],
                self.config.prewarm_margin_bytes,
                self.meminfo,
                self.prewarm_report,
            )
        )

    def _end_prewarm(self) -> None:
        if self.prewarm_task is not None and not self.prewarm_task.done():
            self.prewarm_task.cancel()
        self.prewarm_task = None

    def _restart_budget(self) -> Result | None:
        """None when ComfyUI may be restarted once more this hour (the restart is counted);
        else the card goes back to vLLM, alerted, and no swap to image starts until the
        oldest restart of the hour is an hour old: a fault that restarts do not cure (a
        ``/view`` that keeps failing) never keeps the card in image mode restarting."""
        now = self.clock.monotonic()
        while self.image_restarts and now - self.image_restarts[0] >= RESTART_WINDOW_SECONDS:
            self.image_restarts.popleft()
        limit = self.config.comfyui_max_restarts_per_hour
        if len(self.image_restarts) < limit:
            self.image_restarts.append(now)
            return None
        wait = self.image_restarts[0] + RESTART_WINDOW_SECONDS - now
        message = (
            f"ComfyUI was restarted {len(self.image_restarts)} times in the last hour "
            f"(comfyui_max_restarts_per_hour {limit}): a fault that restarts do not cure; the "
            f"card goes back to vLLM, {self.store.queue_length()} job(s) kept queued, the next "
            f"swap to image in {wait:.0f} s"
        )
        self.alerts.set(Alert.IMAGE_RESTART_LIMIT, message)
        self.image_failures = max(self.image_failures, 1)
        self.image_retry_at = now + wait
        self.image_failure = f"{limit} restarts of ComfyUI in the last hour"
        return Result(Outcome.FAILED, message)

    async def restart_image(self) -> Result:
        """Restart means restart: interrupt the running prompt, clear ComfyUI's queue,
        restart the container and prove it by a new start time."""
        spent = self._restart_budget()
        if spent is not None:
            return spent
        for call in (self.comfy.interrupt, self.comfy.clear_queue):
            try:
                await self.pace.waiting(call())
            except (Unavailable, Rejected) as exc:  # a dead ComfyUI answers neither
                log.info("before the restart: %s", exc)
        try:
            before = (await self.containers.state("image")).started_at
            await self.pace.waiting(
                self.containers.restart("image", self.config.stop_timeout_seconds)
            )
            after = await self.containers.state("image")
            self.alerts.drop(Alert.DOCKER)
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return self._image_failed(
                Result(Outcome.FAILED, f"restarting the image container failed: {exc}")
            )
        if not after.running or (before and after.started_at == before):
            return self._image_failed(
                Result(
                    Outcome.FAILED,
                    f"ComfyUI did not restart (running {after.running}, started at "
                    f"{after.started_at or '?'}, before {before or '?'})",
                )
            )
        self.jobs.comfy_unanswered = 0
        return Result(Outcome.OK, f"ComfyUI restarted (started at {after.started_at})")

    async def stop_image(self) -> Result:
        self.maybe_prewarm()
        delay = llm_retry_delay(
            self.image_stop_failures,
            self.config.llm_retry_backoff_seconds,
            self.config.llm_retry_backoff_max_seconds,
        )
        if delay:
            await self.pace.pause(delay)
        result = await self._stop("image")
        if result.outcome is Outcome.FAILED:
            self.image_stop_failures += 1
            self.alerts.set(
                Alert.IMAGE_STOP_FAILED,
                f"ComfyUI could not be stopped ({self.image_stop_failures} tries): "
                f"{result.reason}; vLLM stays stopped until it is",
            )
        else:
            self.image_stop_failures = 0
            self.alerts.drop(Alert.IMAGE_STOP_FAILED)
        return result

    async def wait_image_release(self) -> Result:
        return await self.reclaim.wait_release(
            self.config.image_names,
            self.config.image_release_timeout_seconds,
            Alert.IMAGE_RELEASE_TIMEOUT,
        )

    async def wait_llm_ready(self) -> Result:
        deadline = self.clock.monotonic() + self.config.llm_ready_timeout_seconds
        last = "no answer yet"
        while True:
            try:
                await self.pace.waiting(self.llm.health())
                await self.pace.waiting(self.llm.one_token())
            except (Unavailable, Rejected) as exc:
                last = str(exc)
            else:
                self.reclaim.llm_failures = 0
                self.reclaim.llm_vram_failures = 0
                self.reclaim.plan_next = None
                self._end_prewarm()
                await self.yielders.resume()
                self.alerts.drop(
                    Alert.LLM_NOT_READY,
                    Alert.LLM_INSUFFICIENT_VRAM,
                    Alert.LLM_OOM_KILLED,
                    Alert.IMAGE_RELEASE_TIMEOUT,  # vLLM got its memory: the release is moot
                )
                return Result(Outcome.OK, "vLLM /health is 200 and a one-token completion passed")
            failure = await self.pace.waiting(
                container_failure(self.containers, "llm", self.alerts)
            )
            if failure is not None and failure.kind is not FailureKind.UNKNOWN:
                return await self._llm_start_failed(failure)
            if self.clock.monotonic() >= deadline:
                self.reclaim.llm_failures += 1
                message = (
                    f"vLLM not ready within {self.config.llm_ready_timeout_seconds:g} s "
                    f"(attempt {self.reclaim.llm_failures}; last: {last}); restarting it"
                )
                self.alerts.set(Alert.LLM_NOT_READY, message)
                return Result(Outcome.TIMEOUT, message)
            await self.pace.pause(self.config.poll_interval_seconds)

    async def _llm_start_failed(self, failure: ContainerFailure) -> Result:
        self.reclaim.llm_failures += 1
        if failure.kind is FailureKind.OOM_KILLED:
            self.alerts.set(Alert.LLM_OOM_KILLED, failure.message)
        elif failure.kind is FailureKind.INSUFFICIENT_VRAM:
            return await self.reclaim.vram_pass(failure)
        else:
            self.alerts.set(Alert.LLM_NOT_READY, f"vLLM stopped while starting: {failure.message}")
        return Result(Outcome.FAILED, f"vLLM failed to start: {failure.message}")
