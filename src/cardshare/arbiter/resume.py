"""What to do after a restart: pure plans from the persisted phase and the real world.

An arbiter killed at any moment (SIGKILL included) starts again from its database. These
functions compare the persisted phase with the containers' actual states and, for a job
that was running, with ComfyUI's history, and say where to continue. Actions of every
phase are idempotent (stopping a stopped container, starting a running one, waiting for
a release that already happened), so "continue in the same phase" is always safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cardshare.arbiter.states import Phase


@dataclass(frozen=True)
class ResumePlan:
    phase: Phase  # where to continue (may be the persisted phase itself)
    reason: str


def plan_resume(
    phase: Phase, llm_running: bool, image_running: bool, queue_length: int, held: bool = False
) -> ResumePlan:
    """Where to continue, given the persisted phase and the containers' real states.

    ``held``: a hold on swaps is active (a role's probe runs ComfyUI beside vLLM for a
    moment, with the arbiter's consent): ComfyUI running then is the probe's, not a swap
    left half done, and is left alone.
    """
    if phase is Phase.SERVE_LLM:
        if image_running and held and llm_running:
            return ResumePlan(phase, "ComfyUI runs for a held probe: keep serving")
        if image_running:
            return ResumePlan(Phase.STOP_IMAGE, "ComfyUI runs while serving the LLM: hand back")
        if not llm_running:
            return ResumePlan(Phase.START_LLM, "vLLM is not running: start it")
        return ResumePlan(phase, "vLLM runs: keep serving")
    if phase in (Phase.STOP_LLM, Phase.WAIT_LLM_RELEASE):
        if queue_length == 0:
            if llm_running and not image_running:
                return ResumePlan(Phase.SERVE_LLM, "no jobs left and vLLM still runs: back to llm")
            return ResumePlan(Phase.STOP_IMAGE, "no jobs left: hand the card back")
        if llm_running and phase is Phase.WAIT_LLM_RELEASE:
            return ResumePlan(Phase.STOP_LLM, "vLLM runs again: stop it again")
        return ResumePlan(phase, "jobs queued: continue the swap")
    if phase in (Phase.START_IMAGE, Phase.WAIT_IMAGE_READY, Phase.RUN_JOBS):
        if llm_running:
            return ResumePlan(Phase.STOP_IMAGE, "vLLM runs beside ComfyUI: hand back")
        if queue_length == 0:
            return ResumePlan(Phase.STOP_IMAGE, "no jobs left: hand the card back")
        if phase is Phase.RUN_JOBS and not image_running:
            return ResumePlan(Phase.START_IMAGE, "ComfyUI is not running: start it again")
        return ResumePlan(phase, "continue")
    if phase is Phase.START_LLM and llm_running and not image_running:
        return ResumePlan(Phase.WAIT_LLM_READY, "vLLM already started: wait until ready")
    # stop_image, wait_image_release, start_llm, wait_llm_ready: idempotent, continue
    return ResumePlan(phase, "continue the handback")


class JobStep(StrEnum):
    NEW_ATTEMPT = "new_attempt"  # no prompt recorded: look on disk, else a new prompt id
    POLL = "poll"  # ComfyUI has it queued or running: keep polling
    FETCH_OUTPUTS = "fetch_outputs"  # finished successfully: fetch the outputs
    FAILED = "failed"  # finished with an error (an interrupted prompt included)
    LOOK_ON_DISK = "look_on_disk"  # in neither queue nor history: its files decide


def history_status(entry: dict[str, Any] | None) -> str | None:
    """``success`` / ``error`` for a finished history entry, None while unfinished."""
    if not entry:
        return None
    status = entry.get("status")
    if not isinstance(status, dict):
        return "success" if entry.get("outputs") else None
    status_str = status.get("status_str")
    if status_str == "error":
        return "error"
    if status.get("completed") is True or status_str == "success":
        return "success"
    return None


def plan_job_step(prompt_id: str | None, in_queue: bool, history: dict[str, Any] | None) -> JobStep:
    """The next step for a job, from its recorded prompt id and what ComfyUI knows.

    The queue is read BEFORE the history: ComfyUI moves a finished prompt from its queue
    into its history in one step, so a prompt not in the queue at the first read is in the
    history at the second unless ComfyUI forgot it (a restart: history is in memory only).
    Reading them the other way round, a prompt finishing between the reads is in neither,
    and would be posted again. A prompt in neither place is decided by its files on disk
    (the job's own filename prefix), never by posting it again blindly.
    """
    if prompt_id is None:
        return JobStep.NEW_ATTEMPT
    if in_queue:
        return JobStep.POLL
    finished = history_status(history)
    if finished == "success":
        return JobStep.FETCH_OUTPUTS
    if finished == "error":
        return JobStep.FAILED
    if history:
        return JobStep.POLL
    return JobStep.LOOK_ON_DISK


def history_error(entry: dict[str, Any]) -> str:
    """The error text of a failed prompt from its history messages."""
    status = entry.get("status") or {}
    for message in status.get("messages") or []:
        if (
            isinstance(message, list)
            and len(message) == 2
            and message[0] == "execution_interrupted"
        ):
            return "the prompt was interrupted (execution_interrupted)"
        if isinstance(message, list) and len(message) == 2 and message[0] == "execution_error":
            data = message[1] if isinstance(message[1], dict) else {}
            node = data.get("node_type") or data.get("node_id") or "?"
            kind = data.get("exception_type") or "error"
            text = str(data.get("exception_message") or "").strip()
            return f"node {node} raised {kind}: {text}"
    return "ComfyUI reported status error without an execution_error message"


SAVE_PREFIX_ROOT = "cardshare"

# ComfyUI's save nodes whose files the arbiter can find on disk when ComfyUI's history is
# gone, by the extension each writes (ComfyUI 0.8, nodes.py and comfy_extras/nodes_images.py:
# ``<prefix>_<counter:05>_.<ext>``) and whose files are images the arbiter can return. Any
# other node with a ``filename_prefix`` (audio, video, latents, 3D, custom savers naming
# their files otherwise) is refused at submission: a job whose files cannot be found after a
# restart of ComfyUI would be run again.
SAVER_EXTENSIONS: dict[str, str] = {
    "SaveImage": "png",
    "SaveAnimatedPNG": "png",
    "SaveAnimatedWEBP": "webp",
}


def save_nodes(workflow: dict[str, Any]) -> list[str]:
    """The ids of the workflow's save nodes (``SaveImage``, or any node that takes a
    ``filename_prefix``), in a stable order."""
    found = []
    for node_id, node in workflow.items():
        if not isinstance(node, dict):
            continue
        inputs = node.get("inputs")
        if node.get("class_type") == "SaveImage" or (
            isinstance(inputs, dict) and "filename_prefix" in inputs
        ):
            found.append(str(node_id))
    return sorted(found, key=lambda k: (len(k), k))


def prompt_writes_under(prompt: Any, subfolder: str) -> bool:
    """A prompt (API format) whose save nodes write under ``subfolder``: a job's own (the
    arbiter gives every save node of a job the job's subfolder)."""
    if not isinstance(prompt, dict):
        return False
    for node in prompt.values():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        prefix = inputs.get("filename_prefix") if isinstance(inputs, dict) else None
        if isinstance(prefix, str) and prefix.startswith(subfolder + "/"):
            return True
    return False


def history_is_jobs(entry: dict[str, Any], subfolder: str) -> bool:
    """Whether a history entry is the job's (``subfolder`` its own): its prompt, as ComfyUI
    keeps it (``[number, id, prompt, extra, outputs]``), writes there, or, without it, every
    image it lists is there. An id ComfyUI answered is never proof enough: a restarted
    server, a proxy or a bug can answer one that another prompt had."""
    prompt = entry.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 2:
        return prompt_writes_under(prompt[2], subfolder)
    images = history_images(entry)
    return all(sub == subfolder or sub.startswith(subfolder + "/") for _, sub, _ in images)


def save_prefix(job_id: str, index: int) -> tuple[str, str]:
    """(subfolder, file name stem) of a job's ``index``-th save node: unique to the job,
    so its outputs are found on disk when ComfyUI's in-memory history is gone."""
    return f"{SAVE_PREFIX_ROOT}/{job_id}", f"s{index}"


def saved_file_name(stem: str, counter: int, extension: str = "png") -> str:
    """ComfyUI's name for a saved file: ``<stem>_<counter:05>_.<extension>``, counting
    from 1."""
    return f"{stem}_{counter:05}_.{extension}"


def saver_extension(workflow: dict[str, Any], node_id: str) -> str:
    """The extension the save node writes (png for a node of another class: a job stored
    before such nodes were refused)."""
    node = workflow.get(node_id)
    kind = node.get("class_type") if isinstance(node, dict) else None
    return SAVER_EXTENSIONS.get(kind, "png") if isinstance(kind, str) else "png"


def unfindable_savers(workflow: dict[str, Any]) -> list[str]:
    """The save nodes whose files the arbiter could not find after a restart of ComfyUI,
    as ``node <id> (<class>)``."""
    found = []
    for node_id in save_nodes(workflow):
        kind = workflow[node_id].get("class_type")
        if kind not in SAVER_EXTENSIONS:
            found.append(f"node {node_id} ({kind})")
    return found


def history_images(entry: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(filename, subfolder, type) of the prompt's output images, saved ones first.

    Preview images (type ``temp``) are only used when the workflow saved none.
    """
    found: list[tuple[str, str, str]] = []
    outputs = entry.get("outputs") or {}
    for node_id in sorted(outputs, key=lambda k: (len(str(k)), str(k))):
        node = outputs[node_id]
        for image in (node.get("images") if isinstance(node, dict) else None) or []:
            if isinstance(image, dict) and image.get("filename"):
                found.append(
                    (
                        str(image["filename"]),
                        str(image.get("subfolder", "") or ""),
                        str(image.get("type", "output") or "output"),
                    )
                )
    saved = [i for i in found if i[2] == "output"]
    return saved or found
