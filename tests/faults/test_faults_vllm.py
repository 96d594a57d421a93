"""Faults on the vLLM edge: /metrics while serving (the swap decision), /health and the
one-token completion while the arbiter waits for vLLM after a handback, and vLLM dying."""

from __future__ import annotations

import pytest
from batch import Batch, Case
from scenario import Fault, Scenario, as_case, cases

pytestmark = pytest.mark.faults


def F(route: str, kind: str, n: int | None = 2, **kw: object) -> Fault:
    if kind.isdigit():
        return Fault("vllm", route, "status", n, status=int(kind), **kw)  # type: ignore[arg-type]
    return Fault("vllm", route, kind, n, **kw)  # type: ignore[arg-type]


SCENARIOS = [
    # serve_llm: unreadable metrics hold the swap back (vLLM might be busy), then it goes on
    *[
        pytest.param(Scenario((F("GET /metrics", k, 3),), "serve_llm"), id=f"metrics-{k}")
        for k in ("exception", "garbage", "badjson", "hang", "500")
    ],
    # wait_llm_ready: retried within llm_ready_timeout_seconds
    *[
        pytest.param(Scenario((F("GET /health", k, 2),), "wait_llm_ready"), id=f"health-{k}")
        for k in ("exception", "close", "garbage", "hang", "503")
    ],
    *[
        pytest.param(
            Scenario((F("POST /v1/completions", k, 2),), "wait_llm_ready"), id=f"completion-{k}"
        )
        for k in ("exception", "garbage", "badjson", "hang", "500", "400")
    ],
    # longer than llm_ready_timeout_seconds (3 s): alert, vLLM restarted, never llm before
    pytest.param(
        Scenario(
            (F("GET /health", "503", None),),
            "wait_llm_ready",
            clear_after=4.0,
            alerts=("llm_not_ready",),
        ),
        id="health-503-until-cleared",
    ),
    pytest.param(
        Scenario(
            (F("POST /v1/completions", "hang", None),),
            "wait_llm_ready",
            clear_after=4.0,
            alerts=("llm_not_ready",),
        ),
        id="completion-hang-until-cleared",
    ),
]


# vLLM's container exits in serve_llm (mode llm). Expected: the arbiter notices (an
# llm_not_ready alert) and starts vLLM again, and the queued job still runs.
VLLM_DIES = Scenario((), "serve_llm", crash="vllm", jobs=1, alerts=("llm_not_ready",), timeout=15)
CASES = [
    *cases(SCENARIOS),
    pytest.param(as_case(VLLM_DIES, cost=15.0), id="vllm-dies-while-serving"),
]


@pytest.mark.parametrize("case", CASES)
def test_vllm_fault(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)
