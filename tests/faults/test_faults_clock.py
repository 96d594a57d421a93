"""The wall clock steps under a running arbiter (an NTP correction, a manual change): its
timeouts and backoffs run on the monotonic clock, so a step neither leaves a hung job untimed
nor fails a healthy one (issue 29, item 4). The step is simulated in the arbiter's process
only (wallclock.py): the machine's clock is shared and not touched."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import pytest
from rig import HERE, Rig

pytestmark = pytest.mark.faults

STEP = 3600.0


def stepped_rig(fresh: Callable[..., Rig], **kw: object) -> tuple[Rig, Callable[[float], None]]:
    rig = fresh(start=False, **kw)
    offset = rig.root / "wall-offset"
    rig.wrapper = [sys.executable, str(HERE / "wallclock.py"), str(offset)]
    rig.start()

    def step(seconds: float) -> None:
        tmp = offset.with_name(".wall-offset")
        tmp.write_text(f"{seconds}\n")
        tmp.replace(offset)

    return rig, step


def test_a_hung_job_is_timed_out_after_the_wall_clock_steps_back(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    rig, step = stepped_rig(fresh)
    rig.wait_llm(30.0)
    rule = rig.fault("comfyui", "execute", "exec_hang", 1)
    (job,) = rig.submit(1)
    rig.wait(rig.executing, 15.0, "ComfyUI runs the job")
    begun = time.time()
    step(-STEP)
    failed: float | None = None
    try:
        rig.wait(lambda: (rig.job(job) or {}).get("state") == "failed", 20.0, "the job failed")
        failed = time.time() - begun
    except AssertionError:
        pass
    reason = (rig.job(job) or {}).get("reason", "")
    record(
        fault="the wall clock steps back an hour under a hung job (job_timeout_seconds 4)",
        phase="run_jobs",
        jobs=1,
        failed=int(failed is not None),
        back_to_llm=None if failed is None else round(failed, 1),
        extra=f"failed {failed} s after the step: {reason[:60]}",
        result="ok" if failed is not None else "FAILED",
    )
    rig.clear("comfyui", rule)
    assert failed is not None, "the hung job was not timed out within 20 s of the step"
    assert failed <= 4.0 + 3.0, failed
    assert reason.startswith("not finished within job_timeout_seconds"), reason
    rig.wait_llm(30.0)


def test_a_healthy_job_is_not_failed_when_the_wall_clock_steps_forward(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    rig, step = stepped_rig(fresh, settings={"comfyui_job_seconds": 2.0})
    rig.wait_llm(30.0)
    (job,) = rig.submit(1)
    rig.wait(rig.executing, 15.0, "ComfyUI runs the job")
    stepped = time.time()
    step(+STEP)
    back = rig.wait_llm(30.0)
    doc = rig.job(job) or {}
    verdict = rig.verdict()
    record(
        fault="the wall clock steps forward an hour under a healthy 2 s job",
        phase="run_jobs",
        jobs=1,
        done=verdict.done,
        failed=verdict.failed,
        duplicates=len(verdict.duplicates),
        back_to_llm=round(back - stepped, 1),
        extra=f"state {doc.get('state')}: {doc.get('reason', '')[:60]}",
        result="ok" if doc.get("state") == "done" else "FAILED",
    )
    assert doc.get("state") == "done", doc
    assert not verdict.duplicates and not verdict.wrong_outputs
