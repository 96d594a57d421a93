"""Read timeouts for aiohttp servers: request head, request body and idle keep-alive.

aiohttp's server has no read timeouts of its own: a client that sends a request head a byte
at a time, or nothing at all, or a body that never completes, holds its connection (and the
handler waiting on the body) for as long as it likes. :func:`guarded_runner` returns an
:class:`aiohttp.web.AppRunner` with three bounds:

``header_timeout``
    A new connection that has not delivered a complete request head within this many
    seconds is closed (no answer: there is no request to answer). Enforced by a sweeper that
    looks at the server's connections every ``header_timeout / 10`` seconds (at most 0.5 s),
    so a connection lives at most one sweep interval longer than the bound.
``body_timeout``
    A request body must have arrived in full within this many seconds of its head (a body
    that stalls or trickles does not). Otherwise the handler's pending or next read of the
    body raises :class:`BodyTimeoutError`; a handler that does not answer it itself gets a
    408 from the guard, and the connection is closed after the answer. A handler that
    deliberately leaves a body unread for a while (the proxy holding a request while the
    card is lent) wraps that wait in :func:`body_timeout_paused`; the clock restarts when
    it ends.
``keepalive_timeout``
    A kept-alive connection idle this long after its last response is closed, also when
    the next request head is only partly there. This is aiohttp's own ``keepalive_timeout``
    (passed to the runner); its default (3630 s in aiohttp 3.14) is replaced by ours.

Why this shape (aiohttp 3.14 is pinned, in the lab too):

- aiohttp gives no hook at connection start: ``AppRunner`` always builds its own ``Server``,
  and ``Server.__call__`` builds a plain ``RequestHandler`` from private attributes, so a
  ``RequestHandler`` subclass would mean overriding private methods; wrapping
  ``Server.connection_made`` on the instance would be monkeypatching. The sweeper uses only
  public API: ``runner.server.connections`` and ``RequestHandler.force_close()`` (what
  aiohttp's own keep-alive timer calls), plus a middleware that marks a connection as having
  delivered a head.
- ``keepalive_timeout`` alone is not a header timeout: it is one number for both the idle
  bound and the head bound (and older aiohttp armed it only after a first response).
- A middleware cannot bound the head (it runs once the head is parsed), and it cannot wrap
  the handler's body reads in ``asyncio.wait_for`` (handlers call ``request.json()``,
  ``request.multipart()``, ``request.content.readany()``). So the body deadline is a timer
  that, on expiry, puts :class:`BodyTimeoutError` into the request's ``StreamReader``
  (its public ``set_exception``), which wakes whichever read is waiting or fails the next.
  The error is a ``TimeoutError`` so that aiohttp's lingering read after the answer ends
  quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

LOG = logging.getLogger("cardshare.serverguard")

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_KEEPALIVE_TIMEOUT = 75.0

_Conn = TypeVar("_Conn", bound=Hashable)


class BodyTimeoutError(TimeoutError):
    """A request body did not arrive in full within the body timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"request body not received within {seconds:g} s")
        self.seconds = seconds


@dataclass
class GuardStats:
    """How many connections and requests the guard has cut off."""

    #: Connections closed because no complete request head arrived in time.
    header_timeouts: int = 0
    #: Requests whose body did not arrive in time.
    body_timeouts: int = 0


# ------------------------------------------------------------------ pure decisions


