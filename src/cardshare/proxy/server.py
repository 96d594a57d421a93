"""The aiohttp edge of the patient proxy: handlers, forwarding, the mode poller.

Decisions come from :mod:`cardshare.proxy.rules`; this module only waits, reads and writes.
Written against the pinned aiohttp (3.14; pyproject's ``services`` extra).

A proxied request is admitted (forward, hold or refuse) as soon as its head is in, before
its body is read: a held request's body stays unread until the request is released, so
what held requests keep in memory is aiohttp's read window per connection
(:data:`HELD_BODY_WINDOW_BYTES`), not their bodies. Slow clients are cut off by
:mod:`cardshare.serverguard` (header, body and keep-alive read timeouts).

With ``boxes`` (a fleet, :mod:`cardshare.proxy.fleet`) a request is held on its head while no
box is in rotation; once a box is, its body is read for its ``model``, and it goes to a box
serving that model, or is held again (its body then in memory, counted in
``held_body_bytes``) until one comes back. A model no box lists is answered 404 at once.
``GET /v1/models`` merges the lists of the boxes in rotation, so an agent sees every model it
can ask for now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.metrics_core import Metric

from cardshare import exposition, serverguard
from cardshare.proxy import fleetpage, rules, upstream
from cardshare.proxy.config import ProxyConfig
from cardshare.proxy.fleet import (
    BoxState,
    box_state,
    fleet_fields,
    fleet_mode,
    known_model,
    merge_models,
    pick,
    request_model,
    retry_box,
)
from cardshare.proxy.holdqueue import HoldQueue
from cardshare.proxy.keys import Key, KeyRing, bearer_token, lookup, read_secret
from cardshare.proxy.metrics import BoxGauges, Counters, Gauges, families
from cardshare.proxy.mode import (
    ModePayloadError,
    ModeView,
    on_arbiter_answer,
    on_arbiter_down,
    parse_mode_payload,
)

LOG = logging.getLogger("cardshare.proxy")

DEFAULT_BACKOFF = rules.Backoff()
#: The OpenAI ``type`` of the proxy's own error answers by status (others: invalid request).
_ERROR_TYPES = {503: "service_unavailable", 429: "requests"}
#: Bodies of known length up to this size are relayed in one write, with the headers.
SMALL_BODY_BYTES = 256 * 1024
#: Methods sent without a body when the client sent none.
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE"})
#: aiohttp's read buffer for client connections: it stops reading a request body from the
#: socket once twice this much is buffered and unread (the rest waits in the client's TCP).
READ_BUFSIZE = 64 * 1024
#: Most of a held request's body the proxy can have in memory: aiohttp's high-water mark
#: (2 x READ_BUFSIZE) plus one socket read (asyncio reads at most 256 KiB at a time).
HELD_BODY_WINDOW_BYTES = 2 * READ_BUFSIZE + 256 * 1024


def _retryable(exc: BaseException) -> bool:
    """True for upstream failures where nothing reached vLLM's HTTP layer yet.

    A refused or timed-out connect (vLLM is starting, its port refuses until the model is
    loaded), and a connection closed before any answer (Docker's userland proxy accepts and
    then drops connections to a container that does not listen yet).
    """
    return isinstance(exc, upstream.ConnectFailed | upstream.ClosedBeforeAnswer)


def _movable(exc: BaseException) -> bool:
    """True for upstream failures before any answer that move a fleet's request to another box.

    Beyond :func:`_retryable`: a connection reset while vLLM ran the request (it died under
    it). Nothing of an answer reached the client (the head had not come), so the other box's
    answer is the only one it gets.
    """
    return _retryable(exc) or isinstance(exc, upstream.ResetBeforeAnswer)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _client_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Route:
    """The box a request is on (it may move to another before anything reached the client)."""

    __slots__ = ("box",)

    def __init__(self, box: BoxState) -> None:
        self.box = box

    def move(self, box: BoxState) -> None:
        self.box.in_flight -= 1
        box.in_flight += 1
        box.routed += 1
        box.last_request_started = self.box.last_request_started
        self.box = box


def runner_kwargs() -> dict[str, Any]:
    """AppRunner options: no access log; a small read buffer (it bounds what a held request
    buffers); cancel handlers of vanished clients."""
    return {"access_log": None, "read_bufsize": READ_BUFSIZE, "handler_cancellation": True}


class Proxy:
    """The proxy's state and handlers; :meth:`make_app` wires them into an application."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        backoff: rules.Backoff = DEFAULT_BACKOFF,
        disconnect_check_seconds: float = 0.5,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall
        self.backoff = backoff
        self.disconnect_check_seconds = disconnect_check_seconds
        #: A fleet (``boxes`` set) or the single box of ``upstream_url``.
        self.is_fleet = bool(config.boxes)
        self.boxes = [BoxState(box, n) for n, box in enumerate(config.fleet())]
        self.queue = HoldQueue()
        self.counters = Counters()
        self.guard_stats = serverguard.GuardStats()
        self.in_flight = 0
        self.connecting = 0
        self.stopping = False
        self.last_request_started: float | None = None
        self.last_request_finished: float | None = None
        #: Connections to the upstreams (the agents' requests); the arbiters are polled with
        #: aiohttp's client.
        self.pool = upstream.Pool(config.pool_limit, connect_timeout=10.0)
        self._arbiter_session: aiohttp.ClientSession | None = None
        #: The agents' keys (None: every request is let in, loopback only); raises
        #: :class:`cardshare.proxy.keys.KeysFileError` when the file does not load.
        self.keyring: KeyRing | None = None
        if config.keys_file:
            self.keyring = KeyRing(Path(config.keys_file))
            self.keyring.load()
        # each upstream's own ``Authorization``, sent instead of any agent's
        for state in self.boxes:
            if state.box.api_key_file:
                state.upstream_auth = "Bearer " + read_secret(state.box.api_key_file)
        #: Requests held or in flight per key name.
        self.key_load: dict[str, int] = {}
        #: The proxy's own registry: one collector reading :meth:`metric_families` per scrape.
        self.registry = exposition.registry_of(self.metric_families)

    # ----------------------------------------------------------------- mode

    @property
    def view(self) -> ModeView:
        """The mode as believed for the first (without ``boxes`` the only) box."""
        return self.boxes[0].view

    @view.setter
    def view(self, view: ModeView) -> None:
        self.boxes[0].view = view

    def mode(self, model: str | None = None) -> str:
        """The mode a request for ``model`` meets: the box's, or the fleet's
        (:func:`cardshare.proxy.fleet.fleet_mode`)."""
        if not self.is_fleet:
            return self.view.mode
        return fleet_mode(self.boxes, model)

    def apply_view(self, view: ModeView, state: BoxState | None = None) -> None:
        """Adopt a new belief about a box's mode (the first box by default).

        One box: entering ``llm`` releases every held request. A fleet: a box in rotation
        releases the held requests it can serve.
        """
        state = self.boxes[0] if state is None else state
        if (view.mode, view.source) != (state.view.mode, state.view.source):
            if self.is_fleet:
                LOG.info("box %s: mode %s (source %s)", state.box.name, view.mode, view.source)
            else:
                LOG.info("mode %s (source %s)", view.mode, view.source)
        state.view = view
        if view.source == "arbiter" and state.upstream_error is not None:
            LOG.info("box %s: back in rotation after its arbiter answered", state.box.name)
            state.upstream_error = None
        if not len(self.queue):
            return
        if not self.is_fleet:
            if view.mode == "llm":
                LOG.info("releasing %d held requests", self.queue.release_all())
        elif state.in_rotation(True):
            released = self.queue.release_if(state.serves)
            if released:
                LOG.info("box %s: releasing %d held requests", state.box.name, released)

    async def _fetch_mode(
        self, session: aiohttp.ClientSession, state: BoxState
    ) -> tuple[str, float | None]:
        base = state.box.arbiter_url.rstrip("/")
        url = base + ("/v1/status" if state.use_status else "/v1/mode")
        async with session.get(url) as resp:
            if resp.status == 404 and not state.use_status:
                state.use_status = True
                return await self._fetch_mode(session, state)
            if resp.status != 200:
                raise ModePayloadError(f"HTTP {resp.status} from {url}")
            try:
                doc = await resp.json(content_type=None)
            except ValueError as exc:
                raise ModePayloadError(f"not JSON from {url}: {exc}") from exc
        return parse_mode_payload(doc)

    async def poll_mode_once(self) -> None:
        """Ask every box's arbiter for its mode once and adopt the answers (or fallbacks)."""
        await asyncio.gather(*(self.poll_box_once(state) for state in self.boxes))

    async def poll_box_once(self, state: BoxState) -> None:
        """Ask one box's arbiter for its mode and adopt the answer (or the fallback)."""
        session = self._arbiter_session
        if session is None:
            raise RuntimeError("the proxy application is not running")
        try:
            mode, since = await self._fetch_mode(session, state)
        except (TimeoutError, aiohttp.ClientError, ModePayloadError) as exc:
            self.counters.arbiter_poll_failures += 1
            if state.view.arbiter_error is None:
                if self.is_fleet:
                    LOG.warning(
                        "box %s: arbiter unreachable, out of rotation: %s",
                        state.box.name,
                        _describe(exc),
                    )
                else:
                    LOG.warning("arbiter unreachable: %s", _describe(exc))
            # a fleet takes the box out of rotation (BoxState.in_rotation) whatever it keeps
            view = on_arbiter_down(
                state.view, _describe(exc), self.config.trust_mode_when_arbiter_down
            )
        else:
            view = on_arbiter_answer(state.view, mode, since, self.wall())
        self.apply_view(view, state)

    async def _poll_forever(self, state: BoxState) -> None:
        while True:
            await self.poll_box_once(state)
            await asyncio.sleep(self.config.mode_poll_seconds)

    async def _watch_keys(self, keyring: KeyRing) -> None:
        while True:
            await asyncio.sleep(self.config.keys_reload_seconds)
            keyring.maybe_reload()

    # ----------------------------------------------------------------- lifecycle

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        cfg = self.config
        poll_timeout = max(1.0, min(5.0, 2 * cfg.mode_poll_seconds))
        self._arbiter_session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=poll_timeout)
        )
        tasks = [asyncio.ensure_future(self._poll_forever(state)) for state in self.boxes]
        if self.keyring is not None:
            tasks.append(asyncio.ensure_future(self._watch_keys(self.keyring)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.pool.close()
            await self._arbiter_session.close()

    async def _on_shutdown(self, app: web.Application) -> None:
        """Stopping: held requests get their 503 now instead of holding up the shutdown."""
        self.stopping = True
        self.queue.release_all()

    def make_app(self) -> web.Application:
        """The aiohttp application: the proxy's own endpoints and the forwarded paths."""
        app = web.Application()
        app.cleanup_ctx.append(self._lifecycle)
        app.on_shutdown.append(self._on_shutdown)
        app.router.add_get("/proxy/health", self.handle_health)
        app.router.add_get("/proxy/state", self.handle_state)
        app.router.add_get("/proxy/fleet", self.handle_fleet)
        app.router.add_get("/metrics", exposition.handler(self.registry))
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def make_runner(self) -> serverguard.GuardedAppRunner:
        """The application in a runner with the client read timeouts of the configuration."""
        cfg = self.config
        return serverguard.guarded_runner(
            self.make_app(),
            header_timeout=cfg.header_timeout_seconds,
            body_timeout=cfg.body_timeout_seconds,
            keepalive_timeout=cfg.keepalive_timeout_seconds,
            stats=self.guard_stats,
            **runner_kwargs(),
        )

    # ----------------------------------------------------------------- own endpoints

    def state(self) -> dict[str, Any]:
        """What ``/proxy/state`` reports (the arbiter reads it).

        A fleet's adds ``boxes`` (each box's name, mode, mode_source, in_rotation, in_flight,
        error, last_seen, and its models, weight, requests routed) and keeps every field
        of the one box's: ``mode`` is ``llm`` when any box is in rotation
        (:func:`cardshare.proxy.fleet.fleet_mode`), ``mode_since`` the earliest ``since`` of
        the boxes in rotation, ``mode_source`` ``arbiter`` when every arbiter answered its
        last poll (``last-known`` when some did, ``default`` when none), ``arbiter_seen`` the
        latest answer of any, ``arbiter_error`` the failing boxes' errors (``name: error``, ``;``
        between them).
        """
        oldest = self.queue.oldest_age(self.clock())
        if self.is_fleet:
            return {
                **self._state_fields(oldest),
                **fleet_fields(self.boxes),
                "boxes": [box_state(b, self.is_fleet) for b in self.boxes],
            }
        return {
            "in_flight": self.in_flight,
            "connecting": self.connecting,
            "held": len(self.queue),
            "held_body_bytes": self.queue.buffered_bytes(),
            "oldest_held_seconds": round(oldest, 3) if oldest is not None else None,
            "last_request_started": self.last_request_started,
            "last_request_finished": self.last_request_finished,
            "mode": self.view.mode,
            "mode_since": self.view.since,
            "mode_source": self.view.source,
            "arbiter_seen": self.view.arbiter_seen,
            "arbiter_error": self.view.arbiter_error,
        }

    def _state_fields(self, oldest: float | None) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "connecting": self.connecting,
            "held": len(self.queue),
            "held_body_bytes": self.queue.buffered_bytes(),
            "oldest_held_seconds": round(oldest, 3) if oldest is not None else None,
            "last_request_started": self.last_request_started,
            "last_request_finished": self.last_request_finished,
        }

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def handle_fleet(self, request: web.Request) -> web.Response:
        state = self.state()
        boxes = state.get("boxes") or [box_state(b, self.is_fleet) for b in self.boxes]
        return web.Response(
            text=fleetpage.render(state, boxes, self.wall()), content_type="text/html"
        )

    def metric_families(self) -> list[Metric]:
        """What ``/metrics`` reports: the counters and the live state at scrape time."""
        gauges = Gauges(
            held=len(self.queue),
            in_flight=self.in_flight,
            oldest_held_seconds=self.queue.oldest_age(self.clock()),
            mode=self.view.mode,
            mode_source=self.view.source,
            held_body_bytes=self.queue.buffered_bytes(),
            header_timeouts=self.guard_stats.header_timeouts,
            body_timeouts=self.guard_stats.body_timeouts,
            keys_file_ok=None if self.keyring is None else int(self.keyring.file_ok),
            keys=None if self.keyring is None else len(self.keyring.keys),
            boxes=tuple(
                BoxGauges(
                    name=b.box.name,
                    mode=b.view.mode,
                    in_rotation=b.in_rotation(True),
                    in_flight=b.in_flight,
                    routed=b.routed,
                )
                for b in self.boxes
            )
            if self.is_fleet
            else (),
        )
        return families(self.counters, gauges)

    # ----------------------------------------------------------------- proxied paths

    def _error(self, status: int, message: str, code: str, outcome: str) -> web.Response:
        self.counters.count(outcome)
        retry = status in (429, 503)
        headers = {"Retry-After": str(self.config.retry_after_seconds)} if retry else {}
        err_type = _ERROR_TYPES.get(status, "invalid_request_error")
        return web.Response(
            status=status,
            body=rules.error_body(message, code, err_type),
            content_type="application/json",
            headers=headers,
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every path that is not the proxy's own."""
        if not rules.is_proxied_path(request.path, self.config.proxied_path_prefixes):
            return web.Response(
                status=404,
                body=rules.error_body(
                    f"{request.path} is not proxied (only "
                    f"{', '.join(self.config.proxied_path_prefixes)})",
                    "not_found",
                    "invalid_request_error",
                ),
                content_type="application/json",
            )
        key: Key | None = None
        if self.keyring is not None:
            key = lookup(self.keyring.keys, bearer_token(request.headers.get("Authorization")))
            if key is None:
                return self._error(
                    401, rules.UNAUTHORIZED_MESSAGE, "invalid_api_key", "rejected_unauthorized"
                )
            bound = key.max_requests or self.config.key_max_requests
            load = self.key_load.get(key.name, 0)
            if load >= bound:
                msg = rules.key_limit_message(key.name, bound, self.config.retry_after_seconds)
                return self._error(429, msg, "rate_limit_exceeded", "rejected_key_limit")
            self.key_load[key.name] = load + 1
        arrived = self.clock()
        self.last_request_started = self.wall()
        try:
            return await self._proxied(request, arrived)
        finally:
            self.last_request_finished = self.wall()
            if key is not None:
                left = self.key_load[key.name] - 1
                if left:
                    self.key_load[key.name] = left
                else:
                    del self.key_load[key.name]

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The whole request body, or None when it exceeds ``max_body_bytes``.

        Raises :class:`serverguard.BodyTimeoutError` when it does not arrive in time.
        """
        limit = self.config.max_body_bytes
        if not request.body_exists:
            return b""
        body = bytearray()
        while True:
            chunk = await request.content.readany()
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > limit:
                return None

    def _too_large(self) -> web.Response:
        limit = self.config.max_body_bytes
        resp = self._error(413, rules.too_large_message(limit), "too_large", "rejected_too_large")
        resp.force_close()
        return resp

    async def _proxied(self, request: web.Request, arrived: float) -> web.StreamResponse:
        """Admit on the head alone; read the body only once the request may go upstream."""
        cfg = self.config
        length = request.content_length
        if request.body_exists and length is not None and length > cfg.max_body_bytes:
            return self._too_large()
        mode = self.mode()
        action = rules.admit(mode, len(self.queue), cfg.hold_max_requests)
        if action is rules.Action.REJECT_COUNT:
            msg = rules.count_message(mode, cfg.hold_max_requests, cfg.retry_after_seconds)
            return self._error(503, msg, "hold_queue_full", "rejected_count")
        if action is rules.Action.HOLD:
            # the body stays unread (and its clock stopped) while held
            with serverguard.body_timeout_paused(request):
                refused = await self._hold(request, arrived)
            if refused is not None:
                return refused
        try:
            body = await self._read_body(request)
        except serverguard.BodyTimeoutError:
            msg = rules.body_timeout_message(cfg.body_timeout_seconds)
            resp = self._error(408, msg, "request_timeout", "rejected_body_timeout")
            resp.force_close()
            return resp
        if body is None:
            return self._too_large()
        if not self.is_fleet:
            return await self._forward(request, body, arrived, self.boxes[0], None)
        model = request_model(body)
        if model is None and request.method == "GET" and request.path == "/v1/models":
            merged = await self._models_of_fleet(request)
            if merged is not None:
                return merged
        if not known_model(self.boxes, model):
            served = sorted({m for b in self.boxes for m in b.box.models})
            msg = rules.unknown_model_message(str(model), served)
            self.counters.unknown_model += 1
            return web.Response(
                status=404,
                body=rules.error_body(msg, "model_not_found", "invalid_request_error"),
                content_type="application/json",
            )
        while (box := pick(self.boxes, model, True)) is None:
            # no box serving this model is in rotation: hold (the body is read by now)
            mode = self.mode(model)
            if rules.admit(mode, len(self.queue), cfg.hold_max_requests) is not rules.Action.HOLD:
                msg = rules.count_message(mode, cfg.hold_max_requests, cfg.retry_after_seconds)
                return self._error(503, msg, "hold_queue_full", "rejected_count")
            refused = await self._hold(request, arrived, model, len(body), self.clock())
            if refused is not None:
                return refused
        return await self._forward(request, body, arrived, box, model)

    async def _hold(
        self,
        request: web.Request,
        arrived: float,
        model: str | None = None,
        body_bytes: int | None = None,
        again: float | None = None,
    ) -> web.StreamResponse | None:
        """Wait for ``llm``; None once released, else the answer to give (or client gone).

        A client that goes away is noticed while aiohttp still reads its connection: always
        for a body of up to 2 x :data:`READ_BUFSIZE` (128 KiB); for a larger one aiohttp may
        have stopped reading the socket, and then the departure shows only when the request
        leaves the queue (released, or at ``hold_max_seconds``).

        A fleet's request released and held again for its model (``model``) has its body read
        (``body_bytes``) and its second hold's start (``again``), from which that hold's time
        is counted in ``hold_seconds``.
        """
        cfg = self.config
        stream = request.content
        buffered: Callable[[], int] | None = None
        if body_bytes is not None:
            size = body_bytes

            def buffered_body() -> int:  # read already, for its model
                return size

            buffered = buffered_body
        elif request.body_exists:

            def buffered_stream() -> int:
                # nothing of a held body is read by the proxy: what aiohttp received is buffered
                return stream.total_bytes

            buffered = buffered_stream
        held = self.queue.add(arrived, buffered=buffered, model=model)
        try:
            while True:
                waited = self.clock() - arrived
                if held.future.done():
                    if not self.stopping:
                        return None
                    msg = rules.stopping_message(cfg.retry_after_seconds)
                    return self._error(503, msg, "proxy_stopping", "rejected_stopping")
                if rules.hold_expired(waited, cfg.hold_max_seconds):
                    msg = rules.time_message(
                        self.mode(model), cfg.hold_max_seconds, cfg.retry_after_seconds
                    )
                    return self._error(503, msg, "hold_timeout", "rejected_time")
                if _client_gone(request):
                    self.counters.count("client_gone")
                    return web.Response(status=499)
                remaining = cfg.hold_max_seconds - waited
                await asyncio.wait(
                    {held.future}, timeout=min(remaining, self.disconnect_check_seconds)
                )
        except asyncio.CancelledError:
            self.counters.count("client_gone")
            raise
        finally:
            self.queue.remove(held)
            # a fleet's request held again for its model counts each hold's own time
            self.counters.hold_seconds.observe(self.clock() - (arrived if again is None else again))

    async def _models_of_fleet(self, request: web.Request) -> web.Response | None:
        """``GET /v1/models`` of a fleet: the lists of every box in rotation, merged (a model
        on two boxes once, as the first lists it); None when fewer than two boxes answer (the
        request then goes to one box as any other)."""
        boxes = [b for b in self.boxes if b.in_rotation(True)]
        if len(boxes) < 2:
            return None

        async def one(box: BoxState) -> list[Any] | None:
            headers = [("Authorization", box.upstream_auth)] if box.upstream_auth else []
            try:
                async with asyncio.timeout(10):
                    resp = await self.pool.request(
                        box.origin, "GET", box.path_prefix + "/v1/models", headers, None
                    )
                    try:
                        raw = await resp.read()
                    finally:
                        resp.close()
                doc = json.loads(raw) if resp.status == 200 else None
            except (TimeoutError, upstream.UpstreamError, ValueError):
                return None
            data = doc.get("data") if isinstance(doc, dict) else None
            return data if isinstance(data, list) else None

        lists = [d for d in await asyncio.gather(*(one(b) for b in boxes)) if d is not None]
        if len(lists) < 2:
            return None
        self.counters.count("forwarded")
        return web.json_response({"object": "list", "data": merge_models(lists)})

    async def _connect(
        self, request: web.Request, body: bytes, arrived: float, route: _Route, model: str | None
    ) -> upstream.Response | web.StreamResponse:
        """The upstream's response, retrying refused connections; or the 503 to answer.

        A fleet retries a refused connection, or one reset before any answer, on another box in
        rotation at once (nothing of the request reached a client); with none, it waits and
        retries as one box does.
        """
        cfg = self.config
        started = self.clock()
        deadline = rules.connect_deadline(
            arrived, started, cfg.hold_max_seconds, cfg.connect_retry_seconds
        )
        base_headers = rules.request_headers(list(request.headers.items()))
        data = body if body or request.method not in _BODYLESS else None
        attempt = 0
        tried: list[BoxState] = []
        while True:
            box = route.box
            headers = base_headers
            if self.keyring is not None or box.upstream_auth is not None:
                # the agent's key stays here; the upstream gets the proxy's own (or none)
                headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
                if box.upstream_auth is not None:
                    headers.append(("Authorization", box.upstream_auth))
            try:
                return await self.pool.request(
                    box.origin, request.method, box.path_prefix + request.raw_path, headers, data
                )
            except upstream.UpstreamError as exc:
                if self.is_fleet and _movable(exc):
                    if box.upstream_error is None:
                        LOG.warning(
                            "box %s: vLLM refused, out of rotation until its arbiter answers: %s",
                            box.box.name,
                            _describe(exc),
                        )
                    box.upstream_error = _describe(exc)
                    tried.append(box)
                    other = pick(self.boxes, model, True, exclude=tried)
                    if other is not None:
                        self.counters.box_failovers += 1
                        route.move(other)
                        continue
                delay = rules.retry_delay(attempt, self.clock(), deadline, self.backoff)
                if not _retryable(exc) or delay is None:
                    LOG.warning(
                        "upstream %s %s%s failed: %s",
                        request.method,
                        box.box.upstream_url.rstrip("/"),
                        request.raw_path,
                        _describe(exc),
                    )
                    msg = rules.upstream_message(
                        self.clock() - started, _describe(exc), cfg.retry_after_seconds
                    )
                    return self._error(503, msg, "upstream_unavailable", "upstream_error")
                if _client_gone(request):
                    self.counters.count("client_gone")
                    return web.Response(status=499)
                self.counters.connect_retries += 1
                await asyncio.sleep(delay)
                attempt += 1
                if self.is_fleet:
                    tried.clear()
                    other = retry_box(self.boxes, model, box)
                    if other is not box:
                        route.move(other)

    async def _forward(
        self, request: web.Request, body: bytes, arrived: float, box: BoxState, model: str | None
    ) -> web.StreamResponse:
        self.in_flight += 1
        self.connecting += 1
        box.in_flight += 1
        box.routed += 1
        box.last_request_started = self.wall()
        route = _Route(box)
        try:
            try:
                answer = await self._connect(request, body, arrived, route, model)
            finally:
                self.connecting -= 1
            if isinstance(answer, web.StreamResponse):
                return answer
            try:
                return await self._relay(request, answer)
            finally:
                answer.close()
        finally:
            self.in_flight -= 1
            route.box.in_flight -= 1
            route.box.last_request_finished = self.wall()

    async def _relay(self, request: web.Request, answer: upstream.Response) -> web.StreamResponse:
        """Stream the upstream's response to the client as it comes.

        A small body of announced length (an ordinary JSON answer) is passed in one write with
        the headers; anything else (SSE, chunked, large) is relayed chunk by chunk.
        """
        headers = rules.response_headers(list(answer.headers))
        length = answer.content_length
        if (
            length is not None
            and length <= SMALL_BODY_BYTES
            and request.method != "HEAD"
            and answer.status not in (204, 304)
        ):
            try:
                body = await answer.read()
            except upstream.UpstreamError as exc:
                # nothing has reached the client yet: it can still get a clear answer
                LOG.warning("upstream broke off its answer: %s", _describe(exc))
                msg = rules.broken_message(_describe(exc), self.config.retry_after_seconds)
                return self._error(503, msg, "upstream_broken", "upstream_error")
            self.counters.count("forwarded")
            # aiohttp sets Content-Length from the body itself
            without_length = CIMultiDict(
                (k, v) for k, v in headers if k.lower() != "content-length"
            )
            return web.Response(
                status=answer.status, reason=answer.reason, headers=without_length, body=body
            )
        self.counters.count("forwarded")
        resp = web.StreamResponse(status=answer.status, reason=answer.reason)
        resp.headers.extend(headers)
        await resp.prepare(request)
        while True:
            try:
                chunk = await answer.readany()
            except upstream.UpstreamError as exc:
                # The response has started: the only honest signal left is a cut connection.
                LOG.warning("upstream broke mid-response: %s", _describe(exc))
                if request.transport is not None:
                    request.transport.close()
                return resp
            if not chunk:
                break
            try:
                await resp.write(chunk)
            except (ConnectionError, aiohttp.ClientError):
                return resp  # the client went away; closing the upstream stops the generation

        await resp.write_eof()
        return resp
