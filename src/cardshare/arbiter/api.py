"""The arbiter's HTTP API (aiohttp): jobs, status, mode, metrics.

Mutating calls, and everything about a job (its details, its outputs), need
``Authorization: Bearer <token>``; request bodies are bounded. ``/v1/mode``, ``/v1/health``,
``/metrics`` and ``/v1/status`` (without job ids unless the token is given) are open.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from importlib import resources
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.metrics_core import Metric

from cardshare import exposition
from cardshare.arbiter.cardview import CardView
from cardshare.arbiter.common import ALERT_NAMES, Alert, is_storage_error
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.history import HistoryView
from cardshare.arbiter.jobs import check_input_name, decode_inputs, image_type, storable_text
from cardshare.arbiter.metrics import families
from cardshare.arbiter.plans import tenants
from cardshare.arbiter.resume import SAVER_EXTENSIONS, save_nodes, unfindable_savers
from cardshare.arbiter.statuspage import render_main, render_page
from cardshare.arbiter.store import Job, JobState, SwapRecord, job_dir

ENGINE_KEY = web.AppKey("cardshare_engine", Engine)
TOKEN_KEY = web.AppKey("cardshare_token", str)

# The status page and its assets: same origin only, nothing inline but the SVG drawn here.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATIC = {"status.css": "text/css", "status.js": "text/javascript"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


# a workflow nested deeper than this is refused (ComfyUI graphs are a few levels deep)
MAX_WORKFLOW_DEPTH = 32
MAX_HOLD_SECONDS = 3600


def _authorized(request: web.Request) -> bool:
    token = request.app[TOKEN_KEY]
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def _check_storable(value: Any, depth: int = 0) -> None:
    """Every string storable as it is; nesting bounded (deep code is never reached)."""
    if depth > MAX_WORKFLOW_DEPTH:
        raise ValueError(f"workflow is nested deeper than {MAX_WORKFLOW_DEPTH} levels")
    if isinstance(value, str):
        if not storable_text(value.replace("\n", " ").replace("\r", " ").replace("\t", " ")):
            raise ValueError(
                f"workflow holds a string with a lone surrogate or a control character: "
                f"{value!r:.60}"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key, depth + 1)
            _check_storable(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_storable(item, depth + 1)


def check_workflow(workflow: Any) -> dict[str, Any]:
    """An API-format graph: {node id: {"class_type": str, "inputs": {...}}}, with a save
    node (its files on disk prove the job ran, when ComfyUI's history is gone)."""
    if not isinstance(workflow, dict) or not workflow:
        raise ValueError("workflow must be a non-empty ComfyUI API-format object")
    _check_storable(workflow)
    for node_id, node in workflow.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise ValueError(f"workflow node {node_id!r} has no class_type (use the API format)")
        if not isinstance(node.get("inputs", {}), dict):
            raise ValueError(f"workflow node {node_id!r} has inputs that are not an object")
    if not save_nodes(workflow):
        raise ValueError(
            "workflow has no save node (SaveImage, or a node with a filename_prefix input): "
            "the arbiter returns saved images only"
        )
    unfindable = unfindable_savers(workflow)
    if unfindable:
        raise ValueError(
            f"workflow saves through {', '.join(unfindable)}: the arbiter finds a job's files "
            "after a restart of ComfyUI (so that it never runs twice) only for "
            f"{', '.join(sorted(SAVER_EXTENSIONS))}; save through one of them"
        )
    return workflow


def job_doc(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "state": job.state.value,
        "reason": job.reason,
        "attempts": job.attempts,
        "restarts": job.restarts,
        "cancel_requested": job.cancel_requested,
        "outputs": [f"/v1/jobs/{job.id}/outputs/{n}" for n in range(job.outputs)],
        "created": job.created,
        "started": job.started,
        "finished": job.finished,
    }


def swap_doc(swap: SwapRecord) -> dict[str, Any]:
    return {
        "id": swap.id,
        "direction": swap.direction,
        "started": swap.started,
        "finished": swap.finished,
        "ok": swap.ok,
        "total_seconds": swap.total_seconds,
        "waited_seconds": round(swap.waited_seconds, 6),
        "own_seconds": swap.own_seconds,
        "phases": [
            {
                "phase": p.phase,
                "seconds": p.seconds,
                "waited_seconds": p.waited_seconds,
                "outcome": p.outcome,
            }
            for p in swap.phases
        ],
    }


async def _read_submission(request: web.Request) -> tuple[Any, dict[str, bytes]]:
    limit = request.app[ENGINE_KEY].config.max_payload_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    if request.content_type.startswith("multipart/"):
        reader = await request.multipart()
        workflow: Any = None
        inputs: dict[str, bytes] = {}
        total = 0
        while True:
            part = await reader.next()
            if part is None:
                break
            if not isinstance(part, aiohttp.BodyPartReader):
                raise ValueError("nested multipart bodies are not accepted")
            data = await part.read()
            total += len(data)
            if total > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=total)
            if part.name == "workflow":
                workflow = json.loads(bytes(data).decode("utf-8"))
            else:
                filename = part.filename or part.name
                check_input_name(filename)
                inputs[str(filename)] = bytes(data)
        return workflow, inputs
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object {workflow, inputs}")
    return body.get("workflow"), decode_inputs(body.get("inputs"))


