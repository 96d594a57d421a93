"""Faults that outlive a restart of ComfyUI: a ``/view`` that keeps answering 500, or keeps
hanging, whatever the arbiter does. Restarting ComfyUI cannot cure them: the job must end
failed with its reason after a bounded number of restarts, the restarts of an hour are
bounded too, an alert is raised, and the card goes back to vLLM (issue 29, item 1)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from rig import Rig

pytestmark = pytest.mark.faults

VIEW_FAULTS = {
    "500": {"kind": "status", "status": 500},
    "hang": {"kind": "hang"},
}


def restarts(rig: Rig) -> int:
    """ComfyUI restarts the arbiter made, from its log (every run of it)."""
    count = 0
    for run in range(1, rig.arbiter_runs + 1):
        path = rig.root / f"arbiter-{run}.log"
        count += len(
            re.findall(
                r"restart_image -> wait_image_ready \(ok\)", path.read_text(errors="replace")
            )
        )
    return count


@pytest.mark.parametrize("fault", sorted(VIEW_FAULTS))
def test_a_persistent_view_fault_fails_the_job_after_bounded_restarts(
    fresh: Callable[..., Rig], record: Callable[..., None], fault: str
) -> None:
    rig = fresh(config={"comfyui_max_restarts_per_hour": 12})  # job_max_restarts 3: default
    rig.wait_llm(30.0)
    spec: dict[str, Any] = dict(VIEW_FAULTS[fault])
    rig.fault("comfyui", "GET /view", spec.pop("kind"), None, **spec)
    start = time.time()
    rig.submit(2)
    back: float | None = None
    with contextlib.suppress(AssertionError):
        back = rig.wait_llm(60.0) - start
    count = restarts(rig)
    verdict = rig.verdict(may_fail=r"gave up after 3 restarts of ComfyUI for this job")
    alerts = rig.alerts_raised(since=start)
    record(
        fault=f"comfyui GET /view: {fault} until cleared",
        phase="run_jobs",
        jobs=verdict.jobs,
        done=verdict.done,
        failed=verdict.failed,
        duplicates=len(verdict.duplicates),
        lost=len(verdict.lost),
        back_to_llm=None if back is None else round(back, 1),
        alerts=",".join(sorted(alerts)),
        extra=f"{count} restarts of ComfyUI",
        result="ok" if back is not None else "FAILED",
    )
    assert back is not None, f"not back to llm in 60 s: {count} restarts\n{rig.arbiter_log(40)}"
    assert count <= 2 * 3, f"{count} restarts for 2 jobs (job_max_restarts 3)"
    assert verdict.failed == 2 and not verdict.unexpected_failures, verdict.failures
    assert not verdict.lost and not verdict.duplicates
    assert "image_crashed" in alerts, alerts


def test_the_restarts_of_an_hour_are_bounded_and_the_card_goes_back(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    """With comfyui_max_restarts_per_hour 4: the fifth restart is not made; the card goes back
    to vLLM with the jobs kept queued, an alert says why, and no swap to image is tried again
    while the hour's restarts are spent."""
    rig = fresh(config={"job_max_restarts": 3, "comfyui_max_restarts_per_hour": 4})
    rig.wait_llm(30.0)
    rig.fault("comfyui", "GET /view", "status", None, status=500)
    start = time.time()
    ids = rig.submit(3)

    def parked() -> bool:
        st = rig.status()
        return st["phase"] == "serve_llm" and any(
            a["name"] == "image_restart_limit" for a in st["alerts"]
        )

    rig.wait(parked, 60.0, "back in serve_llm with the image_restart_limit alert")
    parked_at = time.time()
    starts = rig.docker.containers()["comfyui"]["starts"]
    time.sleep(8.0)
    st = rig.status()
    after = rig.docker.containers()
    count = restarts(rig)
    states = [(rig.job(j) or {}).get("state") for j in ids]
    record(
        fault="comfyui GET /view: 500 until cleared; 4 restarts an hour",
        phase="run_jobs",
        jobs=len(ids),
        failed=states.count("failed"),
        lost=sum(s is None for s in states),
        back_to_llm=round(parked_at - start, 1),
        alerts=",".join(a["name"] for a in st["alerts"]),
        extra=f"{count} restarts; states {states}",
        result="ok" if count == 4 and after["comfyui"]["starts"] == starts else "FAILED",
    )
    assert count == 4, count
    assert st["phase"] == "serve_llm" and st["mode"] == "llm", st["phase"]
    assert after["vllm"]["running"] and not after["comfyui"]["running"], after
    assert after["comfyui"]["starts"] == starts, "a swap to image was tried again"
    assert states[0] == "failed" and states.count(None) == 0, states
    assert st["queue_length"] == 2, st["queue_length"]  # kept, not lost
    assert "comfyui_max_restarts_per_hour" in next(
        a["message"] for a in st["alerts"] if a["name"] == "image_restart_limit"
    )
