"""Faults on the card data (the recorder's current.json, written by the fake Docker from the
containers that run): garbage, missing, without a scan time, stale (the recorder stopped),
another client on the card; while serving (the swap decision) and in the release waits."""

from __future__ import annotations

import pytest
from batch import Batch, Case
from scenario import Fault, Scenario, cases

pytestmark = pytest.mark.faults


def card(kind: str, n: int | None = None) -> Fault:
    return Fault("card", "current.json", kind, n)


def P(sc: Scenario, name: str) -> object:
    return pytest.param(sc, id=name)


SLOW_LLM_STOP = {"vllm_term_seconds": 0.5}  # stop_llm lasts long enough to arm in it
SLOW_IMAGE_STOP = {"comfyui_term_seconds": 0.5}

SCENARIOS = [
    # serve_llm with jobs queued: unreadable card data blocks the swap, with an alert
    *[
        P(Scenario((card(k),), "serve_llm", clear_after=1.0, alerts=("card_data",)), f"serve-{k}")
        for k in ("garbage", "missing", "badshape")
    ],
    # the recorder stopped: data older than card_data_max_age_seconds (1 s) blocks the swap
    P(
        Scenario(
            (card("stale"),),
            "serve_llm",
            submit_after=1.2,
            clear_after=3.0,
            alerts=("card_data",),
        ),
        "serve-stale",
    ),
    # another client (Plex) on the card: a veto, not a fault; the swap waits for it to end
    P(Scenario((card("foreign"),), "serve_llm", clear_after=1.0), "serve-foreign"),
    # vLLM's release cannot be seen for a moment: the wait goes on
    *[
        P(
            Scenario((card(k, 4),), "wait_llm_release", arm_at="stop_llm", settings=SLOW_LLM_STOP),
            f"llm-release-{k}-short",
        )
        for k in ("garbage", "missing", "stale")
    ],
    # ... for longer than llm_release_timeout_seconds: alert, back to vLLM, swap again later
    *[
        P(
            Scenario(
                (card(k),),
                "wait_llm_release",
                arm_at="stop_llm",
                settings=SLOW_LLM_STOP,
                clear_after=3.0,
                alerts=("llm_release_timeout",),
            ),
            f"llm-release-{k}-long",
        )
        for k in ("garbage", "missing", "stale")
    ],
    # ComfyUI's release cannot be seen for longer than image_release_timeout_seconds: vLLM
    # is started anyway (it refuses by itself when memory is short)
    *[
        P(
            Scenario(
                (card(k),),
                "wait_image_release",
                arm_at="stop_image",
                settings=SLOW_IMAGE_STOP,
                clear_after=3.0,
                alerts=("image_release_timeout",),
            ),
            f"image-release-{k}-long",
        )
        for k in ("garbage", "stale")
    ],
]


@pytest.mark.parametrize("case", cases(SCENARIOS))
def test_card_fault(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)