def _storage_refusal(engine: Engine, detail: str) -> web.Response:
    return _error(
        503,
        f"the arbiter cannot store jobs now: {detail}",
        headers={"Retry-After": str(max(1, int(engine.config.poll_interval_seconds * 5)))},
    )


async def post_job(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token")
    engine = request.app[ENGINE_KEY]
    problem = engine.alerts.get(Alert.STORAGE) or engine.storage_problem()
    if problem:
        return _storage_refusal(engine, problem)
    try:
        raw_workflow, inputs = await _read_submission(request)
        workflow = check_workflow(raw_workflow)
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ValueError, UnicodeError, RecursionError) as exc:
        return _error(400, str(exc)[:500] or type(exc).__name__)
    try:
        job = engine.submit_job(workflow, inputs)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        return _storage_refusal(engine, f"{type(exc).__name__}: {exc}")
    return web.json_response({"id": job.id}, status=201)


def _job_or_404(request: web.Request) -> Job:
    engine: Engine = request.app[ENGINE_KEY]
    job = engine.store.job(request.match_info["job_id"])
    if job is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": "no such job"}), content_type="application/json"
        )
    return job


def _unauthorized() -> web.Response:
    return _error(401, "missing or wrong bearer token")


async def get_job(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _unauthorized()
    return web.json_response(job_doc(_job_or_404(request)))


async def get_output(request: web.Request) -> web.StreamResponse:
    if not _authorized(request):
        return _unauthorized()
    job = _job_or_404(request)
    try:
        n = int(request.match_info["n"])
    except ValueError:
        return _error(404, "no such output")
    if job.state is not JobState.DONE or not 0 <= n < job.outputs:
        return _error(404, "no such output")
    engine = request.app[ENGINE_KEY]
    path = job_dir(engine.config.data_dir, job.id) / "outputs" / f"{n}.png"
    try:
        data = path.read_bytes()
    except OSError:
        return _error(404, "output file missing")
    return web.Response(body=data, content_type=image_type(data) or "image/png")


async def delete_job(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token")
    engine = request.app[ENGINE_KEY]
    job = _job_or_404(request)
    outcome = engine.store.cancel(job.id, engine.clock.now())
    current = engine.store.job(job.id)
    assert current is not None
    if outcome is JobState.CANCELLED:
        return web.json_response(job_doc(current))
    if outcome is JobState.RUNNING:  # the engine interrupts its prompt, then ends it
        engine.wake.set()
        return web.json_response(job_doc(current), status=202)
    return _error(409, f"job is {current.state.value}: it has ended and cannot be cancelled")


def status_doc(engine: Engine, authorized: bool = True) -> dict[str, Any]:
    """The engine's state; job ids only for a caller with the token."""
    st = engine.state
    card = engine.watch.last
    healthy, health = engine.healthy()
    hold = engine.active_hold()
    return {
        "mode": engine.mode.value,
        "since": st.mode_since,
        "phase": st.phase.value,
        "phase_since": st.phase_since,
        "image_since": st.image_since,
        "queue_length": engine.store.queue_length(),
        "job_running": engine.jobs.current_job is not None,
        "current_job": engine.jobs.current_job if authorized else None,
        "engine": {
            "alive": engine.alive,
            "healthy": healthy,
            "health": health,
            "heartbeat": engine.pace.heartbeat,
            "heartbeat_age_seconds": round(engine.pace.age(), 3),
            "faults": dict(sorted(engine.faults.items())),
            "image_start_failures": engine.swaps.image_failures,
            "image_stop_failures": engine.swaps.image_stop_failures,
        },
        "hold": None if hold is None else {"holder": hold[0], "until": hold[1]},
        "decision": {"go": engine.last_decision.go, "reasons": list(engine.last_decision.reasons)},
        "swaps": [swap_doc(s) for s in engine.store.swaps(engine.config.swap_history)],
        "card": None
        if card is None
        else {
            "scanned_at": card.scanned_at,
            "age_seconds": round(card.age(engine.clock.now()), 3),
            "clients": [
                {"name": c.name, "vram_bytes": c.vram_bytes, "busy_engines": list(c.busy_engines)}
                for c in card.clients
            ],
            # the LLM pool card by card (one bar per card); [] for one card
            "pool": [
                {
                    "pdev": pdev,
                    "vram_total_bytes": size,
                    "clients": sorted({c.name for c in card.clients if c.pdev == pdev}),
                }
                for pdev, size in card.cards
            ],
        },
        "llm_plan": engine.reclaim.plan_doc(),
        "prewarm": engine.swaps.prewarm_report.doc(),
        "tenants": [
            {"name": t.name, "kind": t.kind.value, "vram_bytes": t.vram_bytes}
            for t in engine.tenants()
        ],
        "alerts": [{"name": k, "message": v} for k, v in sorted(engine.alerts.items())],
    }


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(status_doc(request.app[ENGINE_KEY], _authorized(request)))


async def get_health(request: web.Request) -> web.Response:
    """200 while the engine runs and its heartbeat is fresh, else 503 (the healthcheck)."""
    engine = request.app[ENGINE_KEY]
    healthy, health = engine.healthy()
    return web.json_response(
        {"healthy": healthy, "health": health, "mode": engine.mode.value},
        status=200 if healthy else 503,
    )


async def post_hold(request: web.Request) -> web.Response:
    """Hold swaps to image (a role's probe of ComfyUI): 200, or 409 when mid-swap/job."""
    if not _authorized(request):
        return _unauthorized()
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
    except (ValueError, UnicodeError, RecursionError):
        return _error(400, 'body must be JSON {"seconds": N, "holder": "name"}')
    seconds = body.get("seconds") if isinstance(body, dict) else None
    holder = body.get("holder") if isinstance(body, dict) else None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 1 <= seconds <= MAX_HOLD_SECONDS
    ):
        return _error(400, f"seconds is {seconds!r}: give a number from 1 to {MAX_HOLD_SECONDS}")
    if not isinstance(holder, str) or not holder or len(holder) > 80 or not storable_text(holder):
        return _error(400, f"holder is {holder!r:.60}: give a short name")
    until = engine.hold_swaps(holder, float(seconds))
    if until is None:
        return web.json_response(
            {
                "error": f"the card is not at rest with the LLM (phase {engine.state.phase.value}"
                + (", a job running" if engine.jobs.current_job else "")
                + "): try again later",
                "mode": engine.mode.value,
            },
            status=409,
        )
    return web.json_response({"holder": holder, "until": until})


async def delete_hold(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _unauthorized()
    if request.app[ENGINE_KEY].release_hold():
        return web.json_response({"released": True})
    return _error(404, "no hold")


async def get_mode(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"mode": engine.mode.value, "since": engine.state.mode_since})


def metric_families(engine: Engine) -> list[Metric]:
    """What ``/metrics`` reports, read from the engine and its store at scrape time."""
    swaps = engine.store.swaps(1)
    return families(
        engine.mode,
        engine.store.queue_length(),
        engine.store.job_counts(),
        swaps[0] if swaps else None,
        engine.store.swap_counts(),
        engine.alerts,
        ALERT_NAMES,
        faults=engine.faults,
        heartbeat_age=engine.pace.age(),
        alive=engine.alive,
        plan=engine.reclaim.plan_doc(),
        tenants=[(t.name, t.kind.value, t.vram_bytes) for t in engine.tenants()],
    )


def card_groups(engine: Engine) -> list[dict[str, Any]]:
    """The host's cards by job, for the page's bars: the LLM pool (ComfyUI's card marked),
    the transcode card, then the other cards (an iGPU), each with its tenants by kind and its
    size.  Empty when the arbiter sees one card only (the page draws that one bar as before)."""
    view = engine.watch.last
    config = engine.config
    if view is None or not config.pool or (len(config.pool) == 1 and not view.elsewhere):
        return []

    def kinds(card: CardView) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "kind": t.kind.value, "vram_bytes": t.vram_bytes}
            for t in tenants(
                card,
                config.llm_names + config.image_names,
                config.resident_client_names,
                config.yielding_client_names,
            )
        ]

    def doc(pdev: str, card: CardView, size: int | None) -> dict[str, Any]:
        return {
            "pdev": pdev,
            "vram_total_bytes": size,
            "image": pdev == config.image_pdev,
            "tenants": kinds(card),
        }

    pool = [
        doc(pdev, card, config.card_vram_bytes or card.vram_total_bytes)
        for pdev, card in (view.per_card() if view.cards else ((config.pool[0], view),))
        if pdev is not None
    ]
    size = len(pool)
    groups: list[dict[str, Any]] = [
        {
            "job": "llm",
            "heading": f"LLM pool (TP={size})" if size > 1 else "LLM card",
            "cards": pool,
        }
    ]
    elsewhere = {o.pdev: o for o in view.elsewhere}
    transcode = elsewhere.pop(config.transcode_pdev or "", None)
    for job, heading, cards in (
        ("transcode", "Transcode card", [transcode] if transcode else []),
        ("other", "Other cards" if len(elsewhere) > 1 else "Other card", elsewhere.values()),
    ):
        found = [
            doc(
                o.pdev, CardView(view.scanned_at, o.clients, o.vram_total_bytes), o.vram_total_bytes
            )
            for o in cards
            if o is not None
        ]
        if found:
            groups.append({"job": job, "heading": heading, "cards": found})
    return groups


