"""The arbiter's decisions, as pure functions of observations, config and the time.

Nothing here does I/O: the engine gathers observations (vLLM's /metrics, the proxy's
state, the card view, the queue) and asks these functions what to do. Every decision
carries its reasons, which the status endpoint shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cardshare.arbiter.cardview import CardView
from cardshare.arbiter.config import Config


class MetricsError(ValueError):
    pass


@dataclass(frozen=True)
class VllmMetrics:
    running: float
    waiting: float
    success_total: float


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Sum vLLM's request gauges and its success counter over all label sets.

    ``text`` is read with ``prometheus_client``'s exposition parser: an answer that is not a
    Prometheus text exposition (an error page, a body cut off mid-line) is a
    :class:`MetricsError`, like one that lacks the request gauges. NaN samples are left out.
    ``vllm:request_success_total`` is summed over ``finished_reason`` (and model names); a
    vLLM that has finished no request yet may not print it: that counts as 0.
    """
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except ValueError as exc:  # the parser's one error for text it cannot read
        detail = f" ({exc})" if str(exc) else ""
        raise MetricsError(f"vLLM /metrics is not a Prometheus exposition{detail}") from None
    missing = [
        name
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        if name not in sums
    ]
    if missing:
        raise MetricsError(f"vLLM /metrics lacks {', '.join(missing)}")
    return VllmMetrics(
        running=sums["vllm:num_requests_running"],
        waiting=sums["vllm:num_requests_waiting"],
        success_total=sums.get("vllm:request_success_total", 0.0),
    )


@dataclass(frozen=True)
class LlmActivity:
    """When vLLM was last seen active, and the success counter at the last poll."""

    last_active_at: float
    last_success_total: float | None = None


def update_activity(prev: LlmActivity, metrics: VllmMetrics, now: float) -> LlmActivity:
    """Active = a request running or waiting, or the success counter moved since last poll.

    A counter that went down (vLLM restarted) counts as activity too.
    """
    changed = prev.last_success_total is not None and metrics.success_total != (
        prev.last_success_total
    )
    active = metrics.running > 0 or metrics.waiting > 0 or changed
    return LlmActivity(
        last_active_at=now if active else prev.last_active_at,
        last_success_total=metrics.success_total,
    )


@dataclass(frozen=True)
class ProxyState:
    in_flight: int
    held: int
    oldest_held_seconds: float | None = None
    last_request_started: float | None = None
    last_request_finished: float | None = None


def parse_proxy_state(doc: Any, box: str = "") -> ProxyState:
    """The proxy's ``/proxy/state``; with ``box`` (a fleet's proxy), that box's own in-flight
    requests and request times from its entry of ``boxes``, the held requests fleet-wide (a
    held request waits for any box that serves its model)."""
    if not isinstance(doc, dict):
        raise ValueError(f"proxy state must be a JSON object, got {type(doc).__name__}")
    own: dict[str, Any] = doc
    if box and doc.get("boxes") is not None:
        boxes = doc["boxes"]
        if not isinstance(boxes, list) or not all(isinstance(b, dict) for b in boxes):
            raise ValueError(f"proxy state boxes is {boxes!r}, expected a list of objects")
        entry = next((b for b in boxes if b.get("name") == box), None)
        if entry is None:
            names = ", ".join(str(b.get("name")) for b in boxes)
            raise ValueError(f"the proxy lists no box {box!r} (its boxes: {names})")
        own = entry

    def num(key: str, src: dict[str, Any] = doc) -> float | None:
        value = src.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"proxy state {key} is {value!r}, expected a number or null")
        return float(value)

    in_flight = num("in_flight", own)
    held = num("held")
    if in_flight is None or held is None:
        raise ValueError("proxy state lacks in_flight or held")
    return ProxyState(
        in_flight=int(in_flight),
        held=int(held),
        oldest_held_seconds=num("oldest_held_seconds"),
        last_request_started=num("last_request_started", own),
        last_request_finished=num("last_request_finished", own),
    )


