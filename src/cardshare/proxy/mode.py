"""The arbiter's mode as the proxy knows it, and where that knowledge comes from.

The arbiter answers ``GET /v1/mode`` with ``{"mode": "llm"|"swapping"|"image", "since": ts}``
(``GET /v1/status`` carries the same ``mode`` field). When the arbiter cannot be reached the
proxy keeps the last mode it saw (``mode_source`` ``last-known``); before it has ever seen one
it assumes ``llm`` (``mode_source`` ``default``). With ``trust_mode_when_arbiter_down`` off it
assumes ``llm`` whenever the arbiter is down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from cardshare.proxy.rules import MODES

ModeSource = Literal["arbiter", "last-known", "default"]


class ModePayloadError(ValueError):
    """The arbiter's answer does not carry a usable mode."""


def parse_mode_payload(doc: object) -> tuple[str, float | None]:
    """``(mode, since)`` from a ``/v1/mode`` or ``/v1/status`` JSON document."""
    if not isinstance(doc, dict):
        raise ModePayloadError(f"expected a JSON object, got {type(doc).__name__}")
    mode = doc.get("mode")
    if mode not in MODES:
        raise ModePayloadError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    since = doc.get("since")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int | float)):
        raise ModePayloadError(f"since must be a unix timestamp, got {since!r}")
    return str(mode), (float(since) if since is not None else None)


@dataclass(frozen=True)
class ModeView:
    """What the proxy believes: the mode, since when (arbiter's clock) and why it believes it."""

    mode: str = "llm"
    since: float | None = None
    source: ModeSource = "default"
    #: Unix time of the last successful poll, None if the arbiter never answered.
    arbiter_seen: float | None = None
    #: Why the last poll failed, None when it succeeded.
    arbiter_error: str | None = None


def on_arbiter_answer(view: ModeView, mode: str, since: float | None, now: float) -> ModeView:
    """The arbiter answered with ``mode``."""
    return ModeView(mode=mode, since=since, source="arbiter", arbiter_seen=now, arbiter_error=None)


def on_arbiter_down(view: ModeView, error: str, trust_last_known: bool) -> ModeView:
    """The arbiter could not be reached (or answered nonsense)."""
    if trust_last_known and view.source != "default":
        return replace(view, source="last-known", arbiter_error=error)
    return replace(view, mode="llm", since=None, source="default", arbiter_error=error)