# the page's held requests: the engine's last look at the proxy when at most this old, else
# a look of the page's own, bounded (the page refreshes every 5 s)
PROXY_MAX_AGE_SECONDS = 4.0
PROXY_TIMEOUT_SECONDS = 2.0


class StatusData:
    """What the status page shows: the open status, the card's size, the recorder's history
    (re-read at most every ``refresh_seconds``, in a thread: the first read of a month is
    tens of megabytes) and the swaps and jobs per day."""

    def __init__(self, engine: Engine, refresh_seconds: float = 15.0) -> None:
        self.engine = engine
        config = engine.config
        self.history = (
            HistoryView(
                config.history_dir,
                config.transcode_client_names,
                engine.clock.now,
                pdev=config.card_pdev,
            )
            if config.history_dir is not None
            else None
        )
        self.refresh_seconds = refresh_seconds
        self._refreshed: float | None = None
        self._lock = asyncio.Lock()

    async def overview(self) -> dict[str, Any]:
        engine = self.engine
        now = engine.clock.now()
        history = None
        if self.history is not None:
            async with self._lock:
                mono = engine.clock.monotonic()  # the refresh's interval
                due = self._refreshed is None or mono - self._refreshed >= self.refresh_seconds
                if due:
                    await asyncio.to_thread(self.history.refresh)
                    self._refreshed = mono
                history = self.history.doc()
        card = engine.watch.last
        doc = status_doc(engine, authorized=False)
        doc.pop("current_job", None)
        today = now - now % 86400  # the UTC day's start, as the page's days are
        doc.update(
            generated=now,
            card_total_bytes=engine.config.card_vram_bytes
            or (card.vram_total_bytes if card is not None else None),
            card_data_max_age_seconds=engine.config.card_data_max_age_seconds,
            since_scan=engine.since_scan(),
            cards=card_groups(engine),
            fleet_view_url=engine.config.fleet_view_url,
            proxy=await engine.proxy_doc(PROXY_MAX_AGE_SECONDS, PROXY_TIMEOUT_SECONDS),
            swaps_today={"since": today, "took_seconds": engine.store.swap_times(today)},
            history=history,
            daily=engine.store.daily_counts(now - 31 * 86400),
        )
        return doc


