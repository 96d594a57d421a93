"""The arbiter's /metrics families, read back with prometheus_client's parser."""

from __future__ import annotations

import pytest
from promtext import Exposition

from cardshare import exposition
from cardshare.arbiter.common import ALERT_NAMES
from cardshare.arbiter.metrics import families
from cardshare.arbiter.states import Mode
from cardshare.arbiter.store import PhaseTiming, SwapRecord

P = "cardshare_arbiter"
TYPES = {
    f"{P}_mode": "gauge",
    f"{P}_queue_jobs": "gauge",
    f"{P}_jobs": "counter",
    f"{P}_jobs_unfinished": "gauge",
    f"{P}_swap_phase_seconds": "gauge",
    f"{P}_swap_own_seconds": "gauge",
    f"{P}_swaps": "counter",
    f"{P}_alert": "gauge",
    f"{P}_faults": "counter",
    f"{P}_engine_up": "gauge",
    f"{P}_heartbeat_age_seconds": "gauge",
    f"{P}_tenant_vram_bytes": "gauge",
}
SWAP = SwapRecord(
    id=7,
    direction="to_image",
    started=100.0,
    finished=130.0,
    ok=True,
    phases=(
        PhaseTiming("stop_llm", 2.5, 0.0, "ok"),
        PhaseTiming("wait_llm_release", 7.25, 7.0, "ok"),
        PhaseTiming("start_image", 1.0, 0.0, "ok"),
    ),
)
COUNTS = {"queued": 2, "running": 1, "done": 5, "failed": 1, "cancelled": 0}


def read(**kw: object) -> Exposition:
    args: dict[str, object] = {
        "mode": Mode.IMAGE,
        "queue_jobs": 3,
        "job_counts": COUNTS,
        "last_swap": SWAP,
        "swap_counts": {"to_image": 4, "to_llm": 3},
        "alerts": {},
        "alert_names": ALERT_NAMES,
    }
    args.update(kw)
    return Exposition(exposition.text(families(**args)))  # type: ignore[arg-type]


def test_every_family_and_its_type() -> None:
    assert read().types == TYPES


@pytest.mark.parametrize(
    ("sample", "labels", "value"),
    [
        (f"{P}_mode", {"mode": "image"}, 1),
        (f"{P}_mode", {"mode": "llm"}, 0),
        (f"{P}_mode", {"mode": "swapping"}, 0),
        (f"{P}_queue_jobs", {}, 3),
        (f"{P}_jobs_total", {"state": "done"}, 5),
        (f"{P}_jobs_total", {"state": "failed"}, 1),
        (f"{P}_jobs_total", {"state": "cancelled"}, 0),
        (f"{P}_jobs_unfinished", {"state": "queued"}, 2),
        (f"{P}_jobs_unfinished", {"state": "running"}, 1),
        (f"{P}_swap_phase_seconds", {"direction": "to_image", "phase": "stop_llm"}, 2.5),
        (f"{P}_swap_phase_seconds", {"direction": "to_image", "phase": "wait_llm_release"}, 7.25),
        (f"{P}_swap_own_seconds", {"direction": "to_image"}, 23.0),
        (f"{P}_swaps_total", {"direction": "to_image"}, 4),
        (f"{P}_swaps_total", {"direction": "to_llm"}, 3),
        (f"{P}_engine_up", {}, 1),
        (f"{P}_heartbeat_age_seconds", {}, 0),
    ],
)
def test_values(sample: str, labels: dict[str, str], value: float) -> None:
    assert read()(sample, **labels) == value


def test_finished_jobs_are_a_counter_and_unfinished_ones_a_gauge() -> None:
    """Only states a job never leaves are counted (their counts never go down)."""
    m = read()
    assert {dict(k)["state"] for k in m.series(f"{P}_jobs_total")} == {
        "done",
        "failed",
        "cancelled",
    }
    assert {dict(k)["state"] for k in m.series(f"{P}_jobs_unfinished")} == {"queued", "running"}


def test_no_swap_yet_exposes_the_families_without_samples() -> None:
    m = read(last_swap=None, swap_counts={})
    assert m.series(f"{P}_swap_phase_seconds") == {}
    assert m.series(f"{P}_swap_own_seconds") == {}
    assert m(f"{P}_swaps_total", direction="to_llm") == 0
    assert m.types == TYPES


def test_alerts_and_faults_with_label_values_needing_escapes() -> None:
    """Every known alert has a sample (0 or 1); an unknown name is exposed too, escaped by
    the library so that the parser reads back the very same value."""
    odd = 'x"y\\z\nw'
    m = read(
        alerts={"storage": "disk full", odd: "?"},
        faults={"storage": 2, "engine_error": 1},
        heartbeat_age=12.5,
        alive=False,
    )
    assert m(f"{P}_alert", name="storage") == 1
    assert m(f"{P}_alert", name=odd) == 1
    assert m(f"{P}_alert", name="llm_not_ready") == 0
    assert {dict(k)["name"] for k in m.series(f"{P}_alert")} == {*ALERT_NAMES, odd}
    assert m(f"{P}_faults_total", kind="storage") == 2
    assert m(f"{P}_faults_total", kind="engine_error") == 1
    assert m(f"{P}_faults_total", kind="llm_not_ready") == 0
    assert m(f"{P}_engine_up") == 0
    assert m(f"{P}_heartbeat_age_seconds") == 12.5


def test_vllm_plan_and_the_tenants_by_kind() -> None:
    got = read(
        plan={"index": 2, "max_model_len": 32768, "degraded": True},
        tenants=[
            ("vllm-ladder/plan2", "owner", 20 * 2**30),
            ("retrieval/ovms", "resident", 4 * 2**30),
            ("plex/plex", "foreign", 2 * 2**30),
            ("plex/plex", "foreign", 2 * 2**30),  # on two cards: one series, summed
        ],
    )
    assert got.types[f"{P}_llm_plan"] == "gauge"
    assert got(f"{P}_llm_plan") == 2
    assert got(f"{P}_llm_max_model_len") == 32768
    assert got(f"{P}_tenant_vram_bytes", tenant="retrieval/ovms", kind="resident") == 4 * 2**30
    assert got(f"{P}_tenant_vram_bytes", tenant="plex/plex", kind="foreign") == 4 * 2**30