@dataclass(frozen=True)
class Decision:
    go: bool
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class SwapObservations:
    queue_length: int
    activity: LlmActivity | None  # None: vLLM's metrics could not be read
    metrics_error: str | None = None
    proxy: ProxyState | None = None
    proxy_error: str | None = None  # set when a configured proxy did not answer
    card: CardView | None = None
    card_error: str | None = None
    held_by: str | None = None  # a hold on swaps (e.g. the comfyui role's probe)
    storage_problem: str | None = None  # the data directory cannot take the jobs' outputs
    image_retry_in: float | None = None  # ComfyUI failed to come up: seconds to wait
    image_failure: str | None = None
    # vLLM could not be stopped for the last swap: seconds until the next try, and why
    llm_stop_retry_in: float | None = None
    llm_stop_failure: str | None = None
    # the next job's workflow: ComfyUI's peak VRAM measured in earlier runs (None: unknown)
    next_job_peak: int | None = None
    # yielding tenants that acknowledged a pause (they step aside for the swap)
    paused: frozenset[str] = frozenset()


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe_client(name: str, vram_bytes: int, busy: tuple[str, ...]) -> str:
    parts = [f"holds {_gib(vram_bytes)} VRAM"] if vram_bytes > 0 else []
    if busy:
        parts.append(f"keeps {', '.join(busy)} busy")
    return f"{name} " + " and ".join(parts)


def _idle_blockers(
    obs: SwapObservations, config: Config, now: float, blockers: list[str]
) -> float | None:
    """vLLM idle long enough and the proxy empty: appends what is not so; the idle time."""
    idle_for: float | None = None
    if obs.activity is None:
        blockers.append(f"vLLM metrics unavailable ({obs.metrics_error or 'no answer'})")
    else:
        last = obs.activity.last_active_at
        if obs.proxy is not None:
            for ts in (obs.proxy.last_request_started, obs.proxy.last_request_finished):
                if ts is not None:
                    last = max(last, ts)
        idle_for = now - last
        if idle_for < config.idle_seconds:
            blockers.append(
                f"vLLM was active {idle_for:.0f} s ago (needs {config.idle_seconds:g} s idle)"
            )
    if obs.proxy_error is not None:
        blockers.append(f"proxy state unavailable ({obs.proxy_error})")
    elif obs.proxy is not None and (obs.proxy.in_flight > 0 or obs.proxy.held > 0):
        blockers.append(
            f"the proxy has {obs.proxy.in_flight} request(s) in flight and {obs.proxy.held} held"
        )
    return idle_for


def should_swap_to_image(obs: SwapObservations, config: Config, now: float) -> Decision:
    """All must hold: jobs queued, vLLM idle long enough, proxy empty, card free of others."""
    blockers: list[str] = []
    if obs.queue_length <= 0:
        return Decision(False, ("the job queue is empty",))
    if obs.held_by is not None:
        blockers.append(f"swaps are held by {obs.held_by}")
    if obs.storage_problem is not None:
        blockers.append(f"jobs are paused: {obs.storage_problem}")
    if obs.image_retry_in is not None and obs.image_retry_in > 0:
        blockers.append(
            f"ComfyUI failed to come up ({obs.image_failure or 'unknown'}): next try in "
            f"{obs.image_retry_in:.0f} s; the jobs stay queued"
        )
    if obs.llm_stop_retry_in is not None and obs.llm_stop_retry_in > 0:
        blockers.append(
            f"vLLM could not be stopped ({obs.llm_stop_failure or 'unknown'}): next try in "
            f"{obs.llm_stop_retry_in:.0f} s; the jobs stay queued"
        )
    idle_for = _idle_blockers(obs, config, now, blockers)
    if obs.card is None:
        blockers.append(f"card data unavailable ({obs.card_error or 'not read'})")
    else:
        age = obs.card.age(now)
        if age > config.card_data_max_age_seconds:
            blockers.append(
                f"card data is {age:.0f} s old (max {config.card_data_max_age_seconds:g} s)"
                " even after a fresh scan"
            )
        # the arbiter's own containers and the card's residents (the retrieval tier, planned
        # as a reservation) are never foreign clients
        others = obs.card.others(
            config.llm_names + config.image_names + config.resident_client_names
        )
        # a yielding tenant steps aside: once it acknowledged a pause and the card shows its
        # memory gone, it holds nothing
        yielding = set(config.yielding_names)
        for tenant in others:
            if tenant.name not in yielding:
                continue
            if tenant.name in obs.paused and tenant.vram_bytes == 0:
                continue
            state = (
                "paused, its memory not released yet"
                if tenant.name in obs.paused
                else ("not paused")
            )
            blockers.append(
                f"a yielding tenant is on {where(tenant.pdev)} ({state}): "
                + describe_client(tenant.name, tenant.vram_bytes, tenant.busy_engines)
            )
        foreign = tuple(c for c in others if c.name not in yielding)
        beside = image_fits_beside(obs, config) if foreign else None
        if beside is not None:
            # the policy image_beside_foreign: the job provably fits beside them
            fits_beside = beside
        else:
            fits_beside = ""
            for other in foreign:
                blockers.append(
                    f"another client is on {where(other.pdev)}: "
                    + describe_client(other.name, other.vram_bytes, other.busy_engines)
                )
    if blockers:
        return Decision(False, tuple(blockers))
    return Decision(
        True,
        (
            f"{obs.queue_length} job(s) queued",
            f"vLLM idle for {idle_for:.0f} s",
            fits_beside or "no other client on the card",
        ),
    )