PAGE_KEY = web.AppKey("cardshare_page", StatusData)


async def get_overview(request: web.Request) -> web.Response:
    return web.json_response(
        await request.app[PAGE_KEY].overview(), headers={"Cache-Control": "no-store"}
    )


def _title(request: web.Request) -> str:
    return f"cardshare: {request.host.rsplit(':', 1)[0] if request.host else 'the box'}"


async def get_page(request: web.Request) -> web.Response:
    doc = await request.app[PAGE_KEY].overview()
    return web.Response(
        text=render_page(doc, _title(request)), content_type="text/html", headers=PAGE_HEADERS
    )


async def get_page_main(request: web.Request) -> web.Response:
    doc = await request.app[PAGE_KEY].overview()
    return web.Response(text=render_main(doc), content_type="text/html", headers=PAGE_HEADERS)


async def get_static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _STATIC:
        return _error(404, f"no static file {name!r}")
    data = resources.files("cardshare.arbiter").joinpath("static", name).read_bytes()
    headers = dict(PAGE_HEADERS, **{"Cache-Control": "max-age=300"})
    return web.Response(body=data, content_type=_STATIC[name], charset="utf-8", headers=headers)


def build_app(engine: Engine, token: str) -> web.Application:
    app = web.Application(client_max_size=engine.config.max_payload_bytes)
    app[ENGINE_KEY] = engine
    app[TOKEN_KEY] = token
    app[PAGE_KEY] = StatusData(engine)
    app.router.add_get("/", get_page)
    app.router.add_get("/status/main", get_page_main)
    app.router.add_get("/static/{name}", get_static)
    app.router.add_get("/v1/overview", get_overview)
    app.router.add_post("/v1/jobs", post_job)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.router.add_get("/v1/jobs/{job_id}/outputs/{n}", get_output)
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/v1/health", get_health)
    app.router.add_post("/v1/hold", post_hold)
    app.router.add_delete("/v1/hold", delete_hold)
    app.router.add_get("/v1/mode", get_mode)
    registry = exposition.registry_of(lambda: metric_families(engine))
    app.router.add_get("/metrics", exposition.handler(registry))
    return app
