"""Faults on the Docker Engine edge, call by call (list, inspect, start, stop, restart, logs),
in the phases that make each call: the arbiter's start (resume), the swap to image, a
ComfyUI restart, the handback; Docker down altogether; and a Docker call that hangs."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from batch import Batch, Case, Record, Worker
from rig import Rig
from scenario import Fault, Scenario, cases, run_scenario

pytestmark = pytest.mark.faults


def F(route: str, kind: str, n: int | None = 1, **kw: object) -> Fault:
    if kind.isdigit():
        return Fault("docker", route, "status", n, status=int(kind), **kw)  # type: ignore[arg-type]
    return Fault("docker", route, kind, n, **kw)  # type: ignore[arg-type]


def P(sc: Scenario, name: str) -> object:
    return pytest.param(sc, id=name)


CRASH = Fault("comfyui", "execute", "crash_before_save")  # a ComfyUI restart follows
KINDS = ("exception", "close", "garbage", "500")
NOT_READY, DOCKER, CRASHED, LLM = (
    ("image_not_ready",),
    ("docker",),
    ("image_crashed",),
    ("llm_not_ready",),
)

SCENARIOS = [
    # every action looks its container up first (GET /containers/json)
    *[P(Scenario((F("list:vllm", k),), "stop_llm"), f"list-vllm-{k}") for k in (*KINDS, "badjson")],
    # stopping vLLM fails: vLLM is started again (304) and served; the swap is tried again
    *[P(Scenario((F("stop:vllm", k),), "stop_llm"), f"stop-vllm-{k}") for k in (*KINDS, "404")],
    P(Scenario((F("stop:vllm", "exception", when="after"),), "stop_llm"), "stop-vllm-after"),
    # starting ComfyUI fails: image_not_ready, the card goes back to vLLM, retried later
    *[
        P(Scenario((F("start:comfyui", k),), "start_image", alerts=NOT_READY), f"start-comfyui-{k}")
        for k in (*KINDS, "404")
    ],
    P(
        Scenario(
            (F("start:comfyui", "exception", when="after"),),
            "start_image",
            alerts=NOT_READY,
        ),
        "start-comfyui-after",
    ),
    # the restart of a crashed ComfyUI fails: docker alert, handback, the job resumes later
    *[
        P(
            Scenario((CRASH, F("restart:comfyui", k)), "restart_image", alerts=("docker",)),
            f"restart-comfyui-{k}",
        )
        for k in KINDS
    ],
    P(
        Scenario(
            (CRASH, F("restart:comfyui", "exception", when="after")),
            "restart_image",
            alerts=("docker",),
        ),
        "restart-comfyui-after",
    ),
    # inspecting the crashed ComfyUI fails (its state is unknown): still restarted
    *[
        P(Scenario((CRASH, F("inspect:comfyui", k, 2)), "run_jobs", alerts=DOCKER), f"inspect-{k}")
        for k in (*KINDS, "badjson")
    ],
    # its logs cannot be read: the crash is still classified and ComfyUI restarted
    *[
        P(Scenario((CRASH, F("logs:comfyui", k)), "run_jobs", alerts=CRASHED), f"logs-comfyui-{k}")
        for k in KINDS
    ],
    # stopping ComfyUI at the handback fails: image_stop_failed, vLLM waits, stop retried
    *[
        P(
            Scenario((F("stop:comfyui", k, 2),), "stop_image", alerts=("image_stop_failed",)),
            f"stop-comfyui-{k}",
        )
        for k in KINDS
    ],
    # starting vLLM fails: llm_not_ready, retried with backoff, never llm before it answers
    *[
        P(Scenario((F("start:vllm", k, 2),), "start_llm", alerts=LLM), f"start-vllm-{k}")
        for k in KINDS
    ],
    P(
        Scenario((F("start:vllm", "exception", 1, when="after"),), "start_llm"),
        "start-vllm-after",
    ),
    # ComfyUI or vLLM not ready yet, and Docker cannot say why (the container's state unknown)
    P(
        Scenario(
            (
                Fault("comfyui", "GET /object_info", "status", 2, status=500),
                F("inspect:comfyui", "500"),
            ),
            "wait_image_ready",
            alerts=DOCKER,
        ),
        "inspect-comfyui-not-ready",
    ),
    P(
        Scenario(
            (Fault("vllm", "GET /health", "status", 2, status=503), F("inspect:vllm", "exception")),
            "wait_llm_ready",
            alerts=DOCKER,
        ),
        "inspect-vllm-not-ready",
    ),
    # Docker down for 5 s from the first call of the swap on (long enough that the start of
    # vLLM after the failed stop meets it down too, however loaded the machine)
    P(
        Scenario((F("*", "exception", None),), "stop_llm", clear_after=5.0, alerts=LLM),
        "docker-down-in-swap",
    ),
    P(
        Scenario(
            (F("*", "500", None),),
            "run_jobs",
            arm_at="executing",
            crash="comfyui",
            settings={"comfyui_job_seconds": 0.3},
            clear_after=2.0,
            alerts=("docker", "image_crashed"),
        ),
        "docker-down-in-run-jobs",
    ),
    # vLLM cannot be stopped for 3 s: the arbiter goes round stop, start, serve
    P(
        Scenario((F("stop:vllm", "500", None),), "stop_llm", clear_after=3.0, alerts=("docker",)),
        "stop-vllm-500-until-cleared",
    ),
]


def at_start(fault: Fault) -> Case:
    """resume() cannot see the containers: the docker alert, and resume is tried again until
    Docker answers (resume() returns False: "the caller retries")."""

    def run(worker: Worker, record: Record, name: str) -> None:
        rig = worker.fresh(arbiter=False)
        rule = fault.arm(rig)
        since = time.time()
        rig.start_arbiter()
        time.sleep(3.0)  # no job queued: only resume() calls Docker now
        retried = rig.hits("docker", rule)

        def resume_retried() -> str | None:
            if retried >= 3:
                return None
            return (
                f"resume() was not tried again after Docker failed ({retried} call(s) in 3 s):"
                " Engine.run() leaves its resume loop since guarded() returns True and clears"
                " the docker alert whatever resume() returned"
            )

        sc = Scenario((), "resume", alerts=("docker",), jobs=1)
        run_scenario(rig, sc, record, name, since=since, checks=(resume_retried,))

    return Case(run, 6.0)


def resume_with_vllm_down(worker: Worker, record: Record, name: str) -> None:
    """The arbiter starts in serve_llm while vLLM's container is down (a reboot) and Docker's
    first answer fails: resume must still converge (start vLLM) once Docker answers."""
    rig = worker.fresh(arbiter=False)
    assert rig.docker.crash("vllm")
    rig.wait(lambda: not rig.docker.containers()["vllm"]["running"], 5, "vLLM down")
    F("list:vllm", "exception").arm(rig)
    since = time.time()
    rig.start_arbiter()
    sc = Scenario((), "resume (vLLM down)", alerts=("docker",), jobs=1, timeout=15)
    run_scenario(rig, sc, record, name, since=since)


def docker_hangs_at_start(worker: Worker, record: Record, name: str) -> None:
    """A Docker call that never answers: the arbiter's Docker client gives up after its fixed
    30 s timeout (DockerClient's default, not configurable), the API answers meanwhile."""
    rig = worker.fresh(arbiter=False)
    rule = F("list:vllm", "hang", seconds=40.0).arm(rig)
    since = time.time()
    rig.start_arbiter()
    rig.wait(lambda: rig.hits("docker", rule) >= 1, 10, "the fault fired")
    hit = time.time()
    time.sleep(2.0)
    assert rig.status()["phase"] == "serve_llm"  # the API answers during the hang
    sc = Scenario((), "resume (hang)", alerts=("docker",), timeout=45.0)
    run_scenario(rig, sc, record, name, since=since)
    assert time.time() - hit >= 29.0


CASES = [
    *cases(SCENARIOS),
    pytest.param(at_start(F("list:vllm", "exception", 3)), id="start-list-vllm-exception-x3"),
    pytest.param(at_start(F("list:comfyui", "garbage", 3)), id="start-list-comfyui-garbage-x3"),
    pytest.param(at_start(F("inspect:vllm", "500", 3)), id="start-inspect-vllm-500-x3"),
    pytest.param(Case(resume_with_vllm_down, 16.0), id="start-resume-with-vllm-down"),
    pytest.param(Case(docker_hangs_at_start, 40.0), id="start-docker-hangs"),
]


@pytest.mark.parametrize("case", CASES)
def test_docker_fault(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)


def test_a_vllm_stop_that_keeps_failing_backs_off_and_its_alert_holds(
    fresh: Callable[..., Rig], record: Callable[..., None]
) -> None:
    """Docker refuses every stop of vLLM for 10 s with a job queued: each failed stop sent
    the card back to serving and the next poll swapped again (50 stops in 30 s), and the
    alert came and went with each try. Now the swaps back off as a failed start of ComfyUI's
    do (llm_retry_backoff_seconds, doubling to its max: 1 s here) and llm_stop_failed stays
    raised until a stop works."""
    rig = fresh()
    rig.wait_llm(30.0)
    rule = rig.fault("docker", "stop:vllm", "status", None, status=500)
    start = time.time()
    rig.submit(1)
    rig.wait(lambda: rig.hits("docker", rule) >= 1, 15.0, "the first refused stop")
    first = time.time()
    time.sleep(10.0)
    stops = rig.hits("docker", rule)
    samples = [s for s in rig.monitor.samples if s.t >= first + 0.5]
    flaps = sum(1 for s in samples if "llm_stop_failed" not in s.alerts)
    rig.clear("docker", rule)
    back = rig.wait_llm(30.0)
    verdict = rig.verdict()
    record(
        fault="docker stop:vllm: status 500 for 10 s",
        phase="stop_llm",
        jobs=verdict.jobs,
        done=verdict.done,
        back_to_llm=round(back - start, 1),
        extra=f"{stops} stops in 10 s; llm_stop_failed missing in {flaps} of {len(samples)}",
        result="ok" if stops <= 15 and not flaps else "FAILED",
    )
    assert stops <= 15, f"{stops} stops of vLLM in 10 s"
    assert not flaps, f"llm_stop_failed missing in {flaps} of {len(samples)} samples"
    assert verdict.done == 1 and not verdict.lost
