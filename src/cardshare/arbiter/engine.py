"""The arbiter's engine: runs the current phase's action, then takes the transition the
table gives for its outcome, persisting it first.

Decisions come from :mod:`cardshare.arbiter.rules` and :mod:`cardshare.arbiter.resume`;
this module only gathers observations and acts through the edges.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import shutil
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cardshare.arbiter.cardview import CardDataError, CardSource, CardView
from cardshare.arbiter.common import (
    Alert,
    Alerts,
    CardWatch,
    Clock,
    ContainerFailure,
    FailureKind,
    Pace,
    RealClock,
    Result,
    container_failure,
    is_storage_error,
)
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import (
    ComfyApi,
    Containers,
    LlmApi,
    ProxyApi,
    Rejected,
    Role,
    Unavailable,
    YieldingApi,
)
from cardshare.arbiter.plans import (
    Tenant,
    tenants,
    workflow_signature,
)
from cardshare.arbiter.prewarm import PrewarmReport, prewarm, read_meminfo
from cardshare.arbiter.reclaim import Reclaim
from cardshare.arbiter.resume import (
    JobStep,
    history_error,
    history_images,
    history_is_jobs,
    plan_job_step,
    plan_resume,
    save_nodes,
    save_prefix,
    saved_file_name,
    saver_extension,
)
from cardshare.arbiter.rules import (
    Decision,
    HandbackObservations,
    LlmActivity,
    MetricsError,
    ProxyState,
    SwapObservations,
    llm_retry_delay,
    parse_proxy_state,
    parse_vllm_metrics,
    should_hand_back,
    should_swap_to_image,
    update_activity,
)
from cardshare.arbiter.states import (
    HANDBACK_PHASES,
    MODE_OF,
    Mode,
    Outcome,
    Phase,
    next_phase,
)
from cardshare.arbiter.store import Job, JobState, MachineState, Store, job_dir
from cardshare.arbiter.yielding import YieldingTenants
from cardshare.atomicfile import write_atomic
from cardshare.docker_api import ContainerState, DockerError, docker_time
from cardshare.errors import (
    VRAM_MAX_ATTEMPTS,
    is_insufficient_vram_error,
)

log = logging.getLogger("cardshare.arbiter")


class _NotAnImage(Unavailable):
    """ComfyUI answered a fetch of a saved output with something that is not an image."""


T = TypeVar("T")


def _crashed(st: ContainerState) -> bool:
    """An exit no stop asked for: killed by the kernel's OOM killer, or any exit code but 0
    and 143 (SIGTERM, what ``docker stop`` sends first)."""
    return st.oom_killed or st.exit_code not in (0, 143)


@dataclass
class Engine:
    config: Config
    store: Store
    containers: Containers
    llm: LlmApi
    comfy: ComfyApi
    card: CardSource
    proxy: ProxyApi | None = None
    clock: Clock = field(default_factory=RealClock)
    yielding: YieldingApi | None = None
    meminfo: Callable[[], int] = read_meminfo  # MemAvailable, for the pre-warm

    def __post_init__(self) -> None:
        now = self.clock.now()
        self.state: MachineState = self.store.machine(now)
        # persisted wall-clock times (image mode's start, a hold's end) on the monotonic
        # clock, each converted once, when first seen by this process
        self._mono_of: dict[float, float] = {}
        # conservative start: vLLM must be seen idle for idle_seconds from now (monotonic)
        self.activity = LlmActivity(last_active_at=self.clock.monotonic())
        self.alerts = Alerts()
        self.faults = self.alerts.raised  # alerts raised, by name, since the start
        self.pace = Pace(self.clock)  # the heartbeat, and the time a phase waited
        self.watch = CardWatch(self.card, self.config.llm_names)
        self.last_decision = Decision(False, ("not evaluated yet",))
        self.current_job: str | None = None
        self.image_failures = 0  # ComfyUI failed to come up, in a row
        self.image_retry_at = 0.0
        self.image_failure = ""
        self.image_stop_failures = 0
        self.llm_stop_failures = 0  # stops of vLLM for a swap that failed, in a row
        self.llm_stop_retry_at = 0.0
        self.llm_stop_failure = ""
        self.comfy_unanswered = 0
        self.image_restarts: deque[float] = deque()  # when ComfyUI was restarted, last hour
        self.pending_restart: str | None = None  # a failed poison job may still run there
        self.storage_paused: str | None = None  # why the data directory cannot take jobs
        # a move toward vLLM taken while the database could not be written: the state in
        # memory is ahead of the database's until storage works again
        self.unwritten: str | None = None
        self.database_lost: str | None = None  # the database file deleted or replaced
        self.alive = False
        self.step_errors = 0  # failed steps in a row (backoff)
        self._step_job: str | None = None
        self.wake = asyncio.Event()
        # ComfyUI's largest VRAM seen during the job in hand
        self.job_peak = 0
        self.job_peak_since = 0.0  # when the running prompt was submitted (its samples after)
        self.yielders = YieldingTenants(
            self.config, self.yielding, self.clock, self.pace, self.watch
        )
        self.reclaim = Reclaim(
            self.config,
            self.store,
            self.containers,
            self.comfy,
            self.clock,
            self.alerts,
            self.pace,
            self.watch,
            self.yielders,
            lambda: self.state.phase_since,
        )
        # vLLM's weights read ahead while the last image job runs
        self.prewarm_task: asyncio.Future[PrewarmReport] | None = None
        self.prewarm_report = PrewarmReport()
        self.containers.use("llm", self.config.plan_container(0))

    # -- helpers -------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return MODE_OF[self.state.phase]

    def mono(self, wall: float, past: bool = True) -> float:
        """A persisted wall-clock time on the monotonic clock: converted once, by its
        distance from the wall clock's now, when this process first sees it (a time across a
        restart of the arbiter cannot be monotonic); ``past``: a "since", never later than
        now (the wall clock stepped back meanwhile)."""
        found = self._mono_of.get(wall)
        if found is None:
            found = self.clock.monotonic() - (self.clock.now() - wall)
            if past:
                found = min(found, self.clock.monotonic())
            if len(self._mono_of) > 64:
                self._mono_of.clear()
            self._mono_of[wall] = found
        return found

    def as_wall(self, mono: float) -> float:
        """A monotonic time as the wall clock shows it now (for rules that weigh it against
        times of other processes: the proxy's requests, the card's scans)."""
        return self.clock.now() - (self.clock.monotonic() - mono)

    def healthy(self) -> tuple[bool, str]:
        if not self.alive:
            return False, "the engine is not running"
        if self.database_lost is not None:
            return False, (
                f"{self.database_lost}: restart the arbiter to open the database at that "
                "path again (a missing one is refused at the start, naming the fix)"
            )
        age = self.pace.age()
        if age > self.config.heartbeat_stale_seconds:
            return False, (
                f"the engine's heartbeat is {age:.0f} s old "
                f"(heartbeat_stale_seconds {self.config.heartbeat_stale_seconds:g})"
            )
        return True, f"heartbeat {age:.1f} s ago"

    def transition(self, outcome: Outcome, reason: str) -> None:
        to = next_phase(self.state.phase, outcome)
        self._move(to, outcome, reason)

    def _move(self, to: Phase, outcome: Outcome, reason: str) -> None:
        log.info("%s -> %s (%s): %s", self.state.phase, to, outcome, reason)
        now = self.clock.now()
        try:
            self.state = self.store.transition(
                to, outcome, reason, now, waited_seconds=self.pace.waited
            )
        except Exception as exc:
            if not is_storage_error(exc) or to not in SAFE_WITHOUT_STORE:
                raise
            # the way back to vLLM never waits for the disk: taken in memory (the database's
            # phase converges on a restart, as after a kill), written once storage works
            self.unwritten = f"{to} ({outcome}: {reason})"[:300]
            self.alerts.set(
                Alert.STORAGE,
                f"the database cannot be written ({type(exc).__name__}: {exc}); the card goes "
                "back to vLLM without it, jobs are paused and new ones refused until it works",
            )
            mode_since = self.state.mode_since if MODE_OF[to] is self.mode else now
            self.state = MachineState(to, now, mode_since, self.state.swap_id, None)
        self.pace.waited = 0.0

    async def _write_state(self) -> None:
        """Storage works again: the state taken in memory goes into the database."""
        if self.unwritten is None:
            return
        self.state = self.store.transition(
            self.state.phase,
            Outcome.RESUME,
            f"storage works again; taken while it failed: {self.unwritten}",
            self.clock.now(),
        )
        log.info("storage works again: phase %s written", self.state.phase)
        self.unwritten = None

    async def _proxy_state(self) -> tuple[ProxyState | None, str | None]:
        if self.proxy is None:
            return None, None
        try:
            return parse_proxy_state(await self.proxy.state()), None
        except (Unavailable, Rejected, ValueError) as exc:
            return None, str(exc)

    def tenants(self) -> list[Tenant]:
        """The card's clients by kind, from the last card data."""
        if self.watch.last is None:
            return []
        return tenants(
            self.watch.last,
            self.config.llm_names + self.config.image_names,
            self.config.resident_client_names,
            self.config.yielding_client_names,
        )

    # -- holds (a role's probe asks the arbiter not to swap meanwhile) ----------------------

    def hold_swaps(self, holder: str, seconds: float) -> float | None:
        """Hold swaps to image for ``seconds``; the hold's end, or None when the card is not
        the LLM's at rest (mid-swap, image mode, or a job in hand)."""
        if self.state.phase is not Phase.SERVE_LLM or self.current_job is not None:
            return None
        until = self.clock.now() + seconds
        self.store.set_hold(holder, until)
        self._mono_of[until] = self.clock.monotonic() + seconds
        log.info("swaps held by %s for %g s", holder, seconds)
        return until

    def release_hold(self) -> bool:
        return self.store.clear_hold()

    def active_hold(self) -> tuple[str, float] | None:
        """(holder, until) of a hold that has not expired; an expired one is dropped."""
        hold = self.store.hold()
        if hold is not None and self.clock.monotonic() >= self.mono(hold[1], past=False):
            self.store.clear_hold()
            return None
        return hold

    def held_by(self) -> str | None:
        hold = self.active_hold()
        return None if hold is None else hold[0]

    # -- storage ---------------------------------------------------------------------------

    def storage_problem(self) -> str | None:
        """Why the data directory cannot take jobs now (too little free space), else None."""
        try:
            free = shutil.disk_usage(self.config.data_dir).free
        except OSError as exc:
            return f"cannot read the free space of {self.config.data_dir}: {exc.strerror}"
        if free < self.config.min_free_bytes:
            return (
                f"{self.config.data_dir} has {free / 2**20:.0f} MiB free "
                f"(min_free_bytes {self.config.min_free_bytes / 2**20:.0f} MiB): free space there"
            )
        return None

    def _probe_storage(self) -> str | None:
        """Write, sync and remove a small file: None when the data directory works."""
        problem = self.storage_problem()
        if problem is not None:
            return problem
        probe = self.config.data_dir / ".storage-probe"
        try:
            write_atomic(probe, b"ok\n", make_parents=True)
            probe.unlink()
        except OSError as exc:
            return f"cannot write to {self.config.data_dir}: {exc.strerror or exc}"
        try:
            self.store.probe_write(self.clock.now())
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            return f"cannot write the database {self.store.path}: {type(exc).__name__}: {exc}"
        return None

    # -- resume ----------------------------------------------------------------------------

    async def resume(self) -> bool:
        """Converge the persisted phase with the containers' real states; False when the
        containers cannot be inspected (the caller retries)."""
        try:
            await self.reclaim.find_running_plan()
            llm = await self.containers.state("llm")
            image_running = (await self.containers.state("image")).running
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return False
        self.alerts.drop(Alert.DOCKER)
        llm_running = llm.running
        if self.state.phase is Phase.SERVE_LLM and not llm_running and _crashed(llm):
            # the LLM died while it was the card's owner (while the arbiter was away, or as it
            # came up): reported, not quietly started again
            self.reclaim.llm_failures += 1
            self.alerts.set(
                Alert.LLM_NOT_READY,
                f"vLLM stopped while serving (found as the arbiter started): container "
                f"{llm.name or 'llm'} exited with code {llm.exit_code}"
                f"{', OOMKilled' if llm.oom_killed else ''}; starting it again",
            )
        plan = plan_resume(
            self.state.phase,
            llm_running,
            image_running,
            self.store.queue_length(),
            held=self.held_by() is not None,
        )
        if plan.phase is not self.state.phase:
            self._move(plan.phase, Outcome.RESUME, f"resume: {plan.reason}")
        else:
            log.info("resume in %s: %s", self.state.phase, plan.reason)
        return True

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> None:
        """Run the current phase's action once; transition on its outcome. While the data
        directory fails, a swap to image is abandoned for the way back to vLLM."""
        abort = STORAGE_ABORTS.get(self.state.phase)
        if abort is not None and self.storage_paused is not None:
            self.transition(abort, f"the data directory fails: {self.storage_paused}")
            return
        action = PHASE_ACTIONS[self.state.phase]
        result = await action(self)
        if result is not None:
            self.transition(result.outcome, result.reason)

    async def guarded(self, call: Callable[[], Awaitable[Any]]) -> bool:
        """Run one engine call under the guard: an error is logged, alerted and counted,
        never the end of the loop. True when the call went through."""
        self._step_job = None
        phase = self.state.phase
        try:
            await call()
        except asyncio.CancelledError:
            raise
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
        except Exception as exc:
            if is_storage_error(exc):
                self.alerts.set(
                    Alert.STORAGE,
                    f"the data directory failed in {phase}: {type(exc).__name__}: {exc}; "
                    "jobs are paused and new ones refused until it works again",
                )
            else:
                log.exception("unexpected error in phase %s", phase)
                self.faults["engine_error_steps"] += 1
                self.alerts.set(Alert.ENGINE_ERROR, f"{type(exc).__name__} in {phase}: {exc}"[:500])
                self._poison(exc)
        else:
            # the Docker alert clears on a Docker call that works (not on any step)
            self.step_errors = 0
            self.alerts.drop(Alert.ENGINE_ERROR)
            return True
        self.step_errors += 1
        return False

    def _poison(self, exc: Exception) -> None:
        """Count the error against the job in hand; fail it after job_max_errors."""
        if self._step_job is None:
            return
        reason = f"the arbiter failed on this job: {type(exc).__name__}: {exc}"[:500]
        try:
            job = self.store.engine_error(self._step_job, reason)
            if job.errors >= self.config.job_max_errors and job.state is JobState.RUNNING:
                self._finish(job, JobState.FAILED, f"{reason} ({job.errors} times; gave up)")
                # its prompt may still run in ComfyUI: restart ComfyUI before the next job
                self.pending_restart = f"job {job.id} failed by the arbiter's errors"
        except Exception:  # the database itself fails: the storage guard catches it next
            log.exception("cannot record the error against job %s", self._step_job)

    def _backoff(self) -> float:
        return llm_retry_delay(
            self.step_errors,
            self.config.poll_interval_seconds,
            self.config.engine_backoff_max_seconds,
        )

    async def run(self, stop: asyncio.Event) -> None:
        self.alive = True
        self.pace.beat()
        try:
            while not stop.is_set():
                ok = await self.guarded(self.resume)
                if ok and Alert.DOCKER not in self.alerts:
                    break
                await self.pace.sleep(self._backoff() or self.config.poll_interval_seconds)
            while not stop.is_set():
                self.pace.beat()
                # a storage fault pauses the jobs, not the machine: the card goes back to
                # vLLM, and no swap to image starts until the data directory works again
                # the database file's identity, with every heartbeat: one deleted or replaced
                # under the arbiter is not noticed by SQLite, which writes on into the old one
                self.database_lost = self.store.identity_problem()
                problem = self.database_lost or (
                    self._probe_storage()
                    if Alert.STORAGE in self.alerts
                    else self.storage_problem()
                )
                self.storage_paused = problem
                if problem is not None:
                    self.alerts.set(
                        Alert.STORAGE, f"{problem}; jobs are paused and new ones refused"
                    )
                elif self.unwritten is None or await self.guarded(self._write_state):
                    self.alerts.drop(Alert.STORAGE)
                if not await self.guarded(self.step):
                    await self.pace.sleep(self._backoff())
        finally:
            self.alive = False

    async def _idle_wait(self) -> None:
        """Sleep a poll interval, or less when a job arrives."""
        self.wake.clear()
        self.pace.beat()
        sleeper = asyncio.ensure_future(self.clock.sleep(self.config.poll_interval_seconds))
        waker = asyncio.ensure_future(self.wake.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waker):
                task.cancel()
        self.pace.beat()

    # -- observations ------------------------------------------------------------------------

    async def observe_for_swap(self) -> SwapObservations:
        now = self.clock.now()
        metrics_error: str | None = None
        activity: LlmActivity | None = None
        try:
            metrics = parse_vllm_metrics(await self.llm.metrics())
        except (Unavailable, Rejected, MetricsError) as exc:
            metrics_error = str(exc)
        else:
            self.activity = update_activity(self.activity, metrics, self.clock.monotonic())
            activity = dataclasses.replace(
                self.activity, last_active_at=self.as_wall(self.activity.last_active_at)
            )
        queue_length = self.store.queue_length()
        proxy, proxy_error = await self._proxy_state()
        card: CardView | None = None
        card_error: str | None = None
        if queue_length > 0:
            try:
                card = await self.watch.read(self.yielders.card_floor(now))
            except CardDataError as exc:
                card_error = str(exc)
                self.alerts.set(Alert.CARD_DATA, card_error)
            else:
                age = card.age(now)
                if age > self.config.card_data_max_age_seconds:
                    self.alerts.set(
                        Alert.CARD_DATA,
                        f"card data is {age:.0f} s old even after a fresh scan (max "
                        f"{self.config.card_data_max_age_seconds:g} s): is the recorder running?",
                    )
                else:
                    self.alerts.drop(Alert.CARD_DATA)
        elif (
            self.watch.last is None or self.watch.last.age(now) > self.config.poll_interval_seconds
        ):
            # idle: the status shows the recorder's latest data (its file only: no fresh scan,
            # which would wake the card)
            try:
                await self.watch.read(None)
            except CardDataError as exc:
                log.debug("card data for the status: %s", exc)
        return SwapObservations(
            queue_length=queue_length,
            activity=activity,
            metrics_error=metrics_error,
            proxy=proxy,
            proxy_error=proxy_error,
            card=card,
            card_error=card_error,
            held_by=self.held_by(),
            storage_problem=self.storage_paused,
            image_retry_in=(
                (self.image_retry_at - self.clock.monotonic()) if self.image_failures else None
            ),
            image_failure=self.image_failure or None,
            llm_stop_retry_in=(
                (self.llm_stop_retry_at - self.clock.monotonic())
                if self.llm_stop_failures
                else None
            ),
            llm_stop_failure=self.llm_stop_failure or None,
            next_job_peak=self._next_job_peak() if queue_length > 0 else None,
            paused=frozenset(
                n for n, until in self.yielders.paused.items() if until > self.clock.monotonic()
            ),
        )

    def _next_job_peak(self) -> int | None:
        job = self.store.next_job()
        if job is None:
            return None
        return self.store.workflow_peak(workflow_signature(job.workflow))

    # -- phase actions -----------------------------------------------------------------------

    async def _serve_llm(self) -> Result | None:
        began = self.clock.now()
        obs = await self.observe_for_swap()
        if obs.metrics_error is not None:
            # vLLM does not answer: exited (or killed) while serving? then start it again
            failure = await container_failure(self.containers, "llm", self.alerts)
            if failure is not None and failure.kind is not FailureKind.UNKNOWN:
                self.reclaim.llm_failures += 1
                self.alerts.set(
                    Alert.LLM_NOT_READY, f"vLLM stopped while serving: {failure.message}"
                )
                return Result(Outcome.FAILED, f"vLLM stopped while serving: {failure.message}")
        if obs.queue_length == 0:  # nothing waits for a swap: a past release alert is stale
            self.alerts.drop(Alert.LLM_RELEASE_TIMEOUT, Alert.LLM_STOP_FAILED)
            self.llm_stop_failures = 0
        self.last_decision = should_swap_to_image(obs, self.config, self.clock.now())
        if self.last_decision.go:
            obs = await self._confirm_card(obs, began)
            self.last_decision = should_swap_to_image(obs, self.config, self.clock.now())
        if self.last_decision.go:
            return Result(Outcome.SWAP, "; ".join(self.last_decision.reasons))
        if obs.queue_length > 0 and self.yielders.in_the_way(obs):
            await self.yielders.pause("a swap to image: jobs are queued")
        elif obs.queue_length == 0 and self.yielders.paused:
            await self.yielders.resume()
        if self.reclaim.plan_index > 0:
            restore = await self.reclaim.restore_plan(obs)
            if restore is not None:
                return restore
        await self._idle_wait()
        return None

    async def _confirm_card(self, obs: SwapObservations, since: float) -> SwapObservations:
        """The card as it is now, before the whole card is taken.

        The data a swap is weighed on may be up to ``card_data_max_age_seconds`` old (each
        scan wakes the card, so polls do not scan), and a client that arrived since (a Plex
        transcode) is not in it.  Data scanned before this evaluation began is scanned again;
        a failed scan leaves the card unknown, which keeps the swap from going.
        """
        if obs.card is None or obs.card.scanned_at >= since:
            return obs
        try:
            card = await self.watch.read(since)
        except CardDataError as exc:
            self.alerts.set(Alert.CARD_DATA, str(exc))
            return dataclasses.replace(obs, card=None, card_error=str(exc))
        return dataclasses.replace(obs, card=card)

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

    async def _stop_llm(self) -> Result:
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
        if st.running or finished is None or finished >= self.state.phase_since:
            return
        self.reclaim.llm_failures += 1
        self.alerts.set(
            Alert.LLM_NOT_READY,
            f"vLLM stopped while serving, before the swap to image: container "
            f"{st.name or 'llm'} exited with code {st.exit_code}; "
            "it starts again when the card comes back",
        )

    async def _wait_llm_release(self) -> Result:
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

    async def _start_image(self) -> Result:
        result = await self._start("image")
        if result.outcome is Outcome.FAILED:
            self.alerts.set(Alert.IMAGE_NOT_READY, result.reason)
            return self._image_failed(result)
        return result

    async def _wait_image_ready(self) -> Result:
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
                self.comfy_unanswered = 0
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

    def _maybe_prewarm(self) -> None:
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

    async def _run_jobs(self) -> Result | None:
        if self.store.queue_length() <= 1:
            self._maybe_prewarm()
        if self.yielders.paused:
            await self.yielders.pause("image jobs run")  # renews a lease past its half
        if self.storage_paused is not None:
            return Result(
                Outcome.HAND_BACK, f"jobs paused, the data directory fails: {self.storage_paused}"
            )
        if self.pending_restart is not None:
            reason, self.pending_restart = self.pending_restart, None
            return Result(Outcome.RESTART, f"restart ComfyUI: {reason}")
        proxy, _ = await self._proxy_state()
        # image mode's start is persisted (wall clock): its age is taken on the monotonic clock
        image_since = self.as_wall(self.mono(self.state.image_since or self.state.phase_since))
        decision = should_hand_back(
            HandbackObservations(
                queue_length=self.store.queue_length(),
                image_since=image_since,
                job_running=False,
                proxy=proxy,
            ),
            self.config,
            self.clock.now(),
        )
        self.last_decision = decision
        if decision.go:
            return Result(Outcome.HAND_BACK, "; ".join(decision.reasons))
        job = self.store.next_job()
        if job is None:  # cancelled in between
            return None
        self.current_job = job.id
        self._step_job = job.id
        try:
            return await self.run_job(job)
        finally:
            self.current_job = None

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

    async def _restart_image(self) -> Result:
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
        self.comfy_unanswered = 0
        return Result(Outcome.OK, f"ComfyUI restarted (started at {after.started_at})")

    async def _stop_image(self) -> Result:
        self._maybe_prewarm()
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

    async def _wait_image_release(self) -> Result:
        return await self.reclaim.wait_release(
            self.config.image_names,
            self.config.image_release_timeout_seconds,
            Alert.IMAGE_RELEASE_TIMEOUT,
        )

    async def _wait_llm_ready(self) -> Result:
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

    # -- jobs ------------------------------------------------------------------------------

    async def run_job(self, job: Job) -> Result | None:
        """Drive one job to an end (done/failed/cancelled) or ask for a ComfyUI restart.

        Exactly once: a prompt is posted again only when it is provably in neither ComfyUI's
        queue nor its history and none of the job's files are on disk.
        """
        deadline = self.clock.monotonic() + self.config.job_timeout_seconds
        while True:
            self.pace.beat()
            current = self.store.job(job.id)
            if current is None or current.state not in (JobState.QUEUED, JobState.RUNNING):
                return None  # ended meanwhile (a poison job failed by the guard)
            job = current
            if job.cancel_requested:
                return await self._cancel_running(job)
            if job.saved is not None:  # it ran: fetch its files, never run it again
                ended, result = await self._fetch_saved(job)
                if not ended:
                    continue
                return result
            subfolder = save_prefix(job.id, 0)[0]
            try:
                # found by its own files' subfolder, not only by the id ComfyUI answered
                queued = (
                    await self.comfy.queued(job.prompt_id, subfolder) if job.prompt_id else None
                )
                in_queue = queued is not None
                history = (
                    await self.comfy.history(job.prompt_id)
                    if job.prompt_id and not in_queue
                    else None
                )
            except (Unavailable, Rejected) as exc:
                died = await self._comfy_unanswered(job, str(exc))
                if died is not None:
                    return died
                await self.pace.sleep(self.config.poll_interval_seconds)
                continue
            self.comfy_unanswered = 0
            if queued is not None and queued != job.prompt_id:
                log.warning("job %s: its prompt is queued as %s in ComfyUI", job.id, queued)
                job = self.store.set_prompt_id(job.id, queued)
            if history is not None and not history_is_jobs(history, subfolder):
                log.warning(
                    "job %s: ComfyUI's history of %s is another prompt's: not taken",
                    job.id,
                    job.prompt_id,
                )
                history = None
            step = plan_job_step(job.prompt_id, in_queue, history)
            if step is JobStep.FETCH_OUTPUTS:
                assert history is not None
                return await self._fetch_outputs(job, history)
            if step is JobStep.FAILED:
                assert history is not None
                return await self._job_error(job, history_error(history))
            if step in (JobStep.NEW_ATTEMPT, JobStep.LOOK_ON_DISK):
                try:
                    found = await self._outputs_on_disk(job)
                except (Unavailable, Rejected) as exc:
                    return await self._comfy_died(job, f"looking for its files failed: {exc}")
                if found:
                    self._store_outputs(job, found, "found on disk")
                    return None
                if step is JobStep.NEW_ATTEMPT:
                    if job.attempts >= self.config.job_max_attempts:
                        self._finish(
                            job,
                            JobState.FAILED,
                            f"gave up after {job.attempts} attempt(s): {job.reason or 'no reason'}",
                        )
                        return None
                    job = self.store.start_attempt(job.id, str(uuid.uuid4()), self.clock.now())
                assert job.prompt_id is not None
                await self.reclaim.reclaim_for(job)
                self.job_peak = 0
                self.job_peak_since = self.clock.now()
                try:
                    workflow = await self._prepare(job)
                    got = await self.comfy.submit(workflow, job.prompt_id)
                except Rejected as exc:
                    self._finish(job, JobState.FAILED, _rejection(exc))
                    return None
                except Unavailable as exc:
                    return await self._comfy_died(job, str(exc))
                if got != job.prompt_id:
                    job = self._answered_id(job, got)
                continue
            # POLL
            await self._sample_job_peak()
            if self.clock.monotonic() >= deadline:
                self._finish(
                    job,
                    JobState.FAILED,
                    "not finished within job_timeout_seconds "
                    f"({self.config.job_timeout_seconds:g})",
                )
                return Result(Outcome.RESTART, "a job timed out: restart ComfyUI to stop it")
            await self.pace.sleep(self.config.poll_interval_seconds)

    def _answered_id(self, job: Job, got: str) -> Job:
        """ComfyUI answered the submission with another id than the one sent (an older one
        chooses its own): taken unless it is empty or another job's (a restarted server, a
        proxy in between, a bug); the poll finds the prompt by the job's subfolder anyway."""
        other = self.store.job_with_prompt(got) if got else None
        if not got or (other is not None and other.id != job.id):
            log.warning(
                "job %s: ComfyUI answered its prompt with id %r%s; its own id %s is kept",
                job.id,
                got,
                f", job {other.id}'s" if other is not None else "",
                job.prompt_id,
            )
            return job
        log.info("job %s: ComfyUI chose the id %s for its prompt", job.id, got)
        return self.store.set_prompt_id(job.id, got)

    async def _cancel_running(self, job: Job) -> Result | None:
        """A running job cancelled by request: its prompt out of ComfyUI's queue first, then,
        when it runs already, interrupted by its id. (Interrupting first let a prompt queued
        behind another start as the interrupt ended that one, before the queue was cleared;
        and it stopped a prompt that was not the job's.)"""
        try:
            if job.prompt_id is not None:
                await self.comfy.delete_queued(job.prompt_id)
                subfolder = save_prefix(job.id, 0)[0]
                running = await self.comfy.queued(job.prompt_id, subfolder)
                if running is not None:
                    await self.comfy.interrupt(running)
        except (Unavailable, Rejected) as exc:
            self.store.finish(
                job.id,
                JobState.CANCELLED,
                "cancelled by request while running",
                0,
                self.clock.now(),
            )
            return Result(Outcome.RESTART, f"restart ComfyUI: interrupting a cancelled job: {exc}")
        self._finish(job, JobState.CANCELLED, "cancelled by request while running")
        return None

    async def _comfy_unanswered(self, job: Job, detail: str) -> Result | None:
        """ComfyUI did not answer a poll: dead (its container stopped) or hung (no answer
        comfyui_unanswered_polls times in a row) means a restart; else poll again."""
        self.comfy_unanswered += 1
        failure = await container_failure(self.containers, "image", self.alerts)
        dead = failure is not None and failure.kind is not FailureKind.UNKNOWN
        if dead or self.comfy_unanswered >= self.config.comfyui_unanswered_polls:
            return await self._comfy_died(job, detail, failure)
        log.info("ComfyUI did not answer (%d in a row): %s", self.comfy_unanswered, detail)
        return None

    async def _prepare(self, job: Job) -> dict[str, Any]:
        """Upload the job's input images, point the workflow at their stored names and give
        its save nodes the job's own filename prefix."""
        workflow: dict[str, Any] = dict(job.workflow)
        renames: dict[str, str] = {}
        for name in job.inputs:
            data = (job_dir(self.config.data_dir, job.id) / "inputs" / name).read_bytes()
            stored = await self.comfy.upload_image(f"cardshare-{job.id}-{name}", data)
            renames[name] = stored
        if renames:
            workflow = _substitute(workflow, renames)
        for index, node_id in enumerate(save_nodes(workflow)):
            subfolder, stem = save_prefix(job.id, index)
            node = dict(workflow[node_id])
            node["inputs"] = {**node.get("inputs", {}), "filename_prefix": f"{subfolder}/{stem}"}
            workflow[node_id] = node
        return workflow

    async def _outputs_on_disk(self, job: Job) -> list[bytes]:
        """The job's saved images in ComfyUI's output directory, when every save node left
        at least one (then the prompt ran to its end); else []. An empty file is a save cut
        short (ComfyUI killed between creating the file and writing it): no evidence, and the
        next attempt's file follows it."""
        images: list[bytes] = []
        workflow = dict(job.workflow)
        for index, node_id in enumerate(save_nodes(workflow)):
            subfolder, stem = save_prefix(job.id, index)
            extension = saver_extension(workflow, node_id)
            found = 0
            for counter in range(1, MAX_SAVED_PER_NODE + 1):
                name = saved_file_name(stem, counter, extension)
                data = await self.comfy.saved(name, subfolder)
                if data is None:
                    break
                if not data:
                    continue
                if not is_image(data):  # garbage is no evidence either way: ask again later
                    raise Unavailable(f"GET /view of {subfolder}/{stem} answered no image")
                images.append(data)
                found += 1
            if not found:
                return []
        return images

    async def _fetch_outputs(self, job: Job, history: dict[str, Any]) -> Result | None:
        subfolder = save_prefix(job.id, 0)[0]
        # the job's own files only: never another prompt's outputs
        images = [
            i
            for i in history_images(history)
            if i[1] == subfolder or i[1].startswith(subfolder + "/")
        ]
        if not images:
            self._finish(job, JobState.FAILED, "the workflow finished without output images")
            return None
        # the prompt ran: recorded first, so that nothing after this runs it again
        job = self.store.set_saved(job.id, images)
        return (await self._fetch_saved(job))[1]  # not ended: run_job polls, then fetches

    async def _fetch_saved(self, job: Job) -> tuple[bool, Result | None]:
        """Fetch the files a finished prompt saved: done; on no answer, a garbage one or a 404,
        ask again (:meth:`_fetch_failed`); a request ComfyUI refuses otherwise fails the job.
        ``(ended, result)``: not ended, poll again."""
        assert job.saved is not None
        found: list[bytes] = []
        try:
            for filename, subfolder, kind in job.saved:
                data = await self.comfy.view(filename, subfolder, kind)
                if not is_image(data):
                    raise _NotAnImage(
                        f"GET /view of {subfolder}/{filename} answered no image: {data[:40]!r}"
                    )
                found.append(data)
        except Rejected as exc:
            if exc.status != 404:  # the request itself is wrong: asking again will not help
                self._finish(
                    job,
                    JobState.FAILED,
                    f"ComfyUI reported its outputs saved, but fetching them was refused ({exc}); "
                    "the prompt is not run again",
                )
                return True, None
            return await self._fetch_failed(job, exc)
        except Unavailable as exc:
            return await self._fetch_failed(job, exc)
        self.comfy_unanswered = 0
        self._store_outputs(job, found, "from ComfyUI")
        return True, None

    async def _fetch_failed(self, job: Job, exc: Exception) -> tuple[bool, Result | None]:
        """Saved outputs not fetched (no answer, garbage, 404): ask again, after a restart
        when ComfyUI died; fail the job after job_max_errors. The prompt is never re-run.

        No answer while ComfyUI's container runs (its restart policy brought it back and it is
        still starting, or it hangs) is ComfyUI's silence, not the job's error: polled as a
        running job's is, a restart after comfyui_unanswered_polls in a row, and only the
        restart counts against the job.
        """
        failure = await container_failure(self.containers, "image", self.alerts)
        dead = failure is not None and failure.kind is not FailureKind.UNKNOWN
        silent = isinstance(exc, Unavailable) and not isinstance(exc, _NotAnImage)
        if silent and not dead:
            self.comfy_unanswered += 1
            if self.comfy_unanswered < self.config.comfyui_unanswered_polls:
                log.info("ComfyUI did not answer (%d in a row): %s", self.comfy_unanswered, exc)
                await self.pace.sleep(self.config.poll_interval_seconds)
                return False, None
        else:
            self.comfy_unanswered = 0
        job = self.store.engine_error(job.id, f"fetching outputs failed: {exc}"[:500])
        if job.errors >= self.config.job_max_errors:
            self._finish(
                job,
                JobState.FAILED,
                f"its outputs could not be fetched {job.errors} times: {exc}"[:500],
            )
            return True, None
        if dead or silent:
            if failure is not None and dead:
                self.alerts.set(Alert.IMAGE_CRASHED, f"during job {job.id}: {failure.message}")
            return True, Result(Outcome.RESTART, f"restart ComfyUI to fetch outputs: {exc}")
        await self.pace.sleep(self.config.poll_interval_seconds)
        return False, None

    def _store_outputs(self, job: Job, images: list[bytes], source: str) -> None:
        outdir = job_dir(self.config.data_dir, job.id) / "outputs"
        for n, data in enumerate(images):
            write_atomic(outdir / f"{n}.png", data, make_parents=True)
        self.alerts.drop(Alert.IMAGE_CRASHED)
        self._finish(job, JobState.DONE, "", outputs=len(images))
        log.info("job %s: %d output(s) %s", job.id, len(images), source)

    async def _job_error(self, job: Job, message: str) -> Result | None:
        if is_insufficient_vram_error(message):
            limit = min(VRAM_MAX_ATTEMPTS, self.config.job_max_attempts)
            if job.attempts < limit:
                self.store.note(job.id, f"insufficient VRAM (attempt {job.attempts}): {message}")
                self.store.set_prompt_id(job.id, None)
                return Result(
                    Outcome.RESTART,
                    f"job {job.id} ran out of VRAM: restart ComfyUI to reclaim memory and retry",
                )
            self._finish(
                job,
                JobState.FAILED,
                f"insufficient VRAM after {job.attempts} attempt(s): {message}; "
                f"others on the card: {self.watch.others()}",
            )
            return None
        self._finish(job, JobState.FAILED, f"ComfyUI error: {message}")
        return None

    async def _comfy_died(
        self, job: Job, detail: str, failure: ContainerFailure | None = None
    ) -> Result:
        if failure is None:
            failure = await container_failure(self.containers, "image", self.alerts)
        reason = f"ComfyUI stopped answering ({detail})"
        if failure is not None:
            reason += f"; {failure.message}"
            if failure.kind is FailureKind.OOM_KILLED:
                self.alerts.set(Alert.IMAGE_OOM_KILLED, failure.message)
        self.alerts.set(Alert.IMAGE_CRASHED, f"during job {job.id}: {reason}"[:500])
        if job.prompt_id is not None:
            job = self.store.set_prompt_id(job.id, None)
        # every restart counts against the job, also one before its first attempt (a look
        # for its files that fails): a fault that outlives restarts ends the job
        job = self.store.count_restart(job.id, reason)
        if job.attempts >= self.config.job_max_attempts:
            self._finish(job, JobState.FAILED, f"{reason}; gave up after {job.attempts} attempt(s)")
        elif job.restarts >= self.config.job_max_restarts:
            self._finish(
                job,
                JobState.FAILED,
                f"{reason}; gave up after {job.restarts} restarts of ComfyUI for this job "
                f"(job_max_restarts {self.config.job_max_restarts})",
            )
        return Result(Outcome.RESTART, f"restart ComfyUI: {reason}")

    def _finish(self, job: Job, state: JobState, reason: str, outputs: int = 0) -> None:
        self.store.finish(job.id, state, reason, outputs, self.clock.now())
        log.info("job %s %s %s", job.id, state, reason)
        if state is JobState.DONE:
            signature = workflow_signature(job.workflow)
            self.reclaim.comfy_signature = signature
            if self.job_peak > 0:
                peak = self.store.record_workflow_peak(signature, self.job_peak, self.clock.now())
                log.info("workflow %s: peak %d bytes (this run %d)", signature, peak, self.job_peak)
        self.job_peak = 0

    async def _sample_job_peak(self) -> None:
        """ComfyUI's VRAM while a job runs, kept as the job's peak: card data scanned since
        the prompt was submitted and at most a poll old (the arbiter's card data changes only
        by its own scans; the card is awake with the job, so a scan wakes nothing)."""
        try:
            view = await self.watch.read(
                max(self.job_peak_since, self.clock.now() - self.config.poll_interval_seconds)
            )
        except CardDataError:
            return
        self.job_peak = max(self.job_peak, view.vram_of(self.config.image_names))

    # -- jobs API helpers ---------------------------------------------------------------------

    def submit_job(self, workflow: dict[str, Any], inputs: dict[str, bytes]) -> Job:
        """Store a job (inputs first, then the row); on any failure nothing is left behind."""
        job_id = uuid.uuid4().hex
        jdir = job_dir(self.config.data_dir, job_id)
        try:
            for name, data in inputs.items():
                write_atomic(jdir / "inputs" / name, data, make_parents=True)
            job = self.store.add_job(job_id, workflow, tuple(sorted(inputs)), self.clock.now())
        except BaseException:
            shutil.rmtree(jdir, ignore_errors=True)
            raise
        self.wake.set()
        return job


