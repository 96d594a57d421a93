"""Prometheus text exposition of the arbiter's state (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from cardshare.arbiter.states import Mode
from cardshare.arbiter.store import JobState, SwapRecord

ALERT_HELP = "1 while the named alert is raised."


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(
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
) -> str:
    p = "cardshare_arbiter"
    lines = [
        f"# HELP {p}_mode 1 for the arbiter's current mode.",
        f"# TYPE {p}_mode gauge",
    ]
    lines += [f'{p}_mode{{mode="{m.value}"}} {int(m is mode)}' for m in Mode]
    lines += [
        f"# HELP {p}_queue_jobs Jobs queued or running.",
        f"# TYPE {p}_queue_jobs gauge",
        f"{p}_queue_jobs {queue_jobs}",
        f"# HELP {p}_jobs_total Jobs by state.",
        f"# TYPE {p}_jobs_total gauge",
    ]
    lines += [f'{p}_jobs_total{{state="{s.value}"}} {job_counts.get(s.value, 0)}' for s in JobState]
    lines += [
        f"# HELP {p}_swap_phase_seconds Duration of each phase of the last swap.",
        f"# TYPE {p}_swap_phase_seconds gauge",
    ]
    if last_swap is not None:
        for timing in last_swap.phases:
            lines.append(
                f'{p}_swap_phase_seconds{{direction="{last_swap.direction}",'
                f'phase="{timing.phase}"}} {timing.seconds:.3f}'
            )
        own = last_swap.own_seconds
        if own is not None:
            lines += [
                f"# HELP {p}_swap_own_seconds The arbiter's own share of the last finished swap.",
                f"# TYPE {p}_swap_own_seconds gauge",
                f'{p}_swap_own_seconds{{direction="{last_swap.direction}"}} {own:.3f}',
            ]
    lines += [
        f"# HELP {p}_swaps_total Completed swaps by direction.",
        f"# TYPE {p}_swaps_total counter",
    ]
    lines += [
        f'{p}_swaps_total{{direction="{d}"}} {swap_counts.get(d, 0)}'
        for d in ("to_image", "to_llm")
    ]
    lines += [f"# HELP {p}_alert {ALERT_HELP}", f"# TYPE {p}_alert gauge"]
    for name in sorted(set(alert_names) | set(alerts)):
        lines.append(f'{p}_alert{{name="{_esc(name)}"}} {int(name in alerts)}')
    counted = faults or {}
    lines += [
        f"# HELP {p}_faults_total Alerts raised (and errors of the engine's steps) since the"
        " start.",
        f"# TYPE {p}_faults_total counter",
    ]
    for name in sorted(set(alert_names) | set(counted)):
        lines.append(f'{p}_faults_total{{kind="{_esc(name)}"}} {counted.get(name, 0)}')
    lines += [
        f"# HELP {p}_engine_up 1 while the engine's loop runs.",
        f"# TYPE {p}_engine_up gauge",
        f"{p}_engine_up {int(alive)}",
        f"# HELP {p}_heartbeat_age_seconds Seconds since the engine last made progress.",
        f"# TYPE {p}_heartbeat_age_seconds gauge",
        f"{p}_heartbeat_age_seconds {heartbeat_age:.3f}",
    ]
    return "\n".join(lines) + "\n"
