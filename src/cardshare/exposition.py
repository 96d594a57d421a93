"""Prometheus exposition of the arbiter and the proxy, through ``prometheus_client``.

Each service keeps a registry of its own (never the library's global one) holding one
collector that reads the service's live state at scrape time; ``/metrics`` is the library's
aiohttp handler on that registry, so names, escaping and content negotiation are the
library's. The recorder does not use this module: it stays standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp.typedefs import Handler
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

__all__ = ["LiveCollector", "bound_label", "handler", "registry_of", "text"]


class LiveCollector:
    """A collector whose metric families are computed by ``read`` at each scrape."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return list(self._read())


def registry_of(read: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A registry of its own with one :class:`LiveCollector` (``read`` is not called yet)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(read))
    return registry


def text(families: Iterable[Metric]) -> str:
    """The Prometheus text exposition (format 0.0.4) of ``families``."""
    fixed = list(families)
    return generate_latest(registry_of(lambda: fixed)).decode("utf-8")


def handler(registry: CollectorRegistry) -> Handler:
    """The aiohttp handler serving ``registry`` (text format, or OpenMetrics when asked)."""
    return make_aiohttp_handler(registry)


def bound_label(bound: float) -> str:
    """A histogram bucket's ``le`` as the library writes it (``1.0``, ``+Inf``)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]  # untyped in the library
