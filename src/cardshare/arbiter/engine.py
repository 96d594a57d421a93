"""The arbiter's engine: runs the current phase's action, then takes the transition the
table gives for its outcome, persisting it first.

Decisions come from :mod:`cardshare.arbiter.rules` and :mod:`cardshare.arbiter.resume`;
this module only gathers observations and acts through the edges.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cardshare.arbiter.cardview import CardDataError, CardSource, CardView
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import (
    ComfyApi,
    Containers,
    LlmApi,
    ProxyApi,
    Rejected,
    Role,
    Unavailable,
)
from cardshare.arbiter.resume import (
    JobStep,
    history_error,
    history_images,
    plan_job_step,
    plan_resume,
)
from cardshare.arbiter.rules import (
    Decision,
    HandbackObservations,
    LlmActivity,
    MetricsError,
    ProxyState,
    SwapObservations,
    describe_client,
    llm_retry_delay,
    parse_proxy_state,
    parse_vllm_metrics,
    released,
    should_hand_back,
    should_swap_to_image,
    update_activity,
)
from cardshare.arbiter.states import MODE_OF, Mode, Outcome, Phase, next_phase
from cardshare.arbiter.store import Job, JobState, MachineState, Store, job_dir, write_atomic
from cardshare.docker_api import DockerError
from cardshare.errors import VRAM_MAX_ATTEMPTS, is_insufficient_vram_error, oom_killed_message

log = logging.getLogger("cardshare.arbiter")
T = TypeVar("T")

ALERT_NAMES = (
    "llm_not_ready",
    "llm_insufficient_vram",
    "llm_oom_killed",
    "llm_release_timeout",
    "image_not_ready",
    "image_release_timeout",
    "image_oom_killed",
    "docker",
    "card_data",
)


class Clock(Protocol):
    def now(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Result:
    outcome: Outcome
    reason: str


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

    def __post_init__(self) -> None:
        now = self.clock.now()
        self.state: MachineState = self.store.machine(now)
        # conservative start: vLLM must be seen idle for idle_seconds from now
        self.activity = LlmActivity(last_active_at=now)
        self.alerts: dict[str, str] = {}
        self.last_decision = Decision(False, ("not evaluated yet",))
        self.last_card: CardView | None = None
        self.current_job: str | None = None
        self.llm_failures = 0
        self.llm_vram_failures = 0
        self._waited = 0.0
        self.wake = asyncio.Event()

    # -- helpers -------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return MODE_OF[self.state.phase]

    async def _waiting(self, aw: Awaitable[T]) -> T:
        """Await a container stop/start/readiness call, counting its time as waited."""
        start = self.clock.now()
        try:
            return await aw
        finally:
            self._waited += self.clock.now() - start

    async def _pause(self, seconds: float) -> None:
        await self._waiting(self.clock.sleep(seconds))

    def _alert(self, name: str, message: str) -> None:
        if self.alerts.get(name) != message:
            log.warning("alert %s: %s", name, message)
        self.alerts[name] = message

    def _clear(self, *names: str) -> None:
        for name in names:
            self.alerts.pop(name, None)

    def transition(self, outcome: Outcome, reason: str) -> None:
        to = next_phase(self.state.phase, outcome)
        self._move(to, outcome, reason)

    def _move(self, to: Phase, outcome: Outcome, reason: str) -> None:
        log.info("%s -> %s (%s): %s", self.state.phase, to, outcome, reason)
        self.state = self.store.transition(
            to, outcome, reason, self.clock.now(), waited_seconds=self._waited
        )
        self._waited = 0.0

    async def _card_view(self, newer_than: float | None) -> CardView:
        view = await self.card.read(newer_than)
        self.last_card = view
        return view

    async def _proxy_state(self) -> tuple[ProxyState | None, str | None]:
        if self.proxy is None:
            return None, None
        try:
            return parse_proxy_state(await self.proxy.state()), None
        except (Unavailable, Rejected, ValueError) as exc:
            return None, str(exc)

    async def _container_failure(self, role: Role) -> str | None:
        """Why the role's container is not running (OOMKilled, VRAM, exit code), else None."""
        try:
            st = await self.containers.state(role)
        except DockerError as exc:
            return f"cannot inspect the {role} container: {exc}"
        if st.running:
            return None
        if st.oom_killed:
            return oom_killed_message(st.name or role)
        try:
            tail = await self.containers.logs_tail(role)
        except DockerError:
            tail = ""
        vram = [line for line in tail.splitlines() if is_insufficient_vram_error(line)]
        if vram:
            return f"insufficient VRAM: {vram[-1].strip()[:300]}"
        status = st.status or "not running"
        return f"container {st.name or role} is {status} (exit code {st.exit_code})"

    def _others_on_card(self) -> str:
        if self.last_card is None:
            return "unknown"
        others = self.last_card.others(self.config.llm_names)
        return "; ".join(describe_client(c.name, c.vram_bytes, c.busy_engines) for c in others) or (
            "none"
        )

    # -- resume ----------------------------------------------------------------------------

    async def resume(self) -> bool:
        """Converge the persisted phase with the containers' real states; False when the
        containers cannot be inspected (the caller retries)."""
        try:
            llm_running = (await self.containers.state("llm")).running
            image_running = (await self.containers.state("image")).running
        except DockerError as exc:
            self._alert("docker", str(exc))
            return False
        self._clear("docker")
        plan = plan_resume(self.state.phase, llm_running, image_running, self.store.queue_length())
        if plan.phase is not self.state.phase:
            self._move(plan.phase, Outcome.RESUME, f"resume: {plan.reason}")
        else:
            log.info("resume in %s: %s", self.state.phase, plan.reason)
        return True

    # -- the loop --------------------------------------------------------------------------

    async def step(self) -> None:
        """Run the current phase's action once; transition on its outcome."""
        action = PHASE_ACTIONS[self.state.phase]
        result = await action(self)
        if result is not None:
            self.transition(result.outcome, result.reason)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not await self.resume():
            await self.clock.sleep(self.config.poll_interval_seconds)
        while not stop.is_set():
            try:
                await self.step()
            except DockerError as exc:
                self._alert("docker", str(exc))
                await self.clock.sleep(self.config.poll_interval_seconds)
            else:
                self._clear("docker")

    async def _idle_wait(self) -> None:
        """Sleep a poll interval, or less when a job arrives."""
        self.wake.clear()
        sleeper = asyncio.ensure_future(self.clock.sleep(self.config.poll_interval_seconds))
        waker = asyncio.ensure_future(self.wake.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sleeper, waker):
                task.cancel()

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
            self.activity = update_activity(self.activity, metrics, now)
            activity = self.activity
        queue_length = self.store.queue_length()
        proxy, proxy_error = await self._proxy_state()
        card: CardView | None = None
        card_error: str | None = None
        if queue_length > 0:
            try:
                card = await self._card_view(now - self.config.card_data_max_age_seconds)
                self._clear("card_data")
            except CardDataError as exc:
                card_error = str(exc)
                self._alert("card_data", card_error)
        return SwapObservations(
            queue_length=queue_length,
            activity=activity,
            metrics_error=metrics_error,
            proxy=proxy,
            proxy_error=proxy_error,
            card=card,
            card_error=card_error,
        )

    # -- phase actions -----------------------------------------------------------------------

    async def _serve_llm(self) -> Result | None:
        obs = await self.observe_for_swap()
        self.last_decision = should_swap_to_image(obs, self.config, self.clock.now())
        if self.last_decision.go:
            return Result(Outcome.SWAP, "; ".join(self.last_decision.reasons))
        await self._idle_wait()
        return None

    async def _stop(self, role: Role) -> Result:
        try:
            await self._waiting(self.containers.stop(role, self.config.stop_timeout_seconds))
        except DockerError as exc:
            return Result(Outcome.FAILED, f"stopping the {role} container failed: {exc}")
        return Result(Outcome.OK, f"{role} container stopped")

    async def _start(self, role: Role) -> Result:
        try:
            await self._waiting(self.containers.start(role))
        except DockerError as exc:
            return Result(Outcome.FAILED, f"starting the {role} container failed: {exc}")
        return Result(Outcome.OK, f"{role} container started")

    async def _wait_release(self, names: tuple[str, ...], timeout: float, alert: str) -> Result:
        """Until the named clients hold no VRAM in card data scanned after this phase began."""
        since = self.state.phase_since
        deadline = self.clock.now() + timeout
        last = "no card data yet"
        while True:
            try:
                view = await self._waiting(self._card_view(since))
                if view.scanned_at >= since and released(view, names):
                    self._clear(alert)
                    return Result(Outcome.OK, f"{', '.join(names)} hold no VRAM any more")
                last = (
                    f"{', '.join(names)} still hold {view.vram_of(names) / 2**30:.1f} GiB"
                    if view.scanned_at >= since
                    else "card data not refreshed since the stop"
                )
            except CardDataError as exc:
                last = str(exc)
            if self.clock.now() >= deadline:
                message = f"memory not released after {timeout:g} s: {last}"
                self._alert(alert, message)
                return Result(Outcome.TIMEOUT, message)
            await self._pause(self.config.poll_interval_seconds)

    async def _stop_llm(self) -> Result:
        return await self._stop("llm")

    async def _wait_llm_release(self) -> Result:
        return await self._wait_release(
            self.config.llm_names, self.config.llm_release_timeout_seconds, "llm_release_timeout"
        )

    async def _start_image(self) -> Result:
        return await self._start("image")

    async def _wait_image_ready(self) -> Result:
        deadline = self.clock.now() + self.config.image_ready_timeout_seconds
        while True:
            if await self._waiting(self.comfy.ready()):
                self._clear("image_not_ready", "image_oom_killed")
                return Result(Outcome.OK, "ComfyUI answers /object_info")
            failure = await self._waiting(self._container_failure("image"))
            if failure is not None:
                name = "image_oom_killed" if "OOMKilled" in failure else "image_not_ready"
                self._alert(name, f"ComfyUI did not start: {failure}")
                return Result(Outcome.FAILED, f"ComfyUI did not start: {failure}")
            if self.clock.now() >= deadline:
                message = (
                    f"ComfyUI did not answer /object_info within "
                    f"{self.config.image_ready_timeout_seconds:g} s"
                )
                self._alert("image_not_ready", message)
                return Result(Outcome.TIMEOUT, message)
            await self._pause(self.config.poll_interval_seconds)

    async def _run_jobs(self) -> Result | None:
        proxy, _ = await self._proxy_state()
        image_since = self.state.image_since or self.state.phase_since
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
        try:
            return await self.run_job(job)
        finally:
            self.current_job = None

    async def _stop_image(self) -> Result:
        return await self._stop("image")

    async def _wait_image_release(self) -> Result:
        return await self._wait_release(
            self.config.image_names,
            self.config.image_release_timeout_seconds,
            "image_release_timeout",
        )

    async def _start_llm(self) -> Result:
        delay = llm_retry_delay(
            self.llm_failures,
            self.config.llm_retry_backoff_seconds,
            self.config.llm_retry_backoff_max_seconds,
        )
        if delay:
            await self._pause(delay)
        try:
            if self.llm_failures:
                # a failed or unready vLLM: restart it from scratch
                await self._waiting(self.containers.stop("llm", self.config.stop_timeout_seconds))
            await self._waiting(self.containers.start("llm"))
        except DockerError as exc:
            self.llm_failures += 1
            self._alert("llm_not_ready", f"starting vLLM failed: {exc}")
            return Result(Outcome.FAILED, f"starting the llm container failed: {exc}")
        return Result(Outcome.OK, "llm container started")

    async def _wait_llm_ready(self) -> Result:
        deadline = self.clock.now() + self.config.llm_ready_timeout_seconds
        last = "no answer yet"
        while True:
            try:
                await self._waiting(self.llm.health())
                await self._waiting(self.llm.one_token())
            except (Unavailable, Rejected) as exc:
                last = str(exc)
            else:
                self.llm_failures = 0
                self.llm_vram_failures = 0
                self._clear("llm_not_ready", "llm_insufficient_vram", "llm_oom_killed")
                return Result(Outcome.OK, "vLLM /health is 200 and a one-token completion passed")
            failure = await self._waiting(self._container_failure("llm"))
            if failure is not None:
                return await self._llm_start_failed(failure)
            if self.clock.now() >= deadline:
                self.llm_failures += 1
                message = (
                    f"vLLM not ready within {self.config.llm_ready_timeout_seconds:g} s "
                    f"(attempt {self.llm_failures}; last: {last}); restarting it"
                )
                self._alert("llm_not_ready", message)
                return Result(Outcome.TIMEOUT, message)
            await self._pause(self.config.poll_interval_seconds)

    async def _llm_start_failed(self, failure: str) -> Result:
        self.llm_failures += 1
        if "OOMKilled" in failure:
            self._alert("llm_oom_killed", failure)
        elif failure.startswith("insufficient VRAM"):
            self.llm_vram_failures += 1
            try:  # reclaim: whoever else holds the card, it must not be our ComfyUI
                view = await self._waiting(self._card_view(self.clock.now()))
                self.last_card = view
            except CardDataError:
                pass
            state = (
                f"attempt {self.llm_vram_failures} of {VRAM_MAX_ATTEMPTS}"
                if self.llm_vram_failures < VRAM_MAX_ATTEMPTS
                else f"{self.llm_vram_failures} attempts failed; free the card"
            )
            self._alert(
                "llm_insufficient_vram",
                f"vLLM could not get its memory ({failure}); {state}; "
                f"others on the card: {self._others_on_card()}",
            )
        else:
            self._alert("llm_not_ready", f"vLLM stopped while starting: {failure}")
        return Result(Outcome.FAILED, f"vLLM failed to start: {failure}")

    # -- jobs ------------------------------------------------------------------------------

    async def run_job(self, job: Job) -> Result | None:
        """Drive one job to an end (done/failed) or ask for a ComfyUI restart."""
        deadline = self.clock.now() + self.config.job_timeout_seconds
        while True:
            try:
                history = await self.comfy.history(job.prompt_id) if job.prompt_id else None
                in_queue = (
                    await self.comfy.in_queue(job.prompt_id)
                    if job.prompt_id and not history
                    else False
                )
            except (Unavailable, Rejected) as exc:
                return await self._comfy_died(job, str(exc))
            step = plan_job_step(job.prompt_id, history, in_queue)
            if step is JobStep.FETCH_OUTPUTS:
                assert history is not None
                return await self._fetch_outputs(job, history)
            if step is JobStep.FAILED:
                assert history is not None
                return await self._job_error(job, history_error(history))
            if step is JobStep.NEW_ATTEMPT:
                if job.attempts >= self.config.job_max_attempts:
                    self._finish(
                        job,
                        JobState.FAILED,
                        f"gave up after {job.attempts} attempt(s): {job.reason or 'no reason'}",
                    )
                    return None
                job = self.store.start_attempt(job.id, str(uuid.uuid4()), self.clock.now())
                step = JobStep.SUBMIT_SAME
            if step is JobStep.SUBMIT_SAME:
                assert job.prompt_id is not None
                try:
                    workflow = await self._prepare(job)
                    got = await self.comfy.submit(workflow, job.prompt_id)
                except Rejected as exc:
                    self._finish(job, JobState.FAILED, _rejection(exc))
                    return None
                except Unavailable as exc:
                    return await self._comfy_died(job, str(exc))
                if got != job.prompt_id:  # an older ComfyUI chose its own id
                    job = self.store.set_prompt_id(job.id, got)
                continue
            # POLL
            if self.clock.now() >= deadline:
                self._finish(
                    job,
                    JobState.FAILED,
                    "not finished within job_timeout_seconds "
                    f"({self.config.job_timeout_seconds:g})",
                )
                return Result(Outcome.RESTART, "a job timed out: restart ComfyUI to stop it")
            await self.clock.sleep(self.config.poll_interval_seconds)

    async def _prepare(self, job: Job) -> dict[str, Any]:
        """Upload the job's input images and point the workflow at their stored names."""
        workflow: dict[str, Any] = dict(job.workflow)
        renames: dict[str, str] = {}
        for name in job.inputs:
            data = (job_dir(self.config.data_dir, job.id) / "inputs" / name).read_bytes()
            stored = await self.comfy.upload_image(f"cardshare-{job.id}-{name}", data)
            renames[name] = stored
        if renames:
            workflow = _substitute(workflow, renames)
        return workflow

    async def _fetch_outputs(self, job: Job, history: dict[str, Any]) -> Result | None:
        images = history_images(history)
        outdir = job_dir(self.config.data_dir, job.id) / "outputs"
        try:
            for n, (filename, subfolder, kind) in enumerate(images):
                data = await self.comfy.view(filename, subfolder, kind)
                write_atomic(outdir / f"{n}.png", data)
        except (Unavailable, Rejected) as exc:
            return await self._comfy_died(job, f"fetching outputs failed: {exc}")
        if not images:
            self._finish(job, JobState.FAILED, "the workflow finished without output images")
            return None
        self._finish(job, JobState.DONE, "", outputs=len(images))
        return None

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
                f"others on the card: {self._others_on_card()}",
            )
            return None
        self._finish(job, JobState.FAILED, f"ComfyUI error: {message}")
        return None

    async def _comfy_died(self, job: Job, detail: str) -> Result:
        failure = await self._container_failure("image")
        reason = f"ComfyUI stopped answering ({detail})"
        if failure is not None:
            reason += f"; {failure}"
            if "OOMKilled" in failure:
                self._alert("image_oom_killed", failure)
        if job.prompt_id is not None:
            job = self.store.set_prompt_id(job.id, None)
        self.store.note(job.id, reason)
        if job.attempts >= self.config.job_max_attempts:
            self._finish(job, JobState.FAILED, f"{reason}; gave up after {job.attempts} attempt(s)")
        return Result(Outcome.RESTART, f"restart ComfyUI: {reason}")

    def _finish(self, job: Job, state: JobState, reason: str, outputs: int = 0) -> None:
        self.store.finish(job.id, state, reason, outputs, self.clock.now())
        log.info("job %s %s %s", job.id, state, reason)

    # -- jobs API helpers ---------------------------------------------------------------------

    def submit_job(self, workflow: dict[str, Any], inputs: dict[str, bytes]) -> Job:
        job_id = uuid.uuid4().hex
        indir = job_dir(self.config.data_dir, job_id) / "inputs"
        for name, data in inputs.items():
            write_atomic(indir / name, data)
        job = self.store.add_job(job_id, workflow, tuple(sorted(inputs)), self.clock.now())
        self.wake.set()
        return job


PHASE_ACTIONS: dict[Phase, Callable[[Engine], Awaitable[Result | None]]] = {
    Phase.SERVE_LLM: Engine._serve_llm,
    Phase.STOP_LLM: Engine._stop_llm,
    Phase.WAIT_LLM_RELEASE: Engine._wait_llm_release,
    Phase.START_IMAGE: Engine._start_image,
    Phase.WAIT_IMAGE_READY: Engine._wait_image_ready,
    Phase.RUN_JOBS: Engine._run_jobs,
    Phase.STOP_IMAGE: Engine._stop_image,
    Phase.WAIT_IMAGE_RELEASE: Engine._wait_image_release,
    Phase.START_LLM: Engine._start_llm,
    Phase.WAIT_LLM_READY: Engine._wait_llm_ready,
}


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


def check_input_name(name: Any) -> None:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name) > 200
    ):
        raise ValueError(f"input name {name!r} must be a plain file name")
