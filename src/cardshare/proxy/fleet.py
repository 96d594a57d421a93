"""The boxes behind the proxy (issue 33): what it knows of each and which one takes a request.

Each box's arbiter is **polled** (``GET /v1/mode`` every ``mode_poll_seconds``, one task per
box so a hanging arbiter delays no other): the arbiter has no event stream (its API has
``/v1/mode`` and ``/v1/status`` only), a poll of a few hundred bytes a second per box costs
nothing, and a poll notices an arbiter that has gone silent by itself, which a stream would
need a heartbeat for.

Without ``boxes`` the proxy has one box (:meth:`ProxyConfig.fleet`) that serves any model,
and everything behaves as before: the mode view of :mod:`cardshare.proxy.mode` with
``trust_mode_when_arbiter_down`` (the last mode kept while the arbiter is down), refused
connections retried on that box while vLLM starts.

With ``boxes`` a box is *in rotation* when its arbiter's last answer was ``llm`` and nothing
has failed since. It leaves the rotation:

- when a poll fails (refused, an error status, garbage, or no answer within the poll timeout
  ``max(1, min(5, 2 x mode_poll_seconds))`` s): at most ``mode_poll_seconds`` + that timeout
  after the arbiter stops answering well; ``trust_mode_when_arbiter_down`` does not apply to a
  fleet (another box can serve; a silent arbiter may be lending its card);
- when a connection to its vLLM fails (refused, or closed before any answer): at once, and the
  request is retried on another box, since nothing of it reached a client yet.

It comes back at its arbiter's next good ``llm`` answer (within ``mode_poll_seconds``). A box
leaving the rotation keeps its in-flight requests (a stream stays on its box to the end).

A request goes to a box in rotation that serves its ``model`` (requests without one, like
``GET /v1/models``, to any), the one with the fewest outstanding requests per unit of weight;
ties go to the one that was sent the fewest requests per unit of weight, so an idle fleet
takes turns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cardshare.proxy.config import Box
from cardshare.proxy.mode import ModeView
from cardshare.proxy.upstream import Origin


@dataclass
class BoxState:
    """One box as the proxy knows it."""

    box: Box
    index: int
    view: ModeView = field(default_factory=ModeView)
    #: Requests forwarded to it and not finished.
    in_flight: int = 0
    #: Requests sent to it since the start.
    routed: int = 0
    #: Unix times of the last request routed to it and of the last that ended there (its
    #: arbiter reads them as the box's own idle clock).
    last_request_started: float | None = None
    last_request_finished: float | None = None
    #: Why its vLLM last refused a connection; cleared by its arbiter's next good answer.
    upstream_error: str | None = None
    #: The ``Authorization`` sent to its vLLM (its own key), None for none.
    upstream_auth: str | None = None
    #: Its arbiter has no ``/v1/mode`` (404): read ``/v1/status``.
    use_status: bool = False
    #: Where its vLLM listens, and the path its ``upstream_url`` puts before each request's.
    origin: Origin = field(init=False)
    path_prefix: str = field(init=False)

    def __post_init__(self) -> None:
        self.origin = Origin.from_url(self.box.upstream_url)
        self.path_prefix = urlsplit(self.box.upstream_url).path.rstrip("/")

    def serves(self, model: str | None) -> bool:
        """True when the box serves ``model`` (None: a request naming none)."""
        return model is None or not self.box.models or model in self.box.models

    def in_rotation(self, fleet: bool) -> bool:
        """True when new requests may go to the box.

        One box (no ``boxes``): whenever the believed mode is ``llm``, as before the fleet.
        """
        if not fleet:
            return self.view.mode == "llm"
        return (
            self.view.mode == "llm"
            and self.view.source == "arbiter"
            and self.view.arbiter_error is None
            and self.upstream_error is None
        )

    @property
    def error(self) -> str | None:
        """Why the box is out of rotation beyond its mode, if anything failed."""
        if self.view.arbiter_error is not None:
            return f"arbiter: {self.view.arbiter_error}"
        if self.upstream_error is not None:
            return f"upstream: {self.upstream_error}"
        return None


def pick(
    boxes: Sequence[BoxState],
    model: str | None,
    fleet: bool,
    exclude: Sequence[BoxState] = (),
) -> BoxState | None:
    """The box for a request for ``model``: in rotation, serving it, least loaded by weight."""
    best: BoxState | None = None
    best_key: tuple[float, float, int] | None = None
    for state in boxes:
        if state in exclude or not state.serves(model) or not state.in_rotation(fleet):
            continue
        weight = state.box.weight
        key = (state.in_flight / weight, state.routed / weight, state.index)
        if best_key is None or key < best_key:
            best, best_key = state, key
    return best


def fleet_mode(boxes: Sequence[BoxState], model: str | None = None) -> str:
    """The one mode of a fleet (for a request for ``model``: of the boxes serving it): ``llm``
    when any box is in rotation, else ``image`` when any arbiter says ``image``, else
    ``swapping`` (arbiters swapping, silent or not answering well)."""
    serving = [b for b in boxes if b.serves(model)]
    if any(b.in_rotation(True) for b in serving):
        return "llm"
    if any(b.view.mode == "image" and b.view.arbiter_error is None for b in serving):
        return "image"
    return "swapping"


def known_model(boxes: Sequence[BoxState], model: str | None) -> bool:
    """True when some box of the fleet serves ``model`` (in rotation or not)."""
    return any(b.serves(model) for b in boxes)


def request_model(body: bytes) -> str | None:
    """The ``model`` of a JSON request body, None when it names none (or is not JSON)."""
    if not body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(doc, dict):
        model = doc.get("model")
        if isinstance(model, str):
            return model
    return None


def fleet_fields(boxes: Sequence[BoxState]) -> dict[str, Any]:
    """The top-level mode fields of a fleet's ``/proxy/state`` (``llm`` when any box serves)."""
    serving = [b.view.since for b in boxes if b.in_rotation(True)]
    answered = [b for b in boxes if b.view.arbiter_error is None and b.view.arbiter_seen]
    seen = [b.view.arbiter_seen for b in boxes if b.view.arbiter_seen is not None]
    errors = [f"{b.box.name}: {b.view.arbiter_error}" for b in boxes if b.view.arbiter_error]
    source = "arbiter" if len(answered) == len(boxes) else ("last-known" if answered else "default")
    return {
        "mode": fleet_mode(boxes),
        "mode_since": min((s for s in serving if s is not None), default=None),
        "mode_source": source,
        "arbiter_seen": max(seen, default=None),
        "arbiter_error": "; ".join(errors) or None,
    }