PHASE_ACTIONS: dict[Phase, Callable[[Engine], Awaitable[Result | None]]] = {
    Phase.SERVE_LLM: Engine._serve_llm,
    Phase.STOP_LLM: Engine._stop_llm,
    Phase.WAIT_LLM_RELEASE: Engine._wait_llm_release,
    Phase.START_IMAGE: Engine._start_image,
    Phase.WAIT_IMAGE_READY: Engine._wait_image_ready,
    Phase.RUN_JOBS: Engine._run_jobs,
    Phase.RESTART_IMAGE: Engine._restart_image,
    Phase.STOP_IMAGE: Engine._stop_image,
    Phase.WAIT_IMAGE_RELEASE: Engine._wait_image_release,
    Phase.START_LLM: lambda engine: engine.reclaim.start_llm(),
    Phase.WAIT_LLM_READY: Engine._wait_llm_ready,
}

# the moves taken in memory when the database cannot be written: toward vLLM serving
SAFE_WITHOUT_STORE = frozenset((*HANDBACK_PHASES, Phase.SERVE_LLM))
# a swap to image (or a restart of ComfyUI) under way when the data directory fails: the
# outcome that turns it back toward vLLM
STORAGE_ABORTS: dict[Phase, Outcome] = {
    Phase.STOP_LLM: Outcome.FAILED,
    Phase.WAIT_LLM_RELEASE: Outcome.TIMEOUT,
    Phase.START_IMAGE: Outcome.FAILED,
    Phase.WAIT_IMAGE_READY: Outcome.FAILED,
    Phase.RESTART_IMAGE: Outcome.FAILED,
}

