"""One fault scenario on a rig: arm the faults (before the jobs, or when the arbiter reaches a
phase), submit jobs, wait until the arbiter is back to a consistent ``llm``, then check that
no acknowledged job was lost, none ran twice, and the due alerts were raised."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from batch import Case, Record, Worker
from rig import WORKFLOW, WORKFLOW_INPUT, WORKFLOW_TWO_SAVES, WORKFLOW_WEBP, Rig, Verdict


@dataclass(frozen=True)
class Fault:
    service: str  # docker | vllm | comfyui | card
    route: str  # "GET /queue", "stop:vllm", "execute", "current.json" ...
    kind: str
    remaining: int | None = 1  # None: until cleared
    when: str = "before"  # "after": the call is performed, its answer lost
    status: int | None = None
    body: str | None = None
    seconds: float | None = None  # a hang's length
    message: str | None = None  # exec_error's exception message

    def arm(self, rig: Rig) -> str:
        extra: dict[str, Any] = {"when": self.when}
        for key in ("status", "body", "seconds", "message"):
            value = getattr(self, key)
            if value is not None:
                extra[key] = value
        return rig.fault(self.service, self.route, self.kind, self.remaining, **extra)

    def label(self) -> str:
        kind = f"{self.kind} {self.status}" if self.status else self.kind
        times = "until cleared" if self.remaining is None else f"x{self.remaining}"
        after = " (after the action)" if self.when == "after" else ""
        return f"{self.service} {self.route}: {kind}{after} {times}"


@dataclass(frozen=True)
class Scenario:
    faults: tuple[Fault, ...]
    phase: str  # where the fault hits (for the summary)
    # arm when /v1/status shows this phase, or at "executing" (ComfyUI started running one of
    # the jobs); None: before the jobs are submitted
    arm_at: str | None = None
    jobs: int = 2
    # plain | input | two_saves | webp | mixed (plain and input in turn: from the third job on, each
    # follows the other workflow's models and its own peak is known, so /free comes first)
    workflow: str = "plain"
    alerts: tuple[str, ...] = ()  # each must be raised
    may_fail: str | None = None  # a job may fail, with a reason matching this regex
    clear_after: float | None = None  # clear the faults this long after their first hit
    settings: dict[str, Any] = field(default_factory=dict)
    crash: str | None = None  # at arm time: "comfyui", "comfyui+respawn", "vllm"
    cancel_first: bool = False  # DELETE the first job once it runs (202)
    kill_in: str | None = None  # SIGKILL the arbiter when /v1/status shows this phase
    timeout: float = 30.0
    min_hits: int = 1
    submit_after: float = 0.0  # seconds between arming (before the jobs) and submitting

    def label(self) -> str:
        parts = [f.label() for f in self.faults]
        if self.crash:
            parts.append(f"crash {self.crash}")
        if self.cancel_first:
            parts.append("cancel the running job")
        if self.kill_in:
            parts.append(f"SIGKILL the arbiter in {self.kill_in}")
        return "; ".join(parts)


WORKFLOWS = {
    "plain": WORKFLOW,
    "input": WORKFLOW_INPUT,
    "two_saves": WORKFLOW_TWO_SAVES,
    "webp": WORKFLOW_WEBP,
}


def run_scenario(
    rig: Rig,
    sc: Scenario,
    record: Record,
    test_id: str,
    since: float | None = None,
    checks: tuple[Callable[[], str | None], ...] = (),
) -> Verdict:
    """Run ``sc``; alerts count from ``since`` (default: now; a caller that gives ``since``
    began the scenario itself: the jobs it submitted count too); each of ``checks`` returns
    a failure message or None, at the end."""
    start = time.time() if since is None else since
    if since is None:
        rig.jobs.clear()
        rig.cancelled.clear()
    defaults = rig.current_settings()
    if sc.settings:
        rig.settings(**sc.settings)
    rules: list[tuple[str, str]] = []
    row: dict[str, Any] = {
        "test": test_id,
        "fault": sc.label(),
        "phase": sc.phase,
        "result": "FAILED",
    }
    try:

        def arm() -> None:
            for f in sc.faults:
                rules.append((f.service, f.arm(rig)))
            if sc.crash:
                service, _, respawn = sc.crash.partition("+")
                assert rig.docker.crash(service, respawn=bool(respawn)), f"{service} not running"

        def submit() -> None:
            if sc.workflow == "mixed":
                for n in range(sc.jobs):
                    rig.submit(1, workflow=(WORKFLOW, WORKFLOW_INPUT)[n % 2])
            else:
                rig.submit(sc.jobs, workflow=WORKFLOWS[sc.workflow])

        if since is None:
            # a case starts on an arbiter that serves: the first case of a worker meets one
            # that has just started, and a fault armed now would land in its resume instead
            # of the phase the case is about
            rig.wait_llm(sc.timeout)
        if sc.arm_at is None:
            arm()
            for service, rule_id in rules:
                if service == "card":  # written on the recorder's clock: wait for it
                    rig.wait(lambda s=service, r=rule_id: rig.hits(s, r) > 0, 5, "card written")
            time.sleep(sc.submit_after)
            submit()
        elif sc.arm_at == "executing":
            submit()
            rig.wait(rig.executing, sc.timeout, "ComfyUI runs one of the jobs")
            arm()
        else:
            submit()
            rig.wait_phase([sc.arm_at], timeout=sc.timeout)
            arm()
        armed = time.time()
        killed_at: float | None = None
        if sc.kill_in is not None:
            rig.kill_in_phase(sc.kill_in, timeout=sc.timeout)
            killed_at = time.time()
            rig.start_arbiter()
        if sc.cancel_first:
            first = next(iter(rig.jobs))
            # "running" in the database: the engine may hold a job it has not started yet
            # (current_job set, state still queued: a DELETE then cancels it at once, 200)
            rig.wait(
                lambda: (rig.job(first) or {}).get("state") == "running",
                sc.timeout,
                "first job runs",
            )
            # and ComfyUI executes its prompt: a cancel of a prompt still pending deletes it from
            # the queue and sends no interrupt, which a loaded machine made the common case
            prefix = f"cardshare/{first}/s0"
            rig.wait(
                lambda: any(
                    r.get("event") == "start" and prefix in r.get("prefixes", [])
                    for r in rig.executions_log()
                ),
                sc.timeout,
                "ComfyUI executes the first job",
            )
            status, doc = rig.api.request("DELETE", f"/v1/jobs/{first}", auth=True)
            assert status == 202, (status, doc)
            rig.cancelled.add(first)
        if rules:
            rig.wait(
                lambda: sum(rig.hits(s, r) for s, r in rules) >= sc.min_hits,
                sc.timeout,
                f"the fault fired: {sc.label()}",
            )
            first_hit = min(t for t in (rig.first_hit(s, r) for s, r in rules) if t is not None)
        else:
            first_hit = armed
        if killed_at is not None:
            first_hit = killed_at
        if sc.clear_after is not None:
            time.sleep(max(0.0, first_hit + sc.clear_after - time.time()))
            for service, rule_id in rules:
                rig.clear(service, rule_id)
        back = rig.wait_llm(sc.timeout)
        for service, rule_id in rules:
            rig.clear(service, rule_id)
        verdict = rig.verdict(sc.may_fail)
        alerts = rig.alerts_raised(since=start)
        row.update(
            jobs=verdict.jobs,
            done=verdict.done,
            failed=verdict.failed,
            duplicates=len(verdict.duplicates),
            lost=len(verdict.lost),
            back_to_llm=round(back - first_hit, 2),
            hits=sum(rig.hits(s, r) for s, r in rules),
            alerts=",".join(sorted(alerts)),
            phases=len(rig.monitor.phases(since=start)),
        )
        assert not verdict.lost, f"jobs lost: {verdict.lost}"
        assert not verdict.duplicates, f"jobs executed twice: {verdict.duplicates}"
        assert not verdict.wrong_outputs, f"done without their own output: {verdict.wrong_outputs}"
        assert not verdict.unexpected_failures, (
            f"jobs failed unexpectedly: {verdict.unexpected_failures}"
        )
        missing = [a for a in sc.alerts if a not in alerts]
        assert not missing, f"alerts due but not raised: {missing} (raised: {sorted(alerts)})"
        for check in checks:
            problem = check()
            assert problem is None, problem
        if "engine_error" not in sc.alerts:
            assert "engine_error" not in alerts, (
                f"an unexpected error of the arbiter (engine_error):\n{rig.arbiter_log(80)}"
            )
        row["result"] = "ok"
        return verdict
    except BaseException as exc:
        row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        raise
    finally:
        for service, rule_id in rules:
            rig.clear(service, rule_id)
        rig.restore_settings(defaults)
        row.setdefault("seconds", round(time.time() - start, 1))
        record(**row)


def as_case(sc: Scenario, cost: float | None = None) -> Case:
    """A batch case running ``sc`` on the worker's shared rig."""

    def run(worker: Worker, record: Record, name: str) -> None:
        run_scenario(worker.shared(), sc, record, name)

    if cost is None:
        cost = 2.0 + (sc.clear_after or 0.0) + sc.submit_after + (1.0 if sc.kill_in else 0.0)
    return Case(run, cost)


def cases(params: list[Any]) -> list[Any]:
    """``pytest.param(Scenario, id=...)`` entries as batch cases."""
    return [pytest.param(as_case(p.values[0]), id=p.id) for p in params]
