"""Counters of the proxy and its Prometheus metrics, as ``prometheus_client`` metric families.

:class:`Counters` is what the proxy counts itself; :class:`Gauges` is read from its live
state at each scrape; :func:`families` (pure) turns both into metric families, which the
proxy serves from a registry of its own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cardshare import exposition
from cardshare.proxy.rules import MODES

#: Every way a proxied request can end.
OUTCOMES = (
    "forwarded",
    "rejected_count",
    "rejected_time",
    "rejected_too_large",
    "rejected_body_timeout",
    "rejected_stopping",
    "client_gone",
    "upstream_error",
    "rejected_unauthorized",
    "rejected_key_limit",
)

#: Upper bounds (seconds) of the hold-time histogram buckets.
HOLD_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram with fixed buckets."""

    bounds: tuple[float, ...] = HOLD_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(HOLD_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((exposition.bound_label(bound), running))
        out.append((exposition.bound_label(float("inf")), self.count))
        return out


@dataclass
class Counters:
    """Everything ``/metrics`` reports that is not read from live state."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    hold_seconds: Histogram = field(default_factory=Histogram)
    connect_retries: int = 0
    arbiter_poll_failures: int = 0
    #: Requests moved to another box after a refused connection (a fleet only).
    box_failovers: int = 0
    #: Requests for a model no box of the fleet serves (answered 404).
    unknown_model: int = 0

    def count(self, outcome: str) -> None:
        """Count one request ending with ``outcome``."""
        if outcome not in self.outcomes:
            raise ValueError(f"unknown outcome {outcome!r}; known: {', '.join(OUTCOMES)}")
        self.outcomes[outcome] += 1


@dataclass(frozen=True)
class BoxGauges:
    """One box of a fleet at the time of a scrape."""

    name: str
    mode: str
    in_rotation: bool
    in_flight: int
    #: Requests sent to it since the start (a counter).
    routed: int


@dataclass(frozen=True)
class Gauges:
    """Live values at the time of a scrape."""

    held: int
    in_flight: int
    oldest_held_seconds: float | None
    mode: str
    mode_source: str
    #: Body bytes buffered for held requests.
    held_body_bytes: int = 0
    #: Client connections closed without a complete request head (counter).
    header_timeouts: int = 0
    #: Request bodies that did not arrive in time (counter).
    body_timeouts: int = 0
    #: 1 when the key file on disk is the one in force, 0 when it is not (unreadable or
    #: malformed: the last good keys stay); None when the proxy takes no keys.
    keys_file_ok: int | None = None
    #: Keys in force (None when the proxy takes no keys).
    keys: int | None = None
    #: The boxes of a fleet; empty without ``boxes`` (then no per-box series).
    boxes: tuple[BoxGauges, ...] = ()


#: Where the believed mode can come from (``cardshare_proxy_mode_source``).
MODE_SOURCES = ("arbiter", "last-known", "default")


def families(counters: Counters, gauges: Gauges) -> list[Metric]:
    """The metric families of the proxy's ``/metrics``."""
    p = "cardshare_proxy_"
    requests = CounterMetricFamily(
        f"{p}requests_total", "Proxied requests by how they ended.", labels=["outcome"]
    )
    for outcome, n in counters.outcomes.items():
        requests.add_metric([outcome], n)
    hold = HistogramMetricFamily(f"{p}hold_seconds", "Time requests spent held.")
    hold.add_metric([], counters.hold_seconds.cumulative(), counters.hold_seconds.total)
    mode = GaugeMetricFamily(
        f"{p}mode", "The arbiter's mode as the proxy believes it.", labels=["mode"]
    )
    for m in MODES:
        mode.add_metric([m], int(m == gauges.mode))
    source = GaugeMetricFamily(
        f"{p}mode_source", "Where the believed mode comes from.", labels=["source"]
    )
    for s in MODE_SOURCES:
        source.add_metric([s], int(s == gauges.mode_source))
    read_timeouts = CounterMetricFamily(
        f"{p}client_read_timeouts_total",
        "Slow clients cut off, by what was late.",
        labels=["phase"],
    )
    read_timeouts.add_metric(["header"], gauges.header_timeouts)
    read_timeouts.add_metric(["body"], gauges.body_timeouts)
    return [
        requests,
        GaugeMetricFamily(
            f"{p}held", "Requests held while the card is not in llm mode.", value=gauges.held
        ),
        GaugeMetricFamily(
            f"{p}held_body_bytes",
            "Request body bytes buffered for held requests.",
            value=gauges.held_body_bytes,
        ),
        GaugeMetricFamily(
            f"{p}in_flight",
            "Requests forwarded to the upstream and not finished.",
            value=gauges.in_flight,
        ),
        GaugeMetricFamily(
            f"{p}oldest_held_seconds",
            "Age of the oldest held request (0 when none).",
            value=gauges.oldest_held_seconds or 0.0,
        ),
        hold,
        mode,
        source,
        CounterMetricFamily(
            f"{p}connect_retries_total",
            "Upstream connections retried after a refusal.",
            value=counters.connect_retries,
        ),
        CounterMetricFamily(
            f"{p}arbiter_poll_failures_total",
            "Mode polls that did not reach the arbiter.",
            value=counters.arbiter_poll_failures,
        ),
        read_timeouts,
        *_key_families(p, gauges),
        *_box_families(p, counters, gauges.boxes),
    ]


def _box_families(p: str, counters: Counters, boxes: tuple[BoxGauges, ...]) -> list[Metric]:
    if not boxes:
        return []
    routed = CounterMetricFamily(
        f"{p}box_requests_total",
        "Requests sent to each box (a failover counts twice).",
        labels=["box"],
    )
    in_flight = GaugeMetricFamily(
        f"{p}box_in_flight", "Requests forwarded to each box and not finished.", labels=["box"]
    )
    rotation = GaugeMetricFamily(
        f"{p}box_in_rotation", "1 when the box takes new requests.", labels=["box"]
    )
    mode = GaugeMetricFamily(
        f"{p}box_mode", "Each box's mode as its arbiter last said it.", labels=["box", "mode"]
    )
    for b in boxes:
        routed.add_metric([b.name], b.routed)
        in_flight.add_metric([b.name], b.in_flight)
        rotation.add_metric([b.name], int(b.in_rotation))
        for m in MODES:
            mode.add_metric([b.name, m], int(m == b.mode))
    failovers = CounterMetricFamily(
        f"{p}box_failovers_total",
        "Requests moved to another box after its vLLM refused the connection.",
        value=counters.box_failovers,
    )
    unknown = CounterMetricFamily(
        f"{p}unknown_model_total",
        "Requests for a model no box serves (answered 404 model_not_found).",
        value=counters.unknown_model,
    )
    return [routed, in_flight, rotation, mode, failovers, unknown]


def _key_families(p: str, gauges: Gauges) -> list[Metric]:
    if gauges.keys_file_ok is None or gauges.keys is None:
        return []
    return [
        GaugeMetricFamily(
            f"{p}keys_file_ok",
            "1 when the key file on disk is in force, 0 when it did not load (last good kept).",
            value=gauges.keys_file_ok,
        ),
        GaugeMetricFamily(f"{p}keys", "API keys in force.", value=gauges.keys),
    ]


def render(counters: Counters, gauges: Gauges) -> str:
    """The Prometheus text exposition of :func:`families` (what a scrape without
    ``Accept: application/openmetrics-text`` gets)."""
    return exposition.text(families(counters, gauges))
