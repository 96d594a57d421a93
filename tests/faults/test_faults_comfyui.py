"""Faults on the ComfyUI edge: /object_info (readiness), /prompt, /queue, /history, /view,
/upload/image, /interrupt and POST /queue (restart and cancel), and ComfyUI's own failures
(crashes before and after saving, with and without a restart policy, errors, hangs)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from batch import Batch, Case
from rig import WORKFLOW, WORKFLOW_INPUT, Http, Rig
from scenario import Fault, Scenario, cases

pytestmark = pytest.mark.faults


def F(route: str, kind: str, n: int | None = 1, **kw: object) -> Fault:
    if kind.isdigit():
        return Fault("comfyui", route, "status", n, status=int(kind), **kw)  # type: ignore[arg-type]
    return Fault("comfyui", route, kind, n, **kw)  # type: ignore[arg-type]


def S(*faults: Fault, phase: str = "run_jobs", **kw: object) -> Scenario:
    return Scenario(tuple(faults), phase, **kw)  # type: ignore[arg-type]


def P(sc: Scenario, name: str) -> object:
    return pytest.param(sc, id=name)


CRASHED = ("image_crashed",)
# a reset of a GET is retried once by aiohttp: two resets reach the arbiter as one failure
GET_KINDS = {"exception": 2, "garbage": 1, "badjson": 1, "hang": 1, "500": 1, "404": 1}
RUNNING = {"arm_at": "executing", "settings": {"comfyui_job_seconds": 0.3}}

SCENARIOS = [
    # readiness: not ready yet, asked again within image_ready_timeout_seconds
    *[
        P(S(F("GET /object_info", k, 3 * n), phase="wait_image_ready"), f"object_info-{k}")
        for k, n in GET_KINDS.items()
    ],
    # longer than image_ready_timeout_seconds (3 s): alert, card handed back, jobs kept
    P(
        S(
            F("GET /object_info", "500", None),
            phase="wait_image_ready",
            clear_after=4.0,
            alerts=("image_not_ready",),
        ),
        "object_info-500-until-cleared",
    ),
    # POST /prompt not taken: restart ComfyUI, a new attempt
    *[
        P(S(F("POST /prompt", k), alerts=CRASHED), f"prompt-{k}")
        for k in ("exception", "close", "garbage", "badjson", "hang", "500")
    ],
    # taken by ComfyUI, the answer lost: after the restart its files decide, never twice
    *[
        P(S(F("POST /prompt", k, when="after"), alerts=CRASHED), f"prompt-{k}-after")
        for k in ("exception", "garbage", "hang", "500")
    ],
    # the job itself is wrong: failed with ComfyUI's reason, the other job runs
    P(
        S(F("POST /prompt", "400"), may_fail="^ComfyUI rejected the workflow: Cannot execute"),
        "prompt-400",
    ),
    # as many times as job_max_attempts: failed with the reason
    P(
        S(F("POST /prompt", "500", 3), alerts=CRASHED, may_fail="gave up after 3 attempt"),
        "prompt-500-x3",
    ),
    # polls that get no answer: fewer than comfyui_unanswered_polls are polled again
    *[P(S(F("GET /queue", k, 2 * n)), f"queue-{k}-x{2 * n}") for k, n in GET_KINDS.items()],
    *[
        P(S(F("GET /queue", k, 3 * n), alerts=CRASHED), f"queue-{k}-x{3 * n}-restart")
        for k, n in GET_KINDS.items()
        if k in ("exception", "garbage", "hang", "500")
    ],
    *[P(S(F("GET /history", k, 2 * n)), f"history-{k}-x{2 * n}") for k, n in GET_KINDS.items()],
    *[
        P(S(F("GET /history", k, 3 * n), alerts=CRASHED), f"history-{k}-x{3 * n}-restart")
        for k, n in GET_KINDS.items()
        if k in ("exception", "badjson", "hang", "404")
    ],
    # a history that forgot the prompt (as after a restart): its files decide, not a re-run
    P(S(F("GET /history", "badjson", 1, body="{}")), "history-forgotten"),
    P(S(F("GET /history", "badjson", 1, body="{}"), workflow="two_saves"), "history-forgotten-2"),
    # looking for a job's files before its first submission fails: restart ComfyUI first
    *[
        P(S(F("GET /view", k, n), alerts=CRASHED), f"view-probe-{k}")
        for k, n in GET_KINDS.items()
        if k in ("exception", "garbage", "hang", "500")
    ],
    # fetching the outputs of a finished prompt fails while ComfyUI runs: its saved files
    # are asked for again (the prompt ran: it is never run again); no crash, no restart
    *[
        P(S(F("GET /view", k, n), **RUNNING), f"view-fetch-{k}")
        for k, n in GET_KINDS.items()
        if k != "badjson"
    ],
    # /view answers 200 with something that is not the image (a proxy's error page)
    P(
        S(F("GET /view", "badjson", 1, body="<html>502 Bad Gateway</html>"), **RUNNING),
        "view-fetch-not-an-image",
    ),
    # /view answers 404 twice for a file the history listed (an output mount that glitched)
    P(S(F("GET /view", "404", 2), **RUNNING), "view-fetch-404-x2"),
    # uploading the job's input image
    *[
        P(S(F("POST /upload/image", k), workflow="input", alerts=CRASHED), f"upload-{k}")
        for k in ("exception", "hang", "500")
    ],
    P(
        S(F("POST /upload/image", "400"), workflow="input", may_fail="^ComfyUI rejected"),
        "upload-400",
    ),
    # a restart whose interrupt and queue clearing fail too (a dead ComfyUI answers neither)
    P(
        S(
            F("GET /queue", "500", 3),
            F("POST /interrupt", "exception"),
            F("POST /queue", "hang"),
            phase="restart_image",
            alerts=CRASHED,
        ),
        "restart-interrupt-and-clear-fail",
    ),
    # DELETE of a running job: interrupted; when /interrupt fails ComfyUI is restarted
    # (the job runs 3 s in the fake: the cancel lands while it runs, on a loaded machine too)
    P(S(cancel_first=True, settings={"comfyui_job_seconds": 3.0}), "cancel-running"),
    *[
        P(
            S(F("POST /interrupt", k), cancel_first=True, settings={"comfyui_job_seconds": 3.0}),
            f"cancel-interrupt-{k}",
        )
        for k in ("exception", "hang", "500")
    ],
    # ComfyUI's own failures
    P(S(F("execute", "crash_before_save"), alerts=CRASHED), "crash-before-save"),
    P(S(F("execute", "crash_after_save"), alerts=CRASHED), "crash-after-save"),
    P(
        S(F("execute", "crash_after_save"), workflow="two_saves", alerts=CRASHED),
        "crash-after-save-2",
    ),
    # a saver that writes WebP (SaveAnimatedWEBP): its .webp file on disk is the evidence
    P(
        S(F("execute", "crash_after_save"), workflow="webp", alerts=CRASHED),
        "crash-after-save-webp",
    ),
    P(
        S(
            F("execute", "crash_after_save"),
            workflow="webp",
            settings={"comfyui_restart_policy": "on-failure"},
        ),
        "crash_after_save-webp-respawn",
    ),
    P(S(F("GET /history", "badjson", 1, body="{}"), workflow="webp"), "history-forgotten-webp"),
    # with a restart policy ComfyUI is back at once with an empty history
    *[
        P(S(F("execute", k), settings={"comfyui_restart_policy": "on-failure"}), f"{k}-respawn")
        for k in ("crash_before_save", "crash_after_save")
    ],
    P(S(crash="comfyui", alerts=CRASHED, **RUNNING), "killed"),
    P(S(crash="comfyui+respawn", **RUNNING), "killed-respawn"),
    P(
        S(
            F("execute", "exec_error", message="mat1 and mat2 shapes cannot be multiplied"),
            may_fail="^ComfyUI error: node KSampler raised RuntimeError: mat1",
        ),
        "execution-error",
    ),
    P(
        S(F("execute", "exec_error", message="XPU out of memory. Tried to allocate 2.00 GiB")),
        "execution-vram-error-once",
    ),
    P(
        S(F("execute", "exec_hang"), may_fail="^not finished within job_timeout_seconds"),
        "execution-hangs",
    ),
    # POST /free before a job whose workflow ran before, while ComfyUI holds the other
    # workflow's models: when the request fails or the release never shows in the card data,
    # the job runs anyway after image_release_timeout_seconds; none lost, none run twice
    *[
        P(S(F("POST /free", k), workflow="mixed", jobs=4), f"free-{k}")
        for k in ("exception", "garbage", "hang", "500")
    ],
    P(
        S(workflow="mixed", jobs=4, settings={"comfyui_vram_after_free": 20 * 2**30}),
        "free-never-released",
    ),
]


@pytest.mark.parametrize("case", cases(SCENARIOS))
def test_comfyui_fault(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)


def test_free_before_a_job_waits_for_the_release(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    """The third job's workflow ran before (its peak is known) while ComfyUI holds the second
    one's models: /free is asked first, and the job waits until the card data shows the
    release (ComfyUI acts on /free later, in its prompt worker, after half a second here)."""
    rig = fresh(
        config={"image_release_timeout_seconds": 10.0},
        settings={"comfyui_free_seconds": 0.5},
    )
    rig.wait_llm(30.0)
    for n in range(3):
        rig.submit(1, workflow=(WORKFLOW, WORKFLOW_INPUT)[n % 2])
    rig.wait_llm(60.0)
    verdict = rig.verdict()
    log = rig.arbiter_log(400)
    record(
        fault="none: a job after another workflow's models",
        phase="run_jobs",
        jobs=verdict.jobs,
        done=verdict.done,
        failed=verdict.failed,
        duplicates=len(verdict.duplicates),
        lost=len(verdict.lost),
        result="ok" if verdict.done == 3 else "FAILED",
    )
    assert (verdict.done, verdict.lost, verdict.duplicates) == (3, [], {})
    third = list(rig.jobs)[2]
    # the release seen in the card data (384 MiB kept of 20 GiB), not /free's 200
    assert f"job {third}: ComfyUI holds 402653184 bytes after /free (21474836480 before)" in log
    assert "not released within" not in log, log


@pytest.mark.parametrize("when", ["after", "before"])
def test_an_answered_prompt_id_of_another_job_is_not_trusted(
    fresh: Callable[..., Rig], record: Callable[..., None], when: str
) -> None:
    """ComfyUI (a proxy in between, a restarted server, a bug) answers job B's submission
    with job A's prompt id: B's prompt queued under its own id (``after``: the answer is
    replaced) or not at all (``before``). B must end done with its own file, run once;
    before, B was done with A's file (and, with ``before``, never ran)."""
    rig = fresh(settings={"comfyui_job_seconds": 1.0})
    rig.wait_llm(30.0)
    start = time.time()
    first, _ = rig.submit(2)
    # A runs (its history stays while ComfyUI does): B's submission comes next
    rig.wait(rig.executing, 15.0, "ComfyUI runs job A")
    first_pid = next(
        r["prompt_id"]
        for r in rig.executions_log()
        if r.get("event") == "start" and f"cardshare/{first}/s0" in r.get("prefixes", [])
    )
    body = json.dumps({"prompt_id": first_pid, "number": 7, "node_errors": {}})
    rule = rig.fault("comfyui", "POST /prompt", "badjson", 1, when=when, body=body)
    back = rig.wait_llm(30.0)
    verdict = rig.verdict()
    record(
        fault=f"comfyui POST /prompt answered with another job's prompt_id ({when} queueing)",
        phase="run_jobs",
        jobs=verdict.jobs,
        done=verdict.done,
        failed=verdict.failed,
        duplicates=len(verdict.duplicates),
        lost=len(verdict.lost),
        back_to_llm=round(back - start, 1),
        extra=f"wrong outputs {len(verdict.wrong_outputs)}",
        result="ok" if verdict.done == 2 and not verdict.wrong_outputs else "FAILED",
    )
    assert rig.hits("comfyui", rule) == 1
    assert not verdict.wrong_outputs, f"done with another job's file: {verdict.wrong_outputs}"
    assert (verdict.done, verdict.duplicates, verdict.lost) == (2, {}, [])


