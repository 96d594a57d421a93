"""Pure decisions of the patient proxy: no sockets, no clocks, no event loop.

- :func:`admit`: forward, hold or reject a new request given the mode and the queue;
- :func:`hold_expired` and :func:`connect_deadline`: the time bounds;
- :func:`retry_delay`: the backoff schedule for refused connections;
- :func:`is_proxied_path`, :func:`request_headers`, :func:`response_headers`: what passes;
- :func:`error_body` and the ``*_message`` helpers: OpenAI-shaped 503/429/413/408/401 bodies.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MODES = ("llm", "swapping", "image")

#: Headers meaningful for one connection only (RFC 9110 section 7.6.1), never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

#: Request headers the proxy recomputes itself: the upstream's host, the buffered body's length,
#: and ``Expect`` (the proxy has already read the whole body).
REQUEST_RECOMPUTED = frozenset({"host", "content-length", "expect"})


class Action(enum.Enum):
    """What to do with a request that has just arrived."""

    FORWARD = "forward"
    HOLD = "hold"
    REJECT_COUNT = "reject_count"


def admit(mode: str, held: int, hold_max_requests: int) -> Action:
    """Decide for a new request: forward in ``llm``, otherwise hold unless the queue is full.

    ``held`` is the number of requests already held; the new one would be number ``held + 1``.
    """
    if mode == "llm":
        return Action.FORWARD
    if held >= hold_max_requests:
        return Action.REJECT_COUNT
    return Action.HOLD


def hold_expired(held_seconds: float, hold_max_seconds: float) -> bool:
    """True when a request has been held (or kept waiting) for the whole time bound."""
    return held_seconds >= hold_max_seconds


def connect_deadline(
    arrived: float, now: float, hold_max_seconds: float, connect_retry_seconds: float
) -> float:
    """The monotonic time after which refused connections are no longer retried.

    Retrying lasts at most ``connect_retry_seconds`` from ``now`` and never beyond the request's
    whole waiting bound, ``hold_max_seconds`` after it ``arrived``.
    """
    return min(now + connect_retry_seconds, arrived + hold_max_seconds)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff for refused connections: ``initial * factor**attempt``, capped."""

    initial: float = 0.05
    factor: float = 2.0
    cap: float = 1.0


def retry_delay(attempt: int, now: float, deadline: float, backoff: Backoff) -> float | None:
    """Seconds to sleep before retry number ``attempt + 1``, or None when the deadline has come.

    The last sleep is shortened so that the final attempt happens right at the deadline.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    remaining = deadline - now
    if remaining <= 0:
        return None
    delay = min(backoff.initial * backoff.factor**attempt, backoff.cap)
    return min(delay, remaining)


def is_proxied_path(path: str, prefixes: Sequence[str]) -> bool:
    """True when ``path`` is forwarded to the upstream (and held when the card is lent)."""
    return any(path.startswith(prefix) for prefix in prefixes)


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """Header names listed in ``Connection`` (they are hop-by-hop for this message too)."""
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def _filtered(headers: Sequence[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    extra = _connection_tokens(headers)
    return [(k, v) for k, v in headers if k.lower() not in drop and k.lower() not in extra]


def request_headers(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers of a client request as sent upstream (order and repeats kept)."""
    return _filtered(headers, HOP_BY_HOP | REQUEST_RECOMPUTED)


def response_headers(headers: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers of an upstream response as sent to the client (order and repeats kept)."""
    return _filtered(headers, HOP_BY_HOP)


def _mode_phrase(mode: str) -> str:
    if mode == "image":
        return "the card is lent to image jobs"
    if mode == "swapping":
        return "the card is being swapped between the LLM and image jobs"
    return "the LLM is not available"


def count_message(mode: str, hold_max_requests: int, retry_after: int) -> str:
    """Why a request is refused because the queue of held requests is full."""
    return (
        f"{_mode_phrase(mode)} and {hold_max_requests} requests are already waiting "
        f"(hold_max_requests); retry after {retry_after} s"
    )


def time_message(mode: str, hold_max_seconds: float, retry_after: int) -> str:
    """Why a request is refused after waiting for the whole time bound."""
    return (
        f"{_mode_phrase(mode)}; waited {hold_max_seconds:g} s (hold_max_seconds); "
        f"retry after {retry_after} s"
    )


def upstream_message(waited_seconds: float, reason: str, retry_after: int) -> str:
    """Why a request is refused because the LLM server did not take the connection."""
    return (
        f"the LLM server is not accepting connections (starting?) after {waited_seconds:.1f} s: "
        f"{reason}; retry after {retry_after} s"
    )


def broken_message(reason: str, retry_after: int) -> str:
    """Why a request is refused when the LLM server broke off a short answer before any byte
    of it reached the client."""
    return f"the LLM server broke off its answer: {reason}; retry after {retry_after} s"


def stopping_message(retry_after: int) -> str:
    """Why a held request is refused when the proxy stops."""
    return f"the proxy is restarting; retry after {retry_after} s"


def too_large_message(max_body_bytes: int) -> str:
    """Why a request body is refused."""
    return f"request body exceeds {max_body_bytes} bytes (max_body_bytes)"


def body_timeout_message(body_timeout_seconds: float) -> str:
    """Why a request is refused when its body does not arrive in time."""
    return f"request body not received within {body_timeout_seconds:g} s (body_timeout_seconds)"


#: The 401's message, as OpenAI words a missing or wrong key (the key itself is never echoed).
UNAUTHORIZED_MESSAGE = (
    "Incorrect or missing API key: send 'Authorization: Bearer KEY' with a key the proxy "
    "knows (cardshare proxy key add NAME on the proxy's host makes one)"
)


def key_limit_message(name: str, bound: int, retry_after: int) -> str:
    """Why a request is refused because its key already has ``bound`` requests."""
    return (
        f"key {name!r} already has {bound} requests held or in flight (key_max_requests); "
        f"retry after {retry_after} s"
    )


def unknown_model_message(model: str, served: Sequence[str]) -> str:
    """Why a fleet answers 404: no box serves the request's model."""
    return (
        f"The model `{model}` does not exist on any box of this fleet; "
        f"the boxes serve: {', '.join(served)}"
    )


def error_body(message: str, code: str, err_type: str = "service_unavailable") -> bytes:
    """An OpenAI-shaped error document, as JSON bytes."""
    doc: Mapping[str, object] = {
        "error": {"message": message, "type": err_type, "param": None, "code": code}
    }
    return json.dumps(doc).encode()