# comfyui_max_restarts_per_hour counts the restarts of this long
RESTART_WINDOW_SECONDS = 3600.0

# a save node's batch larger than this is not looked for on disk
MAX_SAVED_PER_NODE = 256


def is_image(data: bytes) -> bool:
    """PNG, JPEG, GIF or WebP by their signatures: what ComfyUI's save nodes write."""
    return image_type(data) is not None


def image_type(data: bytes) -> str | None:
    """The media type of an image by its signature (an output is kept as ``<n>.png`` whatever
    it is: SaveAnimatedWEBP writes WebP)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def _substitute(value: Any, renames: dict[str, str]) -> Any:
    """Replace string values equal to an input's name by its uploaded name."""
    if isinstance(value, str):
        return renames.get(value, value)
    if isinstance(value, dict):
        return {k: _substitute(v, renames) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, renames) for v in value]
    return value


def _rejection(exc: Rejected) -> str:
    """A job failure from ComfyUI's 400: its error and node_errors."""
    detail = exc.detail
    if isinstance(detail, dict):
        error = detail.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        node_errors = json.dumps(detail.get("node_errors") or {}, sort_keys=True)
        message = message or "invalid prompt"
        return f"ComfyUI rejected the workflow: {message}; node_errors: {node_errors}"
    return f"ComfyUI rejected the workflow: {exc}"


def decode_inputs(raw: Any) -> dict[str, bytes]:
    """``{name: base64 png}`` to bytes; names must be plain file names."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("inputs must be an object of {name: base64 PNG}")
    out: dict[str, bytes] = {}
    for name, data in raw.items():
        check_input_name(name)
        if not isinstance(data, str):
            raise ValueError(f"input {name!r} must be a base64 string")
        try:
            out[name] = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise ValueError(f"input {name!r} is not valid base64") from exc
    return out


def storable_text(text: str) -> bool:
    """Text that can go into a file name, a database row and an HTTP header as it is: UTF-8
    encodable (no lone surrogates) and free of control characters (NUL, CR, LF ...)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def check_input_name(name: Any) -> None:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or not storable_text(name)
        or len(name.encode("utf-8")) > 200
    ):
        raise ValueError(
            f"input name {name!r:.80} must be a plain file name: no path separator, no control "
            "character or lone surrogate, at most 200 bytes"
        )
