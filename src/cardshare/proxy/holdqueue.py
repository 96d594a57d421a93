"""The FIFO of held requests.

Each held request owns a future that is resolved when the mode becomes ``llm``. Requests
leave the queue when released (all at once, oldest first), when their time bound passes or
when their client goes away; removal is O(1) so a disconnecting client never leaks an entry.
Each may report how many bytes of its body are buffered while it waits, and the model it asks
for (a fleet's boxes serve different models: a box that comes back releases only the requests
it can serve).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Held:
    """One held request: when it arrived (monotonic) and the future that releases it."""

    arrived: float
    future: asyncio.Future[None]
    ticket: int = field(default=0)
    #: Bytes of its body buffered while it waits (unread by the proxy), if it can tell.
    buffered: Callable[[], int] | None = None
    #: The model it asks for: None when it names none or its body is not read yet.
    model: str | None = None


class HoldQueue:
    """Held requests in arrival order."""

    def __init__(self) -> None:
        self._held: dict[int, Held] = {}
        self._tickets = itertools.count(1)

    def __len__(self) -> int:
        return len(self._held)

    def add(
        self,
        arrived: float,
        buffered: Callable[[], int] | None = None,
        model: str | None = None,
    ) -> Held:
        """Hold a request that arrived at ``arrived`` (monotonic seconds).

        ``buffered`` tells how many bytes of its body are buffered at any moment.
        """
        future = asyncio.get_running_loop().create_future()
        held = Held(arrived, future, next(self._tickets), buffered, model)
        self._held[held.ticket] = held
        return held

    def remove(self, held: Held) -> bool:
        """Forget ``held``; True if it was still queued."""
        return self._held.pop(held.ticket, None) is not None

    def release_all(self) -> int:
        """Release every held request, oldest first; returns how many were released."""
        released = list(self._held.values())
        self._held.clear()
        for held in released:
            if not held.future.done():
                held.future.set_result(None)
        return len(released)

    def release_if(self, can_serve: Callable[[str | None], bool]) -> int:
        """Release the held requests whose model ``can_serve``, oldest first; how many."""
        released = [h for h in self._held.values() if can_serve(h.model)]
        for held in released:
            del self._held[held.ticket]
            if not held.future.done():
                held.future.set_result(None)
        return len(released)

    def buffered_bytes(self) -> int:
        """Body bytes buffered for all held requests together."""
        return sum(h.buffered() for h in self._held.values() if h.buffered is not None)

    def oldest_age(self, now: float) -> float | None:
        """Seconds the oldest held request has waited, None when nothing is held."""
        for held in self._held.values():
            return max(0.0, now - held.arrived)
        return None
