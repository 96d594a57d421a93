"""Mode knowledge, the hold queue and the metrics text, without sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from promtext import Exposition

from cardshare.proxy.holdqueue import HoldQueue
from cardshare.proxy.metrics import (
    HOLD_BUCKETS,
    MODE_SOURCES,
    OUTCOMES,
    Counters,
    Gauges,
    Histogram,
    render,
)
from cardshare.proxy.mode import (
    ModePayloadError,
    ModeView,
    on_arbiter_answer,
    on_arbiter_down,
    parse_mode_payload,
)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"mode": "llm", "since": 1700000000}, ("llm", 1700000000.0)),
        ({"mode": "image", "since": 1.5, "queue": []}, ("image", 1.5)),
        ({"mode": "swapping"}, ("swapping", None)),
    ],
)
def test_parse_mode_payload(doc: object, expected: tuple[str, float | None]) -> None:
    assert parse_mode_payload(doc) == expected


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "expected a JSON object, got list"),
        ({}, "mode must be one of llm, swapping, image, got None"),
        ({"mode": "LLM"}, "mode must be one of llm, swapping, image, got 'LLM'"),
        ({"mode": "llm", "since": "now"}, "since must be a unix timestamp, got 'now'"),
        ({"mode": "llm", "since": True}, "since must be a unix timestamp, got True"),
    ],
)
def test_parse_mode_payload_refuses(doc: object, message: str) -> None:
    with pytest.raises(ModePayloadError) as err:
        parse_mode_payload(doc)
    assert str(err.value) == message


KNOWN_IMAGE = ModeView("image", 5.0, "arbiter", 10.0, None)


@pytest.mark.parametrize(
    ("view", "trust", "expected"),
    [
        (KNOWN_IMAGE, True, ModeView("image", 5.0, "last-known", 10.0, "down")),
        (KNOWN_IMAGE, False, ModeView("llm", None, "default", 10.0, "down")),
        (ModeView(), True, ModeView("llm", None, "default", None, "down")),
        (
            ModeView("image", 5.0, "last-known", 10.0, "old"),
            True,
            ModeView("image", 5.0, "last-known", 10.0, "down"),
        ),
    ],
)
def test_on_arbiter_down(view: ModeView, trust: bool, expected: ModeView) -> None:
    assert on_arbiter_down(view, "down", trust) == expected


def test_on_arbiter_answer_clears_the_error() -> None:
    view = ModeView("image", 5.0, "last-known", 10.0, "down")
    assert on_arbiter_answer(view, "llm", 20.0, 30.0) == ModeView("llm", 20.0, "arbiter", 30.0)


async def test_hold_queue_fifo_remove_and_age() -> None:
    queue = HoldQueue()
    first, second, third = queue.add(1.0), queue.add(2.0), queue.add(3.0)
    assert (len(queue), queue.oldest_age(4.0)) == (3, 3.0)
    assert (queue.remove(first), queue.remove(first)) == (True, False)
    assert queue.oldest_age(4.0) == 2.0
    order: list[int] = []

    def recorder(ticket: int) -> Callable[[asyncio.Future[None]], None]:
        return lambda _future: order.append(ticket)

    for held in (second, third):
        held.future.add_done_callback(recorder(held.ticket))
    assert queue.release_all() == 2
    await asyncio.sleep(0)
    assert (order, len(queue), queue.oldest_age(4.0)) == ([second.ticket, third.ticket], 0, None)
    assert not first.future.done()


async def test_hold_queue_buffered_bytes() -> None:
    queue = HoldQueue()
    sizes = {"a": 100, "c": 7}
    first = queue.add(1.0, buffered=lambda: sizes["a"])
    queue.add(2.0)  # no body
    queue.add(3.0, buffered=lambda: sizes["c"])
    assert queue.buffered_bytes() == 107
    sizes["c"] = 70  # more of the body arrived
    assert queue.buffered_bytes() == 170
    queue.remove(first)
    assert queue.buffered_bytes() == 70
    queue.release_all()
    assert queue.buffered_bytes() == 0


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], [0, 0, 0]),
        ([0.1], [1, 1, 1]),
        ([0.05, 0.5, 7.0], [1, 2, 3]),
        ([5000.0], [0, 0, 1]),
    ],
)
def test_histogram_cumulative(values: list[float], expected: list[int]) -> None:
    hist = Histogram()
    for value in values:
        hist.observe(value)
    cumulative = dict(hist.cumulative())
    assert [cumulative["0.1"], cumulative["0.5"], cumulative["+Inf"]] == expected
    assert hist.count == len(values)


def test_counters_refuse_unknown_outcome() -> None:
    with pytest.raises(ValueError) as err:
        Counters().count("lost")
    assert str(err.value) == (
        "unknown outcome 'lost'; known: forwarded, rejected_count, rejected_time, "
        "rejected_too_large, rejected_body_timeout, rejected_stopping, client_gone, "
        "upstream_error, rejected_unauthorized, rejected_key_limit"
    )


def test_render() -> None:
    counters = Counters()
    counters.count("forwarded")
    counters.count("rejected_time")
    counters.hold_seconds.observe(2.0)
    gauges = Gauges(3, 1, 12.5, "image", "last-known", held_body_bytes=4096, header_timeouts=2)
    m = Exposition(render(counters, gauges))
    assert m.types == {
        "cardshare_proxy_requests": "counter",
        "cardshare_proxy_held": "gauge",
        "cardshare_proxy_held_body_bytes": "gauge",
        "cardshare_proxy_in_flight": "gauge",
        "cardshare_proxy_oldest_held_seconds": "gauge",
        "cardshare_proxy_hold_seconds": "histogram",
        "cardshare_proxy_mode": "gauge",
        "cardshare_proxy_mode_source": "gauge",
        "cardshare_proxy_connect_retries": "counter",
        "cardshare_proxy_arbiter_poll_failures": "counter",
        "cardshare_proxy_client_read_timeouts": "counter",
    }
    assert m.series("cardshare_proxy_requests_total") == {
        frozenset({("outcome", o)}): {"forwarded": 1, "rejected_time": 1}.get(o, 0)
        for o in OUTCOMES
    }
    assert m("cardshare_proxy_held") == 3
    assert m("cardshare_proxy_held_body_bytes") == 4096
    assert m("cardshare_proxy_in_flight") == 1
    assert m("cardshare_proxy_oldest_held_seconds") == 12.5
    assert m("cardshare_proxy_client_read_timeouts_total", phase="header") == 2
    assert m("cardshare_proxy_client_read_timeouts_total", phase="body") == 0
    assert m("cardshare_proxy_connect_retries_total") == 0
    assert m("cardshare_proxy_arbiter_poll_failures_total") == 0
    buckets = m.series("cardshare_proxy_hold_seconds_bucket")
    assert [buckets[frozenset({("le", le)})] for le in ("0.1", "1.0", "5.0", "1800.0", "+Inf")] == [
        0,
        0,
        1,
        1,
        1,
    ]
    assert len(buckets) == len(HOLD_BUCKETS) + 1
    assert m("cardshare_proxy_hold_seconds_sum") == 2.0
    assert m("cardshare_proxy_hold_seconds_count") == 1
    assert m.series("cardshare_proxy_mode") == {
        frozenset({("mode", "image")}): 1,
        frozenset({("mode", "llm")}): 0,
        frozenset({("mode", "swapping")}): 0,
    }
    assert m.series("cardshare_proxy_mode_source") == {
        frozenset({("source", s)}): int(s == "last-known") for s in MODE_SOURCES
    }


def test_render_without_held_requests() -> None:
    """No held request: the oldest age is 0, not absent."""
    m = Exposition(render(Counters(), Gauges(0, 0, None, "llm", "default")))
    assert m("cardshare_proxy_oldest_held_seconds") == 0
    assert m("cardshare_proxy_hold_seconds_count") == 0