def image_fits_beside(obs: SwapObservations, config: Config) -> str | None:
    """With ``image_beside_foreign`` on: the reason the next job provably fits beside the
    foreign clients on the card (its workflow's measured peak, the residents and the foreign
    clients as measured, the foreign reserve for new transcodes and the headroom within the
    card), else None (the veto stands). On a pool, within ComfyUI's card: the others hold
    none of the arbiter's work while image mode lasts."""
    if not config.image_beside_foreign or obs.card is None or obs.next_job_peak is None:
        return None
    card = obs.card.on(config.image_pdev)
    total = config.card_vram_bytes or card.vram_total_bytes
    if total is None:
        return None
    owners = set(config.llm_names + config.image_names)
    held = sum(c.vram_bytes for c in card.clients if c.name not in owners)
    need = obs.next_job_peak + held + config.foreign_reserve_bytes + config.vram_headroom_bytes
    if need > total:
        return None
    return (
        f"the next job's peak {_gib(obs.next_job_peak)} fits beside the other clients "
        f"({_gib(held)}), the foreign reserve ({_gib(config.foreign_reserve_bytes)}) and "
        f"the headroom within {_gib(total)} (image_beside_foreign)"
    )


@dataclass(frozen=True)
class HandbackObservations:
    queue_length: int
    image_since: float
    job_running: bool
    proxy: ProxyState | None = None


def should_hand_back(obs: HandbackObservations, config: Config, now: float) -> Decision:
    """Hand back when the queue is empty, time is up, or (policy) an agent waits; never
    while a job runs."""
    reasons: list[str] = []
    if obs.queue_length <= 0:
        reasons.append("the job queue is empty")
    spent = now - obs.image_since
    if spent >= config.max_image_seconds:
        reasons.append(
            f"image mode has lasted {spent:.0f} s (max_image_seconds {config.max_image_seconds:g})"
        )
    if config.handback_on_waiting_agent and obs.proxy is not None and obs.proxy.held > 0:
        reasons.append(f"{obs.proxy.held} agent request(s) held at the proxy")
    if not reasons:
        return Decision(False, (f"{obs.queue_length} job(s) queued",))
    if obs.job_running:
        return Decision(False, ("a job is running: never cut it", *reasons))
    return Decision(True, tuple(reasons))


def still_held(view: CardView, names: tuple[str, ...]) -> tuple[tuple[str | None, int], ...]:
    """The cards on which the named clients still hold VRAM, and how much: every pool card
    is judged (vLLM's tensor-parallel workers hold memory on each); empty: released."""
    held = ((pdev, card.vram_of(names)) for pdev, card in view.per_card())
    return tuple((pdev, size) for pdev, size in held if size > 0)


def where(pdev: str | None) -> str:
    """A client's card, as the reasons name it: "the card", or the pool card by address."""
    return "the card" if pdev is None else f"pool card {pdev}"


def llm_retry_delay(failures: int, base: float, cap: float) -> float:
    """Backoff after ``failures`` failures in a row: 0, then base, 2x, 4x ... capped."""
    if failures <= 0:
        return 0.0
    return float(min(cap, base * 2 ** (failures - 1)))


def should_restore_plan(obs: SwapObservations, config: Config, now: float) -> Decision:
    """A smaller plan serves: is this an idle moment to restart vLLM on a larger one? Idle as
    for a swap (no job queued, vLLM idle for idle_seconds, nothing in flight or held at the
    proxy, no hold); whether a larger plan fits is the engine's measure."""
    blockers: list[str] = []
    if not config.restore_full_plan:
        return Decision(False, ("restore_full_plan is off",))
    if obs.queue_length > 0:
        blockers.append(f"{obs.queue_length} job(s) queued: the handback chooses the plan")
    if obs.held_by is not None:
        blockers.append(f"swaps are held by {obs.held_by}")
    idle_for = _idle_blockers(obs, config, now, blockers) or 0.0
    if blockers:
        return Decision(False, tuple(blockers))
    return Decision(True, (f"vLLM idle for {idle_for:.0f} s",))
