"""The arbiter's engine, the mode machine: runs the current phase's action, then takes the
transition the table gives for its outcome, persisting it first.

Decisions come from :mod:`cardshare.arbiter.rules` and :mod:`cardshare.arbiter.resume`. The
work is done by collaborators built with the engine and handed what they need, none of which
imports this module: the steps of a swap (``swaps``), VRAM reclaim and vLLM's plan ladder
(``reclaim``), the job runner (``jobs``) and the yielding tenants (``yielding``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cardshare.arbiter.cardview import CardDataError, CardSource, CardView
from cardshare.arbiter.common import (
    Alert,
    Alerts,
    CardWatch,
    Clock,
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
    Unavailable,
    YieldingApi,
)
from cardshare.arbiter.jobs import Jobs
from cardshare.arbiter.plans import Tenant, tenants, workflow_signature
from cardshare.arbiter.prewarm import read_meminfo
from cardshare.arbiter.reclaim import Reclaim
from cardshare.arbiter.resume import plan_resume
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
    OWNER_RUNS,
    OWNER_STARTS,
    OWNER_STOPS,
    Mode,
    Outcome,
    Phase,
    next_phase,
)
from cardshare.arbiter.store import Job, MachineState, Store, job_dir
from cardshare.arbiter.swaps import Swaps
from cardshare.arbiter.yielding import YieldingTenants
from cardshare.atomicfile import write_atomic
from cardshare.docker_api import ContainerState, DockerError

log = logging.getLogger("cardshare.arbiter")


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
        # the proxy's last answer: (monotonic, wall clock, its state, or why there is none)
        self.proxy_seen: tuple[float, float, ProxyState | None, str | None] | None = None
        self.storage_paused: str | None = None  # why the data directory cannot take jobs
        # a move toward vLLM taken while the database could not be written: the state in
        # memory is ahead of the database's until storage works again
        self.unwritten: str | None = None
        self.database_lost: str | None = None  # the database file deleted or replaced
        self.alive = False
        self.step_errors = 0  # failed steps in a row (backoff)
        self.wake = asyncio.Event()
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
        self.jobs = Jobs(
            self.config,
            self.store,
            self.containers,
            self.comfy,
            self.clock,
            self.alerts,
            self.pace,
            self.watch,
            self.reclaim,
        )
        self.swaps = Swaps(
            self.config,
            self.store,
            self.containers,
            self.llm,
            self.comfy,
            self.clock,
            self.alerts,
            self.pace,
            self.reclaim,
            self.jobs,
            self.yielders,
            lambda: self.state.phase_since,
            self.meminfo,
        )
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
        seen: tuple[ProxyState | None, str | None]
        try:
            seen = parse_proxy_state(await self.proxy.state(), self.config.proxy_box), None
        except (Unavailable, Rejected, ValueError) as exc:
            seen = None, str(exc)
        self.proxy_seen = (self.clock.monotonic(), self.clock.now(), *seen)
        return seen

    async def proxy_doc(self, max_age: float, timeout: float) -> dict[str, Any] | None:
        """The proxy's held requests for the status page: the engine's own last look when at
        most ``max_age`` seconds old, else a look of the page's, bounded by ``timeout`` (the
        swap phases do not ask the proxy); None: no proxy configured."""
        if self.proxy is None:
            return None
        if self.proxy_seen is None or self.clock.monotonic() - self.proxy_seen[0] > max_age:
            try:
                await asyncio.wait_for(self._proxy_state(), timeout)
            except TimeoutError:
                self.proxy_seen = (
                    self.clock.monotonic(),
                    self.clock.now(),
                    None,
                    f"the proxy did not answer within {timeout:g} s",
                )
        assert self.proxy_seen is not None
        _, at, state, error = self.proxy_seen
        return {
            "at": at,
            "held": None if state is None else state.held,
            "in_flight": None if state is None else state.in_flight,
            "oldest_held_seconds": None if state is None else state.oldest_held_seconds,
            "error": error,
        }

    def since_scan(self) -> list[dict[str, Any]]:
        """What the arbiter started or stopped on the card after the last card data was
        scanned: vLLM up since a swap back is not in a scan taken before it started (the
        status page marks it so, instead of showing its memory free)."""
        last = self.watch.last
        scanned = last.scanned_at if last is not None else None
        out: list[dict[str, Any]] = []
        for role in ("llm", "image"):
            runs = self.state.phase in OWNER_RUNS[role]
            at = self.store.last_move((OWNER_STARTS if runs else OWNER_STOPS)[role])
            if at is None or (scanned is not None and at <= scanned):
                continue
            if role == "llm":
                names = self.config.llm_names
                index = self.reclaim.plan_index
                mine = self.config.plan_container(index).client_name
                name = mine if mine in names else names[0]
                plan = self.config.plans[index].reservation_bytes or None
            else:
                names = self.config.image_names
                name, plan = names[0], None
            out.append(
                {
                    "role": role,
                    "name": name,
                    "names": list(names),
                    "event": "started" if runs else "stopped",
                    "at": at,
                    "plan_bytes": plan if runs else None,
                }
            )
        return out

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
        if self.state.phase is not Phase.SERVE_LLM or self.jobs.current_job is not None:
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
        self.jobs.step_job = None
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
                self.jobs.poison(exc)
        else:
            # the Docker alert clears on a Docker call that works (not on any step)
            self.step_errors = 0
            self.alerts.drop(Alert.ENGINE_ERROR)
            return True
        self.step_errors += 1
        return False

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
                (self.swaps.image_retry_at - self.clock.monotonic())
                if self.swaps.image_failures
                else None
            ),
            image_failure=self.swaps.image_failure or None,
            llm_stop_retry_in=(
                (self.swaps.llm_stop_retry_at - self.clock.monotonic())
                if self.swaps.llm_stop_failures
                else None
            ),
            llm_stop_failure=self.swaps.llm_stop_failure or None,
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
            self.swaps.llm_stop_failures = 0
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

    async def _run_jobs(self) -> Result | None:
        if self.store.queue_length() <= 1:
            self.swaps.maybe_prewarm()
        if self.yielders.paused:
            await self.yielders.pause("image jobs run")  # renews a lease past its half
        if self.storage_paused is not None:
            return Result(
                Outcome.HAND_BACK, f"jobs paused, the data directory fails: {self.storage_paused}"
            )
        if self.jobs.pending_restart is not None:
            reason, self.jobs.pending_restart = self.jobs.pending_restart, None
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
        return await self.jobs.run_next()

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
    Phase.STOP_LLM: lambda engine: engine.swaps.stop_llm(),
    Phase.WAIT_LLM_RELEASE: lambda engine: engine.swaps.wait_llm_release(),
    Phase.START_IMAGE: lambda engine: engine.swaps.start_image(),
    Phase.WAIT_IMAGE_READY: lambda engine: engine.swaps.wait_image_ready(),
    Phase.RUN_JOBS: Engine._run_jobs,
    Phase.RESTART_IMAGE: lambda engine: engine.swaps.restart_image(),
    Phase.STOP_IMAGE: lambda engine: engine.swaps.stop_image(),
    Phase.WAIT_IMAGE_RELEASE: lambda engine: engine.swaps.wait_image_release(),
    Phase.START_LLM: lambda engine: engine.reclaim.start_llm(),
    Phase.WAIT_LLM_READY: lambda engine: engine.swaps.wait_llm_ready(),
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
