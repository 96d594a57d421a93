"""VRAM reclaim and vLLM's plan ladder: the plan that starts (the largest that fits the
card), a start that failed for want of VRAM (reclaim and retry, one plan down, give up until
the card changes), the way back to a larger plan at an idle moment, and ComfyUI's memory
freed before a job whose measured peak does not fit."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cardshare.arbiter.cardview import CardDataError, CardView
from cardshare.arbiter.common import Alert, Alerts, CardWatch, Clock, ContainerFailure, Pace, Result
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import ComfyApi, Containers, Rejected, Unavailable
from cardshare.arbiter.plans import (
    CONTEXT_BOUND_PATTERNS,
    FreeVram,
    ImageReclaim,
    PassAction,
    PlanChoice,
    card_changed,
    choose_plan,
    image_reclaim,
    measure_free,
    should_restore,
    vram_pass,
    workflow_signature,
)
from cardshare.arbiter.rules import (
    SwapObservations,
    llm_retry_delay,
    should_restore_plan,
    still_held,
    where,
)
from cardshare.arbiter.states import Outcome
from cardshare.arbiter.store import Job, Store
from cardshare.arbiter.yielding import YieldingTenants
from cardshare.docker_api import DockerError
from cardshare.errors import VRAM_MAX_ATTEMPTS, matched_pattern

log = logging.getLogger("cardshare.arbiter")


@dataclass
class Reclaim:
    config: Config
    store: Store
    containers: Containers
    comfy: ComfyApi
    clock: Clock
    alerts: Alerts
    pace: Pace
    watch: CardWatch
    yielders: YieldingTenants
    phase_since: Callable[[], float]  # when the engine's phase in hand began (wall clock)
    llm_failures: int = 0  # starts of vLLM that failed, in a row (the start's backoff)
    llm_vram_failures: int = 0  # of those, for want of VRAM, in this start series
    # vLLM's plans: the one that runs (or starts next), and why it was chosen
    plan_index: int = 0
    plan_reason: str = "the full plan"
    plan_next: int | None = None  # the plan a VRAM pass chose for the next attempt
    plan_attempts: list[int] = field(default_factory=list)  # the plans tried in this series
    vram_gave_up: FreeVram | None = None  # the card when the last series gave up
    vram_gave_up_at: float = 0.0
    restore_blocked: FreeVram | None = None  # the card when a start last failed
    # the signature of the workflow whose models ComfyUI holds (None after a start)
    comfy_signature: str | None = None

    def plan_doc(self) -> dict[str, Any]:
        """vLLM's plan now: which, how large, and whether it is a degraded one."""
        plan = self.config.plans[self.plan_index]
        return {
            "index": self.plan_index,
            "plans": len(self.config.plans),
            "service": plan.service,
            "max_model_len": plan.max_model_len,
            "gpu_memory_utilization": plan.gpu_memory_utilization,
            "reservation_bytes": plan.reservation_bytes or None,
            "degraded": self.plan_index > 0,
            "reason": self.plan_reason,
            "restore": self.config.restore_full_plan,
        }

    async def _measure_free(self, max_age: float = 0.0) -> FreeVram | None:
        """What the card has free for vLLM, from card data at most ``max_age`` old (0: a fresh
        scan); None when it cannot be read."""
        view = await self._plan_view(max_age)
        return None if view is None else self._free_in(view)

    async def _plan_view(self, max_age: float) -> CardView | None:
        try:
            return await self.pace.waiting(self.watch.read(self.clock.now() - max_age))
        except CardDataError as exc:
            log.info("no card data to choose vLLM's plan: %s", exc)
            return None

    def _free_in(self, view: CardView) -> FreeVram:
        return measure_free(view, self.config.llm_names, self.config.card_vram_bytes)

    async def find_running_plan(self) -> None:
        """With several plans: the one whose container runs is the llm container."""
        if len(self.config.plans) < 2:
            return
        running = []
        for index in range(len(self.config.plans)):
            self.containers.use("llm", self.config.plan_container(index))
            try:
                if (await self.containers.state("llm")).running:
                    running.append(index)
            except DockerError as exc:
                if index == 0:
                    raise
                # a smaller plan's container missing is not a reason to stop serving
                self.alerts.set(Alert.DOCKER, f"plan {index} of vLLM: {exc}")
        for extra in running[1:]:  # never two vLLMs on the card: keep the largest plan
            self.containers.use("llm", self.config.plan_container(extra))
            log.warning("two plans of vLLM run: stopping plan %d", extra)
            await self.containers.stop("llm", self.config.stop_timeout_seconds)
        self.plan_index = running[0] if running else 0
        self.plan_reason = "found running as the arbiter started" if running else self.plan_reason
        self.containers.use("llm", self.config.plan_container(self.plan_index))

    async def restore_plan(self, obs: SwapObservations) -> Result | None:
        """A smaller plan serves: back to a larger one when it fits, at an idle moment.

        Weighed on the recorder's data as fresh as a swap needs it (not a scan every poll:
        each one wakes the card), and, when a larger plan fits there, confirmed on a scan made
        then, as a swap to image is: a client that arrived since (a transcode) would make the
        larger plan fail to start, and the agents wait through two restarts.
        """
        idle = should_restore_plan(obs, self.config, self.clock.now())
        if not idle.go:
            return None
        began = self.clock.now()
        view = await self._plan_view(self.config.card_data_max_age_seconds)
        choice = None if view is None else self._restore_choice(view)
        if view is not None and choice is not None and view.scanned_at < began:
            view = await self._plan_view(0.0)
            choice = None if view is None else self._restore_choice(view)
        if choice is None:
            return None
        return Result(
            Outcome.REPLAN,
            f"plan {choice.index} fits again ({choice.reason}); {'; '.join(idle.reasons)}",
        )

    def _restore_choice(self, view: CardView) -> PlanChoice | None:
        """The larger plan that fits on ``view``; None while the card is as it was when a
        restore last failed for want of VRAM (it would fail the same way)."""
        free = self._free_in(view)
        if self.restore_blocked is not None:
            if not card_changed(self.restore_blocked, free, self.config.vram_retry_margin_bytes):
                return None
            self.restore_blocked = None
        return should_restore(
            self.config.plans, self.plan_index, free, self.config.vram_headroom_bytes
        )

    async def wait_release(self, names: tuple[str, ...], timeout: float, alert: Alert) -> Result:
        """Until the named clients hold no VRAM in card data scanned after this phase began,
        on every pool card (a tensor-parallel vLLM holds memory on each).

        Each look asks for data scanned at that look (the arbiter's card data changes only
        by its own scans): memory that lingers past one scan is seen released at a later one.
        """
        since = self.phase_since()  # wall clock: weighed against the scans' times
        deadline = self.clock.monotonic() + timeout
        last = "no card data yet"
        while True:
            try:
                view = await self.pace.waiting(self.watch.read(self.clock.now()))
                held = still_held(view, names)
                if view.scanned_at >= since and not held:
                    self.alerts.drop(alert)
                    cards = f" on {', '.join(p for p, _ in view.cards)}" if view.cards else ""
                    return Result(Outcome.OK, f"{', '.join(names)} hold no VRAM any more{cards}")
                now = (
                    "; ".join(
                        f"{', '.join(names)} still hold {size / 2**30:.1f} GiB"
                        + ("" if pdev is None else f" on {where(pdev)}")
                        for pdev, size in held
                    )
                    if view.scanned_at >= since
                    else "card data not refreshed since the stop"
                )
                if now != last and view.scanned_at >= since:
                    # what the wait is on, each time it changes (a pool card slower than the rest)
                    log.info("waiting for the release: %s", now)
                last = now
            except CardDataError as exc:
                last = str(exc)
            if self.clock.monotonic() >= deadline:
                message = f"memory not released after {timeout:g} s: {last}"
                self.alerts.set(alert, message)
                return Result(Outcome.TIMEOUT, message)
            await self.pace.pause(self.config.poll_interval_seconds)

    async def start_llm(self) -> Result | None:
        plans = self.config.plans
        if self.vram_gave_up is not None:
            # the last series gave up: stay out of llm until the card changes
            free = await self._measure_free()
            waited = self.clock.monotonic() - self.vram_gave_up_at
            changed = free is not None and card_changed(
                self.vram_gave_up, free, self.config.vram_retry_margin_bytes
            )
            if not changed and waited < self.config.llm_retry_backoff_max_seconds:
                await self.pace.pause(self.config.poll_interval_seconds)
                return None
            log.info(
                "a new series of vLLM starts: %s",
                "the card changed" if changed else f"{waited:.0f} s since the last gave up",
            )
            self.vram_gave_up = None
            self.llm_vram_failures = 0
            self.llm_failures = 0  # a new series starts without the old one's backoff
        else:
            delay = llm_retry_delay(
                self.llm_failures,
                self.config.llm_retry_backoff_seconds,
                self.config.llm_retry_backoff_max_seconds,
            )
            if delay:
                await self.pace.pause(delay)
            free = await self._measure_free() if len(plans) > 1 else None
        if self.llm_vram_failures == 0 or self.plan_next is None:
            self.plan_attempts = []
            if len(plans) > 1 and free is not None:
                choice = choose_plan(plans, free, self.config.vram_headroom_bytes)
                target, self.plan_reason = choice.index, choice.reason
            else:
                target = 0 if len(plans) == 1 or free is None else self.plan_index
                self.plan_reason = (
                    "the only plan" if len(plans) == 1 else "no card data: the full plan"
                )
        else:
            target = self.plan_next
        self.plan_next = None
        try:
            if len(plans) > 1:
                if not await self._stop_other_plans(target):
                    return None
            elif self.llm_failures:
                # a failed or unready vLLM: restart it from scratch
                await self.pace.waiting(
                    self.containers.stop("llm", self.config.stop_timeout_seconds)
                )
            self.plan_index = target
            self.containers.use("llm", self.config.plan_container(target))
            if len(plans) > 1 and self.llm_failures:
                await self.pace.waiting(
                    self.containers.stop("llm", self.config.stop_timeout_seconds)
                )
            self.plan_attempts.append(target)
            await self.pace.waiting(self.containers.start("llm"))
            self.alerts.drop(Alert.DOCKER)
        except DockerError as exc:
            self.llm_failures += 1
            self.alerts.set(Alert.DOCKER, str(exc))
            self.alerts.set(Alert.LLM_NOT_READY, f"starting vLLM failed: {exc}")
            return Result(Outcome.FAILED, f"starting the llm container failed: {exc}")
        plan = plans[target]
        detail = (
            f" on plan {target} ({plan.max_model_len} tokens, "
            f"{plan.gpu_memory_utilization:g} of the card): {self.plan_reason}"
            if len(plans) > 1
            else ""
        )
        return Result(Outcome.OK, f"llm container started{detail}")

    async def _stop_other_plans(self, target: int) -> bool:
        """Stop every plan's container but ``target``'s, and wait until vLLM's memory left the
        card when one ran (a restore to a larger plan). False: its memory stayed (alerted)."""
        stopped = False
        for index in range(len(self.config.plans)):
            if index == target:
                continue
            self.containers.use("llm", self.config.plan_container(index))
            try:
                running = (await self.pace.waiting(self.containers.state("llm"))).running
            except DockerError as exc:  # a plan without a container never ran
                log.info("plan %d of vLLM: %s", index, exc)
                continue
            if running:
                await self.pace.waiting(
                    self.containers.stop("llm", self.config.stop_timeout_seconds)
                )
                stopped = True
        if not stopped:
            return True
        result = await self.wait_release(
            self.config.llm_names,
            self.config.llm_release_timeout_seconds,
            Alert.LLM_RELEASE_TIMEOUT,
        )
        return result.outcome is Outcome.OK

    async def vram_pass(self, failure: ContainerFailure) -> Result:
        """An insufficient-VRAM failure at start: reclaim and retry the same plan, then one
        plan down, then give up (at most VRAM_MAX_ATTEMPTS starts a series)."""
        self.llm_vram_failures += 1
        free = await self._measure_free()
        self.restore_blocked = free
        holders = free.describe_holders() if free is not None else self.watch.others()
        step = vram_pass(
            self.plan_index,
            self.llm_vram_failures,
            len(self.config.plans),
            context_bound=matched_pattern(failure.message) in CONTEXT_BOUND_PATTERNS,
        )
        tried = ", ".join(str(p) for p in self.plan_attempts) or str(self.plan_index)
        if step.action is PassAction.GIVE_UP:
            self.vram_gave_up = free if free is not None else FreeVram(None, 0, ())
            self.vram_gave_up_at = self.clock.monotonic()
            self.plan_next = None
            try:  # stopped, so that no restart policy keeps starting it meanwhile
                await self.pace.waiting(
                    self.containers.stop("llm", self.config.stop_timeout_seconds)
                )
            except DockerError as exc:
                self.alerts.set(Alert.DOCKER, str(exc))
            self.alerts.set(
                Alert.LLM_INSUFFICIENT_VRAM,
                f"vLLM could not get its memory in {self.llm_vram_failures} attempts "
                f"(plans {tried}; last: {failure.message}); the card is held by: {holders}; "
                "staying out of llm until the card changes (or "
                f"{self.config.llm_retry_backoff_max_seconds:g} s pass)",
            )
            return Result(Outcome.FAILED, f"vLLM failed to start: {failure.message}")
        if step.action is PassAction.RETRY_AFTER_RECLAIM:
            await self._reclaim()
            what = f"reclaimed; retrying plan {step.plan}"
        elif step.plan == self.plan_index:
            what = f"retrying plan {step.plan} (no smaller plan)"
        else:
            what = f"stepping down to plan {step.plan}"
        self.plan_next = step.plan
        self.alerts.set(
            Alert.LLM_INSUFFICIENT_VRAM,
            f"vLLM could not get its memory ({failure.message}); attempt "
            f"{self.llm_vram_failures} of {VRAM_MAX_ATTEMPTS}: {what}; the card is held by: "
            f"{holders}",
        )
        return Result(Outcome.FAILED, f"vLLM failed to start for want of VRAM: {what}")

    async def _reclaim(self) -> None:
        """Before the retry: ComfyUI off the card (stopped, its release measured) and the
        yielding tenants paused. Never from under a job: vLLM starts only in the handback,
        after the jobs' phase ended."""
        await self.yielders.pause("vLLM could not get its memory at start")
        try:
            if (await self.pace.waiting(self.containers.state("image"))).running:
                await self.pace.waiting(
                    self.containers.stop("image", self.config.stop_timeout_seconds)
                )
        except DockerError as exc:
            self.alerts.set(Alert.DOCKER, str(exc))
            return
        await self.wait_release(
            self.config.image_names,
            self.config.image_release_timeout_seconds,
            Alert.IMAGE_RELEASE_TIMEOUT,
        )

    async def reclaim_for(self, job: Job) -> None:
        """Before a job whose workflow ran before: when its measured peak does not fit what is
        free because ComfyUI holds another workflow's models, ask ComfyUI to free them and wait
        until the card data shows the release (never trusting /free's answer). Called between
        jobs only: no prompt of the arbiter's runs in ComfyUI then."""
        signature = workflow_signature(job.workflow)
        if self.comfy_signature == signature:
            return  # its own models are loaded: freeing them cannot help it
        peak = self.store.workflow_peak(signature)
        if peak is None:
            return
        # the recorder's latest data first (a fresh scan per job would slow every job down);
        # a fresh scan only to confirm a reclaim
        seen = await self._reclaim_view(peak, self.config.card_data_max_age_seconds)
        if seen is None or not seen[1].free_first:
            return
        seen = await self._reclaim_view(peak)
        if seen is None:
            return
        before, decision = seen
        if not decision.free_first:
            log.info("job %s: %s", job.id, decision.reason)
            return
        self.store.note(job.id, f"freeing ComfyUI's memory first: {decision.reason}")
        try:
            await self.pace.waiting(self.comfy.free())
        except (Unavailable, Rejected) as exc:
            log.warning("job %s: POST /free failed: %s", job.id, exc)
            return
        self.comfy_signature = None
        deadline = self.clock.monotonic() + self.config.image_release_timeout_seconds
        while self.clock.monotonic() < deadline:
            await self.pace.pause(self.config.poll_interval_seconds)
            seen = await self._reclaim_view(peak)
            if seen is None:
                continue
            comfy, after = seen
            # released: the job fits now, or ComfyUI gave back nine tenths of what it held
            if not after.free_first or comfy <= before // 10:
                log.info(
                    "job %s: ComfyUI holds %d bytes after /free (%d before): %s",
                    job.id,
                    comfy,
                    before,
                    after.reason,
                )
                return
        log.warning(
            "job %s: ComfyUI's memory not released within %g s; running it anyway",
            job.id,
            self.config.image_release_timeout_seconds,
        )

    async def _reclaim_view(
        self, peak: int, max_age: float = 0.0
    ) -> tuple[int, ImageReclaim] | None:
        """What ComfyUI holds in card data at most ``max_age`` old (0: a fresh scan), and
        whether a job of ``peak`` needs its memory freed first (never counting another
        workflow's cached models as free); None without card data."""
        view = await self._plan_view(max_age)
        if view is None:
            return None
        card = view.on(self.config.image_pdev)  # ComfyUI's card of the pool
        free = self._free_in(card)
        comfy = card.vram_of(self.config.image_names)
        decision = image_reclaim(
            peak, free.total, comfy, free.held - comfy, self.config.vram_headroom_bytes, False
        )
        return comfy, decision
