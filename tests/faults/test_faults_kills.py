"""SIGKILL of the arbiter in each phase (as soon as /v1/status shows it), restarted at once
on the same data directory: it must converge to a consistent llm with every job done once.

Each phase is stretched to half a second by the fakes (a slow vLLM shutdown, a slow memory
release, a slow container start ...) so that the kill lands inside it."""

from __future__ import annotations

import pytest
from batch import Batch, Case, Record, Worker
from scenario import Fault, Scenario, as_case, run_scenario

pytestmark = pytest.mark.faults

SLOW = 0.5
CRASH = Fault("comfyui", "execute", "crash_before_save")

KILLS: dict[str, tuple[dict[str, object], tuple[Fault, ...]]] = {
    "serve_llm": ({}, ()),
    "stop_llm": ({"vllm_term_seconds": SLOW}, ()),
    "wait_llm_release": ({"vllm_release_seconds": SLOW}, ()),
    "start_image": ({"docker_start_seconds": SLOW}, ()),
    "wait_image_ready": ({"comfyui_boot_seconds": SLOW}, ()),
    "run_jobs": ({"comfyui_job_seconds": SLOW}, ()),
    "restart_image": ({"docker_start_seconds": SLOW}, (CRASH,)),
    "stop_image": ({"comfyui_term_seconds": SLOW}, ()),
    "wait_image_release": ({"comfyui_release_seconds": SLOW}, ()),
    "start_llm": ({"docker_start_seconds": SLOW}, ()),
    "wait_llm_ready": ({"vllm_boot_seconds": SLOW}, ()),
}


def kill_case(phase: str) -> Case:
    settings, faults = KILLS[phase]
    sc = Scenario(faults, phase, settings=dict(settings), kill_in=phase, jobs=2)
    inner = as_case(sc)

    def run(worker: Worker, record: Record, name: str) -> None:
        inner.run(worker, record, name)
        assert worker.shared().kills[-1] == phase

    return Case(run, inner.cost)


def killed_twice_in_run_jobs(worker: Worker, record: Record, name: str) -> None:
    """Killed while ComfyUI runs the prompt, restarted, killed again in the same job."""
    rig = worker.shared()
    sc = Scenario(
        (),
        "run_jobs (twice)",
        arm_at="executing",
        settings={"comfyui_job_seconds": 1.0},
        kill_in="run_jobs",
        jobs=2,
    )
    kills = len(rig.kills)
    original = rig.start_arbiter

    def restart_and_kill(wait: bool = True) -> None:
        original(wait)
        if len(rig.kills) == kills + 1:
            rig.kill_in_phase("run_jobs")
            original(wait)

    def twice() -> str | None:
        return None if len(rig.kills) >= kills + 2 else "killed once only"

    rig.start_arbiter = restart_and_kill  # type: ignore[method-assign]
    try:
        run_scenario(rig, sc, record, name, checks=(twice,))
    finally:
        rig.start_arbiter = original  # type: ignore[method-assign]


CASES = [
    *[pytest.param(kill_case(phase), id=phase) for phase in KILLS],
    pytest.param(Case(killed_twice_in_run_jobs, 4.0), id="run_jobs-twice"),
]


@pytest.mark.parametrize("case", CASES)
def test_sigkill_in_phase(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)