def check_timeouts(header_timeout: float, body_timeout: float, keepalive_timeout: float) -> None:
    """Refuse a timeout that is not a finite number of seconds above zero."""
    for name, value in (
        ("header_timeout", header_timeout),
        ("body_timeout", body_timeout),
        ("keepalive_timeout", keepalive_timeout),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number of seconds, got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def sweep_interval(header_timeout: float) -> float:
    """How often connections are checked: a tenth of the bound, between 10 ms and 0.5 s."""
    return min(0.5, max(0.01, header_timeout / 10))


def sweep_heads(
    first_seen: Mapping[_Conn, float | None],
    live: Iterable[_Conn],
    now: float,
    header_timeout: float,
) -> tuple[dict[_Conn, float | None], list[_Conn]]:
    """One sweep: the new bookkeeping and the connections to close.

    ``first_seen`` maps a connection to when a sweep first saw it, or to None once it has
    delivered a request head. ``live`` are the open connections; connections that are gone
    are forgotten. A connection seen for the first time is dated ``now``.
    """
    kept: dict[_Conn, float | None] = {}
    overdue: list[_Conn] = []
    for conn in live:
        seen = first_seen.get(conn, now)
        if seen is not None and now - seen >= header_timeout:
            overdue.append(conn)
            continue
        kept[conn] = seen
    return kept, overdue


# ------------------------------------------------------------------ the body clock


class _BodyClock:
    """The deadline of one request's body; pausable while the handler leaves it unread."""

    def __init__(self, request: web.BaseRequest, timeout: float, stats: GuardStats) -> None:
        self._stream = request.content
        self._timeout = timeout
        self._stats = stats
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self._paused = 0
        self._stopped = False
        self.fired = False

    def start(self) -> None:
        """(Re)start the full timeout, unless the body is already complete."""
        if self._stopped or self.fired or self._paused or self._stream.is_eof():
            return
        self._cancel()
        self._handle = self._loop.call_later(self._timeout, self._expire)

    def pause(self) -> None:
        self._paused += 1
        self._cancel()

    def resume(self) -> None:
        self._paused -= 1
        self.start()

    def stop(self) -> None:
        self._stopped = True
        self._cancel()

    def _cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        if self._stopped or self._stream.is_eof():
            return
        self.fired = True
        self._stats.body_timeouts += 1
        self._stream.set_exception(BodyTimeoutError(self._timeout))


_CLOCK_KEY = web.RequestKey("cardshare_serverguard_body_clock", _BodyClock)


@contextlib.contextmanager
def body_timeout_paused(request: web.BaseRequest) -> Iterator[None]:
    """Stop the body clock of ``request`` while the handler deliberately does not read.

    While paused, aiohttp reads at most its buffer window of the body and then stops reading
    the socket, so the client is held back by TCP rather than being slow. When the block
    ends the body gets a fresh ``body_timeout``. A no-op on a server without the guard.
    """
    clock: _BodyClock | None = request.get(_CLOCK_KEY)
    if clock is None:
        yield
        return
    clock.pause()
    try:
        yield
    finally:
        clock.resume()


def _timeout_response(exc: BodyTimeoutError) -> web.StreamResponse:
    return web.json_response(
        {"error": f"{exc}; send the request body faster or raise the server's body timeout"},
        status=408,
    )


# ------------------------------------------------------------------ the guard


class _Guard:
    """The middleware (head delivered, body clock) and the sweeper (head timeout)."""

    def __init__(self, header_timeout: float, body_timeout: float, stats: GuardStats) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.stats = stats
        self._first_seen: dict[RequestHandler, float | None] = {}

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # the head is complete: the header timeout no longer applies to this connection
        self._first_seen[request.protocol] = None
        if not request.body_exists or request.content.is_eof():
            return await handler(request)
        clock = _BodyClock(request, self.body_timeout, self.stats)
        request[_CLOCK_KEY] = clock
        clock.start()
        try:
            resp = await handler(request)
        except BodyTimeoutError as exc:
            if not clock.fired:
                raise
            resp = _timeout_response(exc)
        finally:
            clock.stop()
        if clock.fired:
            # the rest of the body may still be on its way: never reuse this connection
            resp.force_close()
        return resp

    def sweep(self, connections: Iterable[RequestHandler], now: float) -> int:
        """Close connections whose first head is overdue; returns how many."""
        live = [conn for conn in connections if conn.transport is not None]
        self._first_seen, overdue = sweep_heads(self._first_seen, live, now, self.header_timeout)
        for conn in overdue:
            conn.force_close()
        self.stats.header_timeouts += len(overdue)
        if overdue:
            LOG.debug("closed %d connections without a request head", len(overdue))
        return len(overdue)

    async def sweep_forever(self, runner: web.BaseRunner) -> None:
        """Sweep the connections of ``runner`` until cancelled."""
        loop = asyncio.get_running_loop()
        interval = sweep_interval(self.header_timeout)
        while True:
            await asyncio.sleep(interval)
            server = runner.server
            if server is None:
                continue
            try:
                self.sweep(server.connections, loop.time())
            except Exception:  # one bad sweep must not end the guard
                LOG.exception("header-timeout sweep failed")


class GuardedAppRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` that also runs the header-timeout sweeper."""

    def __init__(self, app: web.Application, guard: _Guard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard
        self._sweeper: asyncio.Future[None] | None = None

    @property
    def stats(self) -> GuardStats:
        """Connections and requests cut off so far."""
        return self._guard.stats

    async def setup(self) -> None:
        await super().setup()
        self._sweeper = asyncio.ensure_future(self._guard.sweep_forever(self))

    async def cleanup(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await super().cleanup()


def guarded_runner(
    app: web.Application,
    *,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    stats: GuardStats | None = None,
    **runner_kwargs: Any,
) -> GuardedAppRunner:
    """An AppRunner for ``app`` with header, body and keep-alive read timeouts (seconds).

    Call it instead of ``web.AppRunner(app, ...)``, before ``setup()``: it adds a middleware
    to ``app`` (the outermost one). ``runner_kwargs`` go to ``web.AppRunner`` as before
    (``access_log``, ``handler_cancellation``, ``read_bufsize``...). ``stats`` counts what was
    cut off (a fresh :class:`GuardStats` when not given; also ``runner.stats``).
    """
    check_timeouts(header_timeout, body_timeout, keepalive_timeout)
    if app.middlewares.frozen:
        raise RuntimeError("guarded_runner() needs an application that has not started yet")
    guard = _Guard(
        float(header_timeout), float(body_timeout), stats if stats is not None else GuardStats()
    )
    app.middlewares.insert(0, guard.middleware)
    return GuardedAppRunner(app, guard, keepalive_timeout=float(keepalive_timeout), **runner_kwargs)
