"""The arbiter's aiohttp app and engine with real HTTP to small fake vLLM, ComfyUI and proxy
apps, an in-memory Docker and very short timings."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from arbiter_fakes import PNG, WORKFLOW, FakeCard, FakeContainers, World, make_config

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import CardClient, RecorderFileSource
from cardshare.arbiter.edges import HttpComfy, HttpLlm, HttpProxy
from cardshare.arbiter.engine import Engine, RealClock
from cardshare.arbiter.store import Store

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def vllm_app(world: World) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            text=f"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
            f'vllm:request_success_total{{finished_reason="stop"}} {world.success}.0\n'
        )

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if world.llm.running else 503)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        assert (body["model"], body["max_tokens"]) == ("m", 1)
        world.calls.append("one_token")
        return web.json_response({"choices": [{"text": "!"}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


def comfy_app(world: World) -> web.Application:
    def down() -> None:
        if not world.image.running:
            raise web.HTTPServiceUnavailable()

    async def object_info(_: web.Request) -> web.Response:
        down()
        return web.json_response({"SaveImage": {}})

    async def upload(request: web.Request) -> web.Response:
        down()
        form = await request.post()
        field = form["image"]
        assert isinstance(field, web.FileField)
        world.uploads[field.filename] = field.file.read()
        return web.json_response({"name": field.filename, "subfolder": "", "type": "input"})

    async def prompt(request: web.Request) -> web.Response:
        down()
        body = await request.json()
        if "class_type" not in body["prompt"].get("2", {}):
            return web.json_response(
                {"error": {"message": "invalid"}, "node_errors": {"2": "missing"}}, status=400
            )
        pid = body["prompt_id"]
        world.prompts[pid] = body["prompt"]
        world.history[pid] = {
            "status": {"status_str": "success", "completed": True, "messages": []},
            "outputs": {
                "2": {"images": [{"filename": f"{pid}.png", "subfolder": "", "type": "output"}]}
            },
        }
        return web.json_response({"prompt_id": pid, "number": 1, "node_errors": {}})

    async def history(request: web.Request) -> web.Response:
        down()
        pid = request.match_info["pid"]
        return web.json_response({pid: world.history[pid]} if pid in world.history else {})

    async def queue(_: web.Request) -> web.Response:
        down()
        return web.json_response({"queue_running": [], "queue_pending": []})

    async def view(request: web.Request) -> web.Response:
        down()
        return web.Response(body=PNG + request.query["filename"].encode(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/object_info", object_info)
    app.router.add_post("/upload/image", upload)
    app.router.add_post("/prompt", prompt)
    app.router.add_get("/history/{pid}", history)
    app.router.add_get("/queue", queue)
    app.router.add_get("/view", view)
    return app


def proxy_app(world: World) -> web.Application:
    async def state(_: web.Request) -> web.Response:
        return web.json_response(
            {**world.proxy, "last_request_started": None, "last_request_finished": None}
        )

    app = web.Application()
    app.router.add_get("/proxy/state", state)
    return app


class Rig:
    def __init__(self, client: TestClient[Any, Any], engine: Engine, world: World) -> None:
        self.client = client
        self.engine = engine
        self.world = world

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, self.engine.last_decision
            await asyncio.sleep(0.02)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    world = World(RealClock())  # type: ignore[arg-type]
    servers = [TestServer(a(world)) for a in (vllm_app, comfy_app, proxy_app)]
    for s in servers:
        await s.start_server()
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    config = make_config(
        tmp_path,
        vllm_url=urls[0],
        comfyui_url=urls[1],
        proxy_url=urls[2],
        idle_seconds=0.2,
        poll_interval_seconds=0.02,
        max_payload_bytes=4096,
    )
    session = aiohttp.ClientSession()
    engine = Engine(
        config=config,
        store=Store(config.data_dir / "arbiter.sqlite3"),
        containers=FakeContainers(world),
        llm=HttpLlm(session, config),
        comfy=HttpComfy(session, config),
        card=FakeCard(world),
        proxy=HttpProxy(session, urls[2], 5.0),
    )
    client = TestClient(TestServer(build_app(engine, TOKEN)))
    await client.start_server()
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    yield Rig(client, engine, world)
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.close()
    await session.close()
    for s in servers:
        await s.close()
    engine.store.close()


async def test_three_jobs_done_outputs_downloadable_back_to_llm(rig: Rig) -> None:
    ids = []
    for _ in range(3):
        body = {"workflow": WORKFLOW, "inputs": {"in.png": base64.b64encode(PNG).decode()}}
        resp = await rig.client.post("/v1/jobs", json=body, headers=AUTH)
        assert resp.status == 201
        ids.append((await resp.json())["id"])
    await rig.wait_for(lambda: rig.engine.store.queue_length() == 0)
    await rig.wait_for(lambda: rig.engine.mode.value == "llm")
    for job_id in ids:
        doc = await (await rig.client.get(f"/v1/jobs/{job_id}")).json()
        assert (doc["state"], doc["attempts"], doc["outputs"]) == (
            "done",
            1,
            [f"/v1/jobs/{job_id}/outputs/0"],
        )
        png = await rig.client.get(doc["outputs"][0])
        assert png.content_type == "image/png"
        assert (await png.read()).startswith(PNG)
    mode = await (await rig.client.get("/v1/mode")).json()
    assert mode["mode"] == "llm"
    status = await (await rig.client.get("/v1/status")).json()
    assert [s["direction"] for s in status["swaps"]] == ["to_llm", "to_image"]
    assert [p["phase"] for p in status["swaps"][1]["phases"]] == [
        "stop_llm",
        "wait_llm_release",
        "start_image",
        "wait_image_ready",
    ]
    metrics = await (await rig.client.get("/metrics")).text()
    assert 'cardshare_arbiter_mode{mode="llm"} 1' in metrics
    assert 'cardshare_arbiter_jobs_total{state="done"} 3' in metrics
    assert 'cardshare_arbiter_swaps_total{direction="to_image"} 1' in metrics
    assert 'cardshare_arbiter_alert{name="llm_not_ready"} 0' in metrics
    assert rig.world.calls[-1] == "one_token"


async def test_veto_blocks_swap_until_it_ends(rig: Rig) -> None:
    rig.world.others.append(CardClient("plex", 2 * 2**30, ("vcs",)))
    resp = await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    job_id = (await resp.json())["id"]
    veto = "another client is on the card: plex holds 2.0 GiB VRAM and keeps vcs busy"
    # past idle_seconds, the veto is the only reason left
    await rig.wait_for(lambda: rig.engine.last_decision.reasons == (veto,))
    status = await (await rig.client.get("/v1/status")).json()
    assert status["mode"] == "llm"
    assert status["decision"] == {"go": False, "reasons": [veto]}
    assert {"name": "plex", "vram_bytes": 2 * 2**30, "busy_engines": ["vcs"]} in status["card"][
        "clients"
    ]
    rig.world.others.clear()
    await rig.wait_for(lambda: rig.engine.store.queue_length() == 0)
    doc = await (await rig.client.get(f"/v1/jobs/{job_id}")).json()
    assert doc["state"] == "done"


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status", "error"),
    [
        ("POST", "/v1/jobs", {}, {"workflow": WORKFLOW}, 401, "missing or wrong bearer token"),
        (
            "POST",
            "/v1/jobs",
            {"Authorization": "Bearer nope"},
            {"workflow": WORKFLOW},
            401,
            "missing or wrong bearer token",
        ),
        ("DELETE", "/v1/jobs/x", {}, None, 401, "missing or wrong bearer token"),
        (
            "POST",
            "/v1/jobs",
            AUTH,
            {"workflow": {"1": {"inputs": {}}}},
            400,
            "workflow node '1' has no class_type (use the API format)",
        ),
        (
            "POST",
            "/v1/jobs",
            AUTH,
            {"workflow": WORKFLOW, "inputs": {"a/b.png": "AA=="}},
            400,
            "input name 'a/b.png' must be a plain file name",
        ),
        ("POST", "/v1/jobs", AUTH, {"workflow": WORKFLOW, "pad": "x" * 5000}, 413, None),
        ("GET", "/v1/jobs/nope", {}, None, 404, "no such job"),
    ],
)
async def test_api_errors(
    rig: Rig,
    method: str,
    path: str,
    headers: dict[str, str],
    body: Any,
    status: int,
    error: str | None,
) -> None:
    rig.world.others.append(CardClient("plex", 1, ()))  # keep jobs queued
    resp = await rig.client.request(method, path, json=body, headers=headers)
    assert resp.status == status
    if error is not None:
        assert (await resp.json()) == {"error": error}


async def test_cancel_queued_job_then_conflict(rig: Rig) -> None:
    rig.world.others.append(CardClient("plex", 1, ()))  # keep it queued
    resp = await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    job_id = (await resp.json())["id"]
    first = await rig.client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert (first.status, (await first.json())["state"]) == (200, "cancelled")
    second = await rig.client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert second.status == 409
    assert await second.json() == {"error": "job is cancelled: only a queued job can be cancelled"}


async def test_multipart_submission(rig: Rig) -> None:
    form = aiohttp.FormData()
    form.add_field("workflow", json.dumps(WORKFLOW), content_type="application/json")
    form.add_field("in.png", PNG, filename="in.png", content_type="image/png")
    resp = await rig.client.post("/v1/jobs", data=form, headers=AUTH)
    assert resp.status == 201
    job_id = (await resp.json())["id"]
    await rig.wait_for(lambda: rig.engine.store.queue_length() == 0)
    assert rig.world.uploads[f"cardshare-{job_id}-in.png"] == PNG


async def test_recorder_file_source_runs_fresh_scan(tmp_path: Path) -> None:
    path = tmp_path / "current.json"
    path.write_text(json.dumps({"timestamp_unix": 100.0, "clients": []}))
    script = (
        "import json, sys; json.dump({'timestamp_unix': 5000.0, 'cards': {'0': {'clients': "
        "[{'name': 'plex', 'vram_bytes': 1, 'engines': {}}]}}}, open(sys.argv[1], 'w'))"
    )
    source = RecorderFileSource(path, [sys.executable, "-c", script, str(path)])
    assert (await source.read()).scanned_at == 100.0  # no freshness asked: no scan
    view = await source.read(newer_than=1000.0)
    assert (view.scanned_at, [c.name for c in view.clients]) == (5000.0, ["plex"])
    failing = RecorderFileSource(path, [sys.executable, "-c", "import sys; sys.exit('no root')"])
    from cardshare.arbiter.cardview import CardDataError

    with pytest.raises(CardDataError, match=r"^fresh scan .* exited 1: no root$"):
        await failing.read(newer_than=10_000.0)
