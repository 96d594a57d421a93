"""The proxy's pure decisions, without sockets."""

from __future__ import annotations

import json

import pytest

from cardshare.proxy import rules
from cardshare.proxy.rules import Action, Backoff


@pytest.mark.parametrize(
    ("mode", "held", "limit", "expected"),
    [
        ("llm", 0, 64, Action.FORWARD),
        ("llm", 500, 64, Action.FORWARD),
        ("image", 0, 64, Action.HOLD),
        ("image", 63, 64, Action.HOLD),
        ("image", 64, 64, Action.REJECT_COUNT),
        ("swapping", 10, 64, Action.HOLD),
        ("swapping", 64, 64, Action.REJECT_COUNT),
        ("image", 0, 0, Action.REJECT_COUNT),
    ],
)
def test_admit(mode: str, held: int, limit: int, expected: Action) -> None:
    assert rules.admit(mode, held, limit) is expected


@pytest.mark.parametrize(
    ("held_seconds", "limit", "expected"),
    [(0.0, 600.0, False), (599.9, 600.0, False), (600.0, 600.0, True), (700.0, 600.0, True)],
)
def test_hold_expired(held_seconds: float, limit: float, expected: bool) -> None:
    assert rules.hold_expired(held_seconds, limit) is expected


@pytest.mark.parametrize(
    ("arrived", "now", "hold_max", "retry", "expected"),
    [
        (100.0, 100.0, 600.0, 120.0, 220.0),  # connect bound first
        (100.0, 590.0, 600.0, 120.0, 700.0),  # held long: the whole wait bound first
        (100.0, 800.0, 600.0, 120.0, 700.0),  # already past: deadline in the past
        (100.0, 100.0, 600.0, 0.0, 100.0),  # no retrying at all
    ],
)
def test_connect_deadline(
    arrived: float, now: float, hold_max: float, retry: float, expected: float
) -> None:
    assert rules.connect_deadline(arrived, now, hold_max, retry) == expected


@pytest.mark.parametrize(
    ("attempt", "now", "deadline", "expected"),
    [
        (0, 0.0, 10.0, 0.05),
        (1, 0.0, 10.0, 0.1),
        (4, 0.0, 10.0, 0.8),
        (5, 0.0, 10.0, 1.0),  # capped
        (50, 0.0, 10.0, 1.0),
        (3, 9.9, 10.0, pytest.approx(0.1)),  # shortened to land on the deadline
        (0, 10.0, 10.0, None),
        (0, 11.0, 10.0, None),
    ],
)
def test_retry_delay(attempt: int, now: float, deadline: float, expected: float | None) -> None:
    assert rules.retry_delay(attempt, now, deadline, Backoff()) == expected


def test_retry_delay_refuses_negative_attempt() -> None:
    with pytest.raises(ValueError, match=r"^attempt must be >= 0, got -1$"):
        rules.retry_delay(-1, 0.0, 1.0, Backoff())


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions", True),
        ("/v1/models", True),
        ("/v1", False),
        ("/v10/x", False),
        ("/health", False),
        ("/metrics", False),
    ],
)
def test_is_proxied_path(path: str, expected: bool) -> None:
    assert rules.is_proxied_path(path, ("/v1/",)) is expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            [("Host", "proxy:8080"), ("Content-Type", "application/json"), ("Content-Length", "9")],
            [("Content-Type", "application/json")],
        ),
        (
            [
                ("Connection", "keep-alive, X-Trace"),
                ("X-Trace", "1"),
                ("Authorization", "Bearer k"),
            ],
            [("Authorization", "Bearer k")],
        ),
        (
            [("Transfer-Encoding", "chunked"), ("TE", "trailers"), ("Expect", "100-continue")],
            [],
        ),
        (
            [("Accept", "a"), ("X-Dup", "1"), ("X-Dup", "2"), ("Proxy-Authorization", "x")],
            [("Accept", "a"), ("X-Dup", "1"), ("X-Dup", "2")],
        ),
    ],
)
def test_request_headers(given: list[tuple[str, str]], expected: list[tuple[str, str]]) -> None:
    assert rules.request_headers(given) == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")],
            [("Content-Type", "text/event-stream")],
        ),
        (
            [("Content-Length", "12"), ("Keep-Alive", "timeout=5"), ("Set-Cookie", "a=1")],
            [("Content-Length", "12"), ("Set-Cookie", "a=1")],
        ),
        ([("Upgrade", "h2c"), ("Server", "uvicorn")], [("Server", "uvicorn")]),
    ],
)
def test_response_headers(given: list[tuple[str, str]], expected: list[tuple[str, str]]) -> None:
    assert rules.response_headers(given) == expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            rules.count_message("image", 64, 30),
            "the card is lent to image jobs and 64 requests are already waiting "
            "(hold_max_requests); retry after 30 s",
        ),
        (
            rules.count_message("swapping", 2, 5),
            "the card is being swapped between the LLM and image jobs and 2 requests are "
            "already waiting (hold_max_requests); retry after 5 s",
        ),
        (
            rules.time_message("image", 600.0, 30),
            "the card is lent to image jobs; waited 600 s (hold_max_seconds); retry after 30 s",
        ),
        (
            rules.upstream_message(120.04, "ClientConnectorError: refused", 30),
            "the LLM server is not accepting connections (starting?) after 120.0 s: "
            "ClientConnectorError: refused; retry after 30 s",
        ),
        (
            rules.broken_message("ClientPayloadError: cut", 30),
            "the LLM server broke off its answer: ClientPayloadError: cut; retry after 30 s",
        ),
        (rules.stopping_message(30), "the proxy is restarting; retry after 30 s"),
        (rules.too_large_message(8388608), "request body exceeds 8388608 bytes (max_body_bytes)"),
    ],
)
def test_messages(message: str, expected: str) -> None:
    assert message == expected


def test_error_body_is_openai_shaped() -> None:
    assert json.loads(rules.error_body("m", "c")) == {
        "error": {"message": "m", "type": "service_unavailable", "param": None, "code": "c"}
    }
