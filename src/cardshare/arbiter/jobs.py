"""The job runner: one image job driven to its end in ComfyUI, exactly once (its input images
uploaded and its save nodes given the job's own prefix; its prompt found again by id or by
its files; its outputs fetched, or found on disk, and stored), and the checks of a job's
inputs the API makes."""

from __future__ import annotations

import base64
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from cardshare.arbiter.cardview import CardDataError
from cardshare.arbiter.common import (
    Alert,
    Alerts,
    CardWatch,
    Clock,
    ContainerFailure,
    FailureKind,
    Pace,
    Result,
    container_failure,
)
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import ComfyApi, Containers, Rejected, Unavailable
from cardshare.arbiter.plans import workflow_signature
from cardshare.arbiter.reclaim import Reclaim
from cardshare.arbiter.resume import (
    JobStep,
    history_error,
    history_images,
    history_is_jobs,
    plan_job_step,
    save_nodes,
    save_prefix,
    saved_file_name,
    saver_extension,
)
from cardshare.arbiter.states import Outcome
from cardshare.arbiter.store import Job, JobState, Store, job_dir
from cardshare.atomicfile import write_atomic
from cardshare.errors import VRAM_MAX_ATTEMPTS, is_insufficient_vram_error

log = logging.getLogger("cardshare.arbiter")


class _NotAnImage(Unavailable):
    """ComfyUI answered a fetch of a saved output with something that is not an image."""


@dataclass
class Jobs:
    config: Config
    store: Store
    containers: Containers
    comfy: ComfyApi
    clock: Clock
    alerts: Alerts
    pace: Pace
    watch: CardWatch
    reclaim: Reclaim
    current_job: str | None = None
    step_job: str | None = None  # the job an error of the engine's step counts against
    pending_restart: str | None = None  # a failed poison job may still run there
    comfy_unanswered: int = 0  # polls ComfyUI did not answer, in a row
    # ComfyUI's largest VRAM seen during the job in hand
    job_peak: int = 0
    job_peak_since: float = 0.0  # when the running prompt was submitted (its samples after)

    def poison(self, exc: Exception) -> None:
        """Count the error against the job in hand; fail it after job_max_errors."""
        if self.step_job is None:
            return
        reason = f"the arbiter failed on this job: {type(exc).__name__}: {exc}"[:500]
        try:
            job = self.store.engine_error(self.step_job, reason)
            if job.errors >= self.config.job_max_errors and job.state is JobState.RUNNING:
                self._finish(job, JobState.FAILED, f"{reason} ({job.errors} times; gave up)")
                # its prompt may still run in ComfyUI: restart ComfyUI before the next job
                self.pending_restart = f"job {job.id} failed by the arbiter's errors"
        except Exception:  # the database itself fails: the storage guard catches it next
            log.exception("cannot record the error against job %s", self.step_job)

    async def run_next(self) -> Result | None:
        """Run the next queued job to its end (or to a restart of ComfyUI)."""
        job = self.store.next_job()
        if job is None:  # cancelled in between
            return None
        self.current_job = job.id
        self.step_job = job.id
        try:
            return await self.run_job(job)
        finally:
            self.current_job = None

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
                    workflow = await self.prepare(job)
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

    async def prepare(self, job: Job) -> dict[str, Any]:
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
        on_card = view.on(self.config.image_pdev).vram_of(self.config.image_names)
        self.job_peak = max(self.job_peak, on_card)


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
