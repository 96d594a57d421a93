"""The arbiter's Prometheus metrics, as ``prometheus_client`` metric families (pure).

:func:`families` turns the arbiter's state into metric families; the API serves them from a
registry of the arbiter's own whose collector reads the engine at each scrape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from cardshare.arbiter.states import Mode
from cardshare.arbiter.store import JobState, SwapRecord

ALERT_HELP = "1 while the named alert is raised."
P = "cardshare_arbiter"
#: States a job never leaves: their counts only grow (the store keeps every job).
FINISHED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
#: States of a job not finished yet: their counts go up and down.
UNFINISHED = (JobState.QUEUED, JobState.RUNNING)
DIRECTIONS = ("to_image", "to_llm")


def families(
    mode: Mode,
    queue_jobs: int,
    job_counts: Mapping[str, int],
    last_swap: SwapRecord | None,
    swap_counts: Mapping[str, int],
    alerts: Mapping[str, str],
    alert_names: tuple[str, ...],
    faults: Mapping[str, int] | None = None,
    heartbeat_age: float = 0.0,
    alive: bool = True,
    plan: Mapping[str, object] | None = None,
    tenants: Sequence[tuple[str, str, int]] = (),
) -> list[Metric]:
    """The metric families of ``/metrics`` for the given state."""
    mode_family = GaugeMetricFamily(
        f"{P}_mode", "1 for the arbiter's current mode.", labels=["mode"]
    )
    for m in Mode:
        mode_family.add_metric([m.value], int(m is mode))
    finished = CounterMetricFamily(
        f"{P}_jobs_total", "Jobs finished, by the state they ended in.", labels=["state"]
    )
    for s in FINISHED:
        finished.add_metric([s.value], job_counts.get(s.value, 0))
    unfinished = GaugeMetricFamily(
        f"{P}_jobs_unfinished", "Jobs not finished yet, by state.", labels=["state"]
    )
    for s in UNFINISHED:
        unfinished.add_metric([s.value], job_counts.get(s.value, 0))
    phases = GaugeMetricFamily(
        f"{P}_swap_phase_seconds",
        "Duration of each phase of the last swap.",
        labels=["direction", "phase"],
    )
    own = GaugeMetricFamily(
        f"{P}_swap_own_seconds",
        "The arbiter's own share of the last finished swap.",
        labels=["direction"],
    )
    if last_swap is not None:
        for timing in last_swap.phases:
            phases.add_metric([last_swap.direction, timing.phase], timing.seconds)
        if last_swap.own_seconds is not None:
            own.add_metric([last_swap.direction], last_swap.own_seconds)
    swaps = CounterMetricFamily(
        f"{P}_swaps_total", "Completed swaps by direction.", labels=["direction"]
    )
    for d in DIRECTIONS:
        swaps.add_metric([d], swap_counts.get(d, 0))
    alert = GaugeMetricFamily(f"{P}_alert", ALERT_HELP, labels=["name"])
    for name in sorted(set(alert_names) | set(alerts)):
        alert.add_metric([name], int(name in alerts))
    counted = faults or {}
    fault_family = CounterMetricFamily(
        f"{P}_faults_total",
        "Alerts raised (and errors of the engine's steps) since the start.",
        labels=["kind"],
    )
    for name in sorted(set(alert_names) | set(counted)):
        fault_family.add_metric([name], counted.get(name, 0))
    plan_families: list[Metric] = []
    if plan is not None:
        index = plan.get("index")
        plan_families.append(
            GaugeMetricFamily(
                f"{P}_llm_plan",
                "vLLM's plan now: 0 is the full plan, higher is smaller (degraded).",
                value=index if isinstance(index, int) else 0,
            )
        )
        length = plan.get("max_model_len")
        if isinstance(length, int):
            plan_families.append(
                GaugeMetricFamily(
                    f"{P}_llm_max_model_len",
                    "The context (tokens) of vLLM's plan now.",
                    value=length,
                )
            )
    tenant_family = GaugeMetricFamily(
        f"{P}_tenant_vram_bytes",
        "VRAM each client of the card holds, with its kind (owner, resident, yielding, "
        "foreign), from the arbiter's last card data.",
        labels=["tenant", "kind"],
    )
    summed: dict[tuple[str, str], int] = {}
    for name, kind, size in tenants:  # a client on two cards is one series
        summed[(name, kind)] = summed.get((name, kind), 0) + size
    for (name, kind), size in sorted(summed.items()):
        tenant_family.add_metric([name, kind], size)
    return [
        *plan_families,
        tenant_family,
        mode_family,
        GaugeMetricFamily(f"{P}_queue_jobs", "Jobs queued or running.", value=queue_jobs),
        finished,
        unfinished,
        phases,
        own,
        swaps,
        alert,
        fault_family,
        GaugeMetricFamily(f"{P}_engine_up", "1 while the engine's loop runs.", value=int(alive)),
        GaugeMetricFamily(
            f"{P}_heartbeat_age_seconds",
            "Seconds since the engine last made progress.",
            value=heartbeat_age,
        ),
    ]