def box_state(b: BoxState, fleet: bool) -> dict[str, Any]:
    """One box's entry of ``/proxy/state``'s ``boxes``."""
    return {
        "name": b.box.name,
        "mode": b.view.mode,
        "mode_source": b.view.source,
        "mode_since": b.view.since,
        "in_rotation": b.in_rotation(fleet),
        "in_flight": b.in_flight,
        "error": b.error,
        "last_seen": b.view.arbiter_seen,
        "models": list(b.box.models),
        "weight": b.box.weight,
        "routed": b.routed,
        "last_request_started": b.last_request_started,
        "last_request_finished": b.last_request_finished,
    }


def merge_models(lists: Sequence[list[Any]]) -> list[Any]:
    """The boxes' ``/v1/models`` lists as one: each model once, as the first box lists it."""
    seen: set[str] = set()
    merged: list[Any] = []
    for entry in (e for data in lists for e in data):
        ident = entry.get("id") if isinstance(entry, dict) else None
        if isinstance(ident, str) and ident not in seen:
            seen.add(ident)
            merged.append(entry)
    return merged


def retry_box(boxes: Sequence[BoxState], model: str | None, current: BoxState) -> BoxState:
    """The box to try again after a wait: one in rotation, else one whose arbiter says
    ``llm`` though its vLLM refused (it may be starting), else the same."""
    box = pick(boxes, model, True)
    if box is not None:
        return box
    starting = [
        b
        for b in boxes
        if b.serves(model) and b.view.mode == "llm" and b.view.arbiter_error is None
    ]
    return min(starting, key=lambda b: b.in_flight / b.box.weight, default=current)