def test_a_cancelled_job_queued_behind_another_prompt_never_runs(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    """A prompt not the arbiter's (someone's, through ComfyUI's own API) runs when a job's
    prompt is queued behind it, and the job is cancelled. Interrupting first and clearing the
    queue 200 ms later (a slow /queue) let the job's prompt start in between and run anyway."""
    rig = fresh(settings={"comfyui_job_seconds": 2.0})
    rig.wait_llm(30.0)
    # ComfyUI seen ready only after the foreign prompt is in (its readiness answers late)
    ready = rig.fault("comfyui", "GET /object_info", "delay", None, min=1.0, max=1.0)
    (job,) = rig.submit(1)
    comfy = Http(rig.ports["comfyui"])
    foreign = {
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "x/f"}}
    }
    foreign = {**{k: v for k, v in WORKFLOW.items() if k != "9"}, **foreign}
    rig.wait(lambda: comfy.request("GET", "/queue", timeout=1.0)[0] == 200, 20, "ComfyUI up")
    assert comfy.request("POST", "/prompt", {"prompt": foreign})[0] == 200
    rig.clear("comfyui", ready)

    def queued_behind() -> bool:
        doc = comfy.request("GET", "/queue")[1]
        return len(doc["queue_running"]) == 1 and len(doc["queue_pending"]) == 1

    rig.wait(queued_behind, 20, "the job's prompt queued behind the foreign one")
    slow = rig.fault("comfyui", "POST /queue", "delay", None, min=0.2, max=0.2)
    status, doc = rig.api.request("DELETE", f"/v1/jobs/{job}", auth=True)
    assert status == 202, (status, doc)
    rig.cancelled.add(job)
    start = time.time()
    back = rig.wait_llm(30.0)
    rig.clear("comfyui", slow)
    started = [
        r
        for r in rig.executions_log()
        if r.get("event") == "start" and f"cardshare/{job}/s0" in r.get("prefixes", [])
    ]
    state = (rig.job(job) or {}).get("state")
    record(
        fault="cancel a job queued behind a foreign prompt (POST /queue 200 ms slow)",
        phase="run_jobs",
        jobs=1,
        back_to_llm=round(back - start, 1),
        extra=f"the cancelled job's prompt started {len(started)} time(s); state {state}",
        result="ok" if not started and state == "cancelled" else "FAILED",
    )
    assert state == "cancelled"
    assert not started, f"the cancelled job's prompt ran: {started}"


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_50_mb_history_answer_costs_the_arbiter_little_memory(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    """GET /history/<id> answers 50 MB of JSON once (a misbehaving server or proxy): read
    whole and parsed, it cost the arbiter some 300 MB; read at most HISTORY_MAX_BYTES
    (8 MiB) it is a garbled answer, polled again; the job ends done, once. (The default
    http_timeout_seconds: the rig's 0.5 s would cut the answer short before the limit does.)"""
    rig = fresh(config={"http_timeout_seconds": 10.0})
    rig.wait_llm(30.0)
    assert rig.arbiter is not None
    before = _peak_rss(rig.arbiter.pid)
    item = '{"filename": "x.png", "subfolder": "", "type": "output"}, '
    rule = rig.fault(  # 50 MB of JSON, a million small objects
        "comfyui", "GET /history", "badjson", 1,
        body='{"other": [', repeat=item, times=50 * 2**20 // len(item), suffix="0]}",
    )  # fmt: skip
    rig.submit(1)
    rig.wait(lambda: rig.hits("comfyui", rule) == 1, 60.0, "the 50 MB answer sent")
    back = rig.wait_llm(60.0)
    after = _peak_rss(rig.arbiter.pid)
    verdict = rig.verdict()
    grown = (after - before) / 2**20
    record(
        fault="comfyui GET /history: a 50 MB JSON answer x1",
        phase="run_jobs",
        jobs=verdict.jobs,
        done=verdict.done,
        duplicates=len(verdict.duplicates),
        lost=len(verdict.lost),
        back_to_llm=round(back - time.time(), 1),
        extra=f"the arbiter's peak RSS grew {grown:.0f} MiB ({before >> 20} -> {after >> 20})",
        result="ok" if grown < 16 else "FAILED",
    )
    assert (verdict.done, verdict.duplicates, verdict.lost) == (1, {}, [])
    assert grown < 16, f"the arbiter's peak memory grew {grown:.0f} MiB"
