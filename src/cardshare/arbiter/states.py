"""Modes, phases and the transitions between them, as data.

The arbiter is always in exactly one phase; the mode (what the proxy and the status show)
follows from the phase. Each phase's action ends with an :class:`Outcome`, and the table
:data:`TRANSITIONS` says which phase comes next. Nothing else moves the machine.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    LLM = "llm"
    SWAPPING = "swapping"
    IMAGE = "image"


class Phase(StrEnum):
    SERVE_LLM = "serve_llm"
    # to image
    STOP_LLM = "stop_llm"
    WAIT_LLM_RELEASE = "wait_llm_release"
    START_IMAGE = "start_image"
    WAIT_IMAGE_READY = "wait_image_ready"
    # in image
    RUN_JOBS = "run_jobs"
    RESTART_IMAGE = "restart_image"  # interrupt, clear the queue, restart ComfyUI
    # handback
    STOP_IMAGE = "stop_image"
    WAIT_IMAGE_RELEASE = "wait_image_release"
    START_LLM = "start_llm"
    WAIT_LLM_READY = "wait_llm_ready"


class Outcome(StrEnum):
    OK = "ok"  # the phase's work is done
    SWAP = "swap"  # serve_llm: the rules say swap to image
    TIMEOUT = "timeout"  # a bounded wait ran out
    FAILED = "failed"  # the action failed
    HAND_BACK = "hand_back"  # run_jobs: the rules say hand the card back
    RESTART = "restart"  # run_jobs: ComfyUI died or a job hangs: restart ComfyUI
    RESUME = "resume"  # after a restart of the arbiter: converge with the real world
    REPLAN = "replan"  # serve_llm: a larger plan of vLLM fits again at an idle moment


MODE_OF: dict[Phase, Mode] = {
    Phase.SERVE_LLM: Mode.LLM,
    Phase.STOP_LLM: Mode.SWAPPING,
    Phase.WAIT_LLM_RELEASE: Mode.SWAPPING,
    Phase.START_IMAGE: Mode.SWAPPING,
    Phase.WAIT_IMAGE_READY: Mode.SWAPPING,
    Phase.RUN_JOBS: Mode.IMAGE,
    Phase.RESTART_IMAGE: Mode.IMAGE,
    Phase.STOP_IMAGE: Mode.SWAPPING,
    Phase.WAIT_IMAGE_RELEASE: Mode.SWAPPING,
    Phase.START_LLM: Mode.SWAPPING,
    Phase.WAIT_LLM_READY: Mode.SWAPPING,
}

TO_IMAGE_PHASES = (
    Phase.STOP_LLM,
    Phase.WAIT_LLM_RELEASE,
    Phase.START_IMAGE,
    Phase.WAIT_IMAGE_READY,
)
HANDBACK_PHASES = (
    Phase.STOP_IMAGE,
    Phase.WAIT_IMAGE_RELEASE,
    Phase.START_LLM,
    Phase.WAIT_LLM_READY,
)

# what the arbiter does to each owner of the card, as the moves (from, to) that end it, and
# the phases in which the owner runs: the status page weighs them against the card's scan
OWNER_STARTS: dict[str, tuple[tuple[Phase, Phase], ...]] = {
    "llm": ((Phase.START_LLM, Phase.WAIT_LLM_READY),),
    "image": (
        (Phase.START_IMAGE, Phase.WAIT_IMAGE_READY),
        (Phase.RESTART_IMAGE, Phase.WAIT_IMAGE_READY),
    ),
}
OWNER_STOPS: dict[str, tuple[tuple[Phase, Phase], ...]] = {
    "llm": ((Phase.STOP_LLM, Phase.WAIT_LLM_RELEASE),),
    "image": ((Phase.STOP_IMAGE, Phase.WAIT_IMAGE_RELEASE),),
}
OWNER_RUNS: dict[str, frozenset[Phase]] = {
    "llm": frozenset({Phase.WAIT_LLM_READY, Phase.SERVE_LLM, Phase.STOP_LLM}),
    "image": frozenset(
        {Phase.WAIT_IMAGE_READY, Phase.RUN_JOBS, Phase.RESTART_IMAGE, Phase.STOP_IMAGE}
    ),
}

# (phase, outcome) -> next phase. A pair that is not here is a bug, not a run-time choice.
TRANSITIONS: dict[tuple[Phase, Outcome], Phase] = {
    (Phase.SERVE_LLM, Outcome.SWAP): Phase.STOP_LLM,
    # vLLM exited while serving: start it again (with backoff), never keep saying llm
    (Phase.SERVE_LLM, Outcome.FAILED): Phase.START_LLM,
    # a smaller plan serves and a larger one fits again, at an idle moment: start_llm stops
    # the running plan, waits for its memory and starts the larger one
    (Phase.SERVE_LLM, Outcome.REPLAN): Phase.START_LLM,
    (Phase.STOP_LLM, Outcome.OK): Phase.WAIT_LLM_RELEASE,
    # vLLM would not stop: make sure it runs and serve again.
    (Phase.STOP_LLM, Outcome.FAILED): Phase.START_LLM,
    (Phase.WAIT_LLM_RELEASE, Outcome.OK): Phase.START_IMAGE,
    # Its memory never left the card: give it back to vLLM.
    (Phase.WAIT_LLM_RELEASE, Outcome.TIMEOUT): Phase.START_LLM,
    (Phase.START_IMAGE, Outcome.OK): Phase.WAIT_IMAGE_READY,
    (Phase.START_IMAGE, Outcome.FAILED): Phase.STOP_IMAGE,
    (Phase.WAIT_IMAGE_READY, Outcome.OK): Phase.RUN_JOBS,
    (Phase.WAIT_IMAGE_READY, Outcome.TIMEOUT): Phase.STOP_IMAGE,
    (Phase.WAIT_IMAGE_READY, Outcome.FAILED): Phase.STOP_IMAGE,
    (Phase.RUN_JOBS, Outcome.HAND_BACK): Phase.STOP_IMAGE,
    (Phase.RUN_JOBS, Outcome.RESTART): Phase.RESTART_IMAGE,
    # a restart is proven by a new start time; then ComfyUI must answer again
    (Phase.RESTART_IMAGE, Outcome.OK): Phase.WAIT_IMAGE_READY,
    (Phase.RESTART_IMAGE, Outcome.FAILED): Phase.STOP_IMAGE,
    (Phase.STOP_IMAGE, Outcome.OK): Phase.WAIT_IMAGE_RELEASE,
    # never back to llm with ComfyUI still on the card: stop it again (with backoff)
    (Phase.STOP_IMAGE, Outcome.FAILED): Phase.STOP_IMAGE,
    (Phase.WAIT_IMAGE_RELEASE, Outcome.OK): Phase.START_LLM,
    # Start vLLM anyway: it refuses by itself when memory is short, and is retried.
    (Phase.WAIT_IMAGE_RELEASE, Outcome.TIMEOUT): Phase.START_LLM,
    (Phase.START_LLM, Outcome.OK): Phase.WAIT_LLM_READY,
    (Phase.START_LLM, Outcome.FAILED): Phase.START_LLM,
    (Phase.WAIT_LLM_READY, Outcome.OK): Phase.SERVE_LLM,
    # Not healthy in time: restart it (with backoff), never declare llm.
    (Phase.WAIT_LLM_READY, Outcome.TIMEOUT): Phase.START_LLM,
    (Phase.WAIT_LLM_READY, Outcome.FAILED): Phase.START_LLM,
}


class TransitionError(RuntimeError):
    pass


def next_phase(phase: Phase, outcome: Outcome) -> Phase:
    try:
        return TRANSITIONS[(phase, outcome)]
    except KeyError:
        raise TransitionError(f"no transition from phase {phase} on outcome {outcome}") from None


def swap_direction(phase: Phase) -> str | None:
    """'to_image' or 'to_llm' for a swap phase, None for the steady phases."""
    if phase in TO_IMAGE_PHASES:
        return "to_image"
    if phase in HANDBACK_PHASES:
        return "to_llm"
    return None
