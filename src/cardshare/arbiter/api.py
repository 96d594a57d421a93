"""The arbiter's HTTP API (aiohttp): jobs, status, mode, metrics.

Mutating calls need ``Authorization: Bearer <token>``; request bodies are bounded.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import aiohttp
from aiohttp import web

from cardshare.arbiter.engine import ALERT_NAMES, Engine, check_input_name, decode_inputs
from cardshare.arbiter.metrics import render_metrics
from cardshare.arbiter.store import Job, JobState, SwapRecord, job_dir


def _app_key(name: str, kind: type) -> Any:
    """A typed AppKey on aiohttp 3.9 and newer, the plain name on 3.8."""
    factory = getattr(web, "AppKey", None)
    return factory(name, kind) if factory is not None else name


ENGINE_KEY: Any = _app_key("cardshare_engine", Engine)
TOKEN_KEY: Any = _app_key("cardshare_token", str)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _authorized(request: web.Request) -> bool:
    token = request.app[TOKEN_KEY]
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def check_workflow(workflow: Any) -> dict[str, Any]:
    """An API-format graph: {node id: {"class_type": str, "inputs": {...}}}."""
    if not isinstance(workflow, dict) or not workflow:
        raise ValueError("workflow must be a non-empty ComfyUI API-format object")
    for node_id, node in workflow.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise ValueError(f"workflow node {node_id!r} has no class_type (use the API format)")
        if not isinstance(node.get("inputs", {}), dict):
            raise ValueError(f"workflow node {node_id!r} has inputs that are not an object")
    return workflow


def job_doc(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "state": job.state.value,
        "reason": job.reason,
        "attempts": job.attempts,
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
                workflow = json.loads(data)
            else:
                filename = part.filename or part.name
                check_input_name(filename)
                inputs[str(filename)] = bytes(data)
        return workflow, inputs
    body = await request.json()
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object {workflow, inputs}")
    return body.get("workflow"), decode_inputs(body.get("inputs"))


async def post_job(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token")
    engine = request.app[ENGINE_KEY]
    try:
        raw_workflow, inputs = await _read_submission(request)
        workflow = check_workflow(raw_workflow)
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        return _error(400, str(exc))
    job = engine.submit_job(workflow, inputs)
    return web.json_response({"id": job.id}, status=201)


def _job_or_404(request: web.Request) -> Job:
    engine: Engine = request.app[ENGINE_KEY]
    job = engine.store.job(request.match_info["job_id"])
    if job is None:
        raise web.HTTPNotFound(
            text=json.dumps({"error": "no such job"}), content_type="application/json"
        )
    return job


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(job_doc(_job_or_404(request)))


async def get_output(request: web.Request) -> web.StreamResponse:
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
    return web.Response(body=data, content_type="image/png")


async def delete_job(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _error(401, "missing or wrong bearer token")
    engine = request.app[ENGINE_KEY]
    job = _job_or_404(request)
    if engine.store.cancel(job.id, engine.clock.now()):
        cancelled = engine.store.job(job.id)
        assert cancelled is not None
        return web.json_response(job_doc(cancelled))
    current = engine.store.job(job.id)
    assert current is not None
    return _error(409, f"job is {current.state.value}: only a queued job can be cancelled")


def status_doc(engine: Engine) -> dict[str, Any]:
    st = engine.state
    card = engine.last_card
    return {
        "mode": engine.mode.value,
        "since": st.mode_since,
        "phase": st.phase.value,
        "phase_since": st.phase_since,
        "image_since": st.image_since,
        "queue_length": engine.store.queue_length(),
        "current_job": engine.current_job,
        "decision": {"go": engine.last_decision.go, "reasons": list(engine.last_decision.reasons)},
        "swaps": [swap_doc(s) for s in engine.store.swaps(engine.config.swap_history)],
        "card": None
        if card is None
        else {
            "scanned_at": card.scanned_at,
            "clients": [
                {"name": c.name, "vram_bytes": c.vram_bytes, "busy_engines": list(c.busy_engines)}
                for c in card.clients
            ],
        },
        "alerts": [{"name": k, "message": v} for k, v in sorted(engine.alerts.items())],
    }


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(status_doc(request.app[ENGINE_KEY]))


async def get_mode(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"mode": engine.mode.value, "since": engine.state.mode_since})


async def get_metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    swaps = engine.store.swaps(1)
    text = render_metrics(
        engine.mode,
        engine.store.queue_length(),
        engine.store.job_counts(),
        swaps[0] if swaps else None,
        engine.store.swap_counts(),
        engine.alerts,
        ALERT_NAMES,
    )
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def build_app(engine: Engine, token: str) -> web.Application:
    app = web.Application(client_max_size=engine.config.max_payload_bytes)
    app[ENGINE_KEY] = engine
    app[TOKEN_KEY] = token
    app.router.add_post("/v1/jobs", post_job)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", delete_job)
    app.router.add_get("/v1/jobs/{job_id}/outputs/{n}", get_output)
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/v1/mode", get_mode)
    app.router.add_get("/metrics", get_metrics)
    return app
