"""Counters of the proxy and their Prometheus text exposition (format 0.0.4)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((f"{bound:g}", running))
        out.append(("+Inf", self.count))
        return out


@dataclass
class Counters:
    """Everything ``/metrics`` reports that is not read from live state."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    hold_seconds: Histogram = field(default_factory=Histogram)
    connect_retries: int = 0
    arbiter_poll_failures: int = 0

    def count(self, outcome: str) -> None:
        """Count one request ending with ``outcome``."""
        if outcome not in self.outcomes:
            raise ValueError(f"unknown outcome {outcome!r}; known: {', '.join(OUTCOMES)}")
        self.outcomes[outcome] += 1


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


def render(counters: Counters, gauges: Gauges) -> str:
    """The Prometheus text exposition of the proxy's metrics."""
    p = "cardshare_proxy_"
    lines = [
        f"# HELP {p}requests_total Proxied requests by how they ended.",
        f"# TYPE {p}requests_total counter",
    ]
    lines += [f'{p}requests_total{{outcome="{o}"}} {n}' for o, n in counters.outcomes.items()]
    lines += [
        f"# HELP {p}held Requests held while the card is not in llm mode.",
        f"# TYPE {p}held gauge",
        f"{p}held {gauges.held}",
        f"# HELP {p}held_body_bytes Request body bytes buffered for held requests.",
        f"# TYPE {p}held_body_bytes gauge",
        f"{p}held_body_bytes {gauges.held_body_bytes}",
        f"# HELP {p}in_flight Requests forwarded to the upstream and not finished.",
        f"# TYPE {p}in_flight gauge",
        f"{p}in_flight {gauges.in_flight}",
        f"# HELP {p}oldest_held_seconds Age of the oldest held request (0 when none).",
        f"# TYPE {p}oldest_held_seconds gauge",
        f"{p}oldest_held_seconds {gauges.oldest_held_seconds or 0.0:.3f}",
        f"# HELP {p}hold_seconds Time requests spent held.",
        f"# TYPE {p}hold_seconds histogram",
    ]
    lines += [
        f'{p}hold_seconds_bucket{{le="{le}"}} {n}' for le, n in counters.hold_seconds.cumulative()
    ]
    lines += [
        f"{p}hold_seconds_sum {counters.hold_seconds.total:.6f}",
        f"{p}hold_seconds_count {counters.hold_seconds.count}",
        f"# HELP {p}mode The arbiter's mode as the proxy believes it.",
        f"# TYPE {p}mode gauge",
    ]
    lines += [f'{p}mode{{mode="{m}"}} {int(m == gauges.mode)}' for m in MODES]
    lines += [
        f"# HELP {p}mode_source Where the believed mode comes from.",
        f"# TYPE {p}mode_source gauge",
    ]
    lines += [
        f'{p}mode_source{{source="{s}"}} {int(s == gauges.mode_source)}'
        for s in ("arbiter", "last-known", "default")
    ]
    lines += [
        f"# HELP {p}connect_retries_total Upstream connections retried after a refusal.",
        f"# TYPE {p}connect_retries_total counter",
        f"{p}connect_retries_total {counters.connect_retries}",
        f"# HELP {p}arbiter_poll_failures_total Mode polls that did not reach the arbiter.",
        f"# TYPE {p}arbiter_poll_failures_total counter",
        f"{p}arbiter_poll_failures_total {counters.arbiter_poll_failures}",
        f"# HELP {p}client_read_timeouts_total Slow clients cut off, by what was late.",
        f"# TYPE {p}client_read_timeouts_total counter",
        f'{p}client_read_timeouts_total{{phase="header"}} {gauges.header_timeouts}',
        f'{p}client_read_timeouts_total{{phase="body"}} {gauges.body_timeouts}',
    ]
    return "\n".join(lines) + "\n"
