"""The arbiter's aiohttp app and engine with real HTTP to small fake vLLM, ComfyUI and proxy
apps, an in-memory Docker and very short timings."""

from __future__ import annotations

import asyncio
import base64
import contextlib
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
from promtext import Exposition

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import CardClient, RecorderFileSource
from cardshare.arbiter.common import RealClock
from cardshare.arbiter.edges import HttpComfy, HttpLlm, HttpProxy
from cardshare.arbiter.engine import Engine
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
        # saved as ComfyUI names it: <prefix>_<counter:05>_.png under the prefix's subfolder
        subfolder, _, stem = body["prompt"]["2"]["inputs"]["filename_prefix"].rpartition("/")
        if world.hang_next:  # runs until interrupted
            world.hang_next -= 1
            world.queue.append(pid)
            return web.json_response({"prompt_id": pid, "number": 1, "node_errors": {}})
        filename = f"{stem}_00001_.png"
        world.files[(subfolder, filename)] = PNG + filename.encode()
        world.executions[subfolder] += 1
        world.history[pid] = {
            "status": {"status_str": "success", "completed": True, "messages": []},
            "outputs": {
                "2": {"images": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}
            },
        }
        return web.json_response({"prompt_id": pid, "number": 1, "node_errors": {}})

    async def history(request: web.Request) -> web.Response:
        down()
        pid = request.match_info["pid"]
        return web.json_response({pid: world.history[pid]} if pid in world.history else {})

    async def queue(_: web.Request) -> web.Response:
        down()
        # as ComfyUI lists them: [number, prompt_id, prompt, extra_data, outputs_to_execute]
        running = [[0, pid, world.prompts[pid], {}, ["2"]] for pid in world.queue[:1]]
        pending = [
            [n, pid, world.prompts[pid], {}, ["2"]] for n, pid in enumerate(world.queue[1:], 1)
        ]
        return web.json_response({"queue_running": running, "queue_pending": pending})

    async def queue_post(request: web.Request) -> web.Response:
        down()
        body = await request.json()
        if body.get("clear"):
            del world.queue[1:]
        drop = set(body.get("delete") or [])
        world.queue[1:] = [p for p in world.queue[1:] if p not in drop]
        return web.Response()

    async def interrupt(request: web.Request) -> web.Response:
        down()
        world.interrupts += 1
        wanted = (await request.json()).get("prompt_id")  # only that one, when given
        if world.queue and wanted in (None, world.queue[0]):
            pid = world.queue.pop(0)
            world.history[pid] = {
                "status": {
                    "status_str": "error",
                    "completed": False,
                    "messages": [["execution_interrupted", {"prompt_id": pid}]],
                },
                "outputs": {},
            }
        return web.Response()

    async def view(request: web.Request) -> web.Response:
        down()
        data = world.files.get((request.query["subfolder"], request.query["filename"]))
        if data is None:
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="image/png")

    app = web.Application()
    app.router.add_get("/object_info", object_info)
    app.router.add_post("/upload/image", upload)
    app.router.add_post("/prompt", prompt)
    app.router.add_get("/history/{pid}", history)
    app.router.add_get("/queue", queue)
    app.router.add_post("/queue", queue_post)
    app.router.add_post("/interrupt", interrupt)
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


@contextlib.asynccontextmanager
async def running_arbiter(
    tmp_path: Path, world: World, **server: Any
) -> AsyncIterator[tuple[TestClient[Any, Any], Engine]]:
    """The arbiter's app and engine, running, with real HTTP to the fake vLLM, ComfyUI and
    proxy apps above (also used by the CLI's tests)."""
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
        # the card data as stale as the arbiter allows, short as in the lab
        card_data_max_age_seconds=0.5,
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
    client = TestClient(TestServer(build_app(engine, TOKEN), **server))
    await client.start_server()
    stop = asyncio.Event()
    task = asyncio.ensure_future(engine.run(stop))
    try:
        yield client, engine
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        await session.close()
        for s in servers:
            await s.close()
        engine.store.close()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    world = World(RealClock())  # type: ignore[arg-type]
    async with running_arbiter(tmp_path, world) as (client, engine):
        yield Rig(client, engine, world)


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
        doc = await (await rig.client.get(f"/v1/jobs/{job_id}", headers=AUTH)).json()
        assert (doc["state"], doc["attempts"], doc["outputs"]) == (
            "done",
            1,
            [f"/v1/jobs/{job_id}/outputs/0"],
        )
        assert (await rig.client.get(doc["outputs"][0])).status == 401  # outputs need the token
        png = await rig.client.get(doc["outputs"][0], headers=AUTH)
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
    m = Exposition(await (await rig.client.get("/metrics")).text())
    assert m("cardshare_arbiter_mode", mode="llm") == 1
    assert m("cardshare_arbiter_mode", mode="image") == 0
    assert m("cardshare_arbiter_jobs_total", state="done") == 3
    assert m("cardshare_arbiter_jobs_unfinished", state="queued") == 0
    assert m("cardshare_arbiter_queue_jobs") == 0
    assert m("cardshare_arbiter_swaps_total", direction="to_image") == 1
    assert m("cardshare_arbiter_swaps_total", direction="to_llm") == 1
    assert set(m.series("cardshare_arbiter_swap_phase_seconds")) == {
        frozenset({("direction", "to_llm"), ("phase", p["phase"])})
        for p in status["swaps"][0]["phases"]
    }
    assert m("cardshare_arbiter_alert", name="llm_not_ready") == 0
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
    doc = await (await rig.client.get(f"/v1/jobs/{job_id}", headers=AUTH)).json()
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
            "input name 'a/b.png' must be a plain file name: no path separator, no control "
            "character or lone surrogate, at most 200 bytes",
        ),
        ("POST", "/v1/jobs", AUTH, {"workflow": WORKFLOW, "pad": "x" * 5000}, 413, None),
        ("GET", "/v1/jobs/nope", AUTH, None, 404, "no such job"),
        ("GET", "/v1/jobs/nope", {}, None, 401, "missing or wrong bearer token"),
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
    assert await second.json() == {
        "error": "job is cancelled: it has ended and cannot be cancelled"
    }


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


async def test_recorder_file_source_takes_the_newer_of_its_scans_and_the_recorders(
    tmp_path: Path,
) -> None:
    """The arbiter's card data changes only by its own scans; the recorder's timer keeps its
    own file fresh: the newer of the two is the card, and a broken recorder file is passed
    over (the arbiter's scans decide)."""
    from cardshare.arbiter.cardview import CardDataError

    own = tmp_path / "arbiter" / "current.json"
    recorder = tmp_path / "recorder" / "current.json"
    recorder.parent.mkdir()
    recorder.write_text(json.dumps({"timestamp_unix": 200.0, "clients": []}))
    source = RecorderFileSource(own, [], recorder_path=recorder)
    assert (await source.read()).scanned_at == 200.0  # no scan of the arbiter's yet
    own.parent.mkdir()
    own.write_text(json.dumps({"timestamp_unix": 150.0, "clients": []}))
    assert (await source.read()).scanned_at == 200.0
    recorder.write_text(json.dumps({"timestamp_unix": 100.0, "clients": []}))
    assert (await source.read()).scanned_at == 150.0
    for broken in ("{", "\udcff", json.dumps({"clients": []})):
        recorder.write_text(broken, errors="surrogateescape")
        assert (await source.read()).scanned_at == 150.0
    own.unlink()
    with pytest.raises(CardDataError, match=r"no scan time"):
        await source.read()


async def test_recorder_file_source_reads_the_named_card(tmp_path: Path) -> None:
    """Both files are read for the named card; a file without it is passed over like a
    broken one, and with neither file showing it the error names the card and the fix."""
    from cardshare.arbiter.cardview import CardDataError

    def doc(stamp: float, cards: dict[str, list[str]]) -> str:
        return json.dumps(
            {
                "timestamp_unix": stamp,
                "cards": {
                    pdev: {"clients": [{"name": n, "vram_bytes": 1} for n in names]}
                    for pdev, names in cards.items()
                },
            }
        )

    own = tmp_path / "own.json"
    recorder = tmp_path / "recorder.json"
    own.write_text(doc(100.0, {"0000:00:02.0": ["desktop"], "0000:03:00.0": ["vllm/vllm"]}))
    recorder.write_text(doc(200.0, {"0000:00:02.0": ["desktop"]}))
    source = RecorderFileSource(own, [], recorder_path=recorder, pdev="0000:03:00.0")
    view = await source.read()
    assert (view.scanned_at, [c.name for c in view.clients]) == (100.0, ["vllm/vllm"])
    own.write_text(doc(300.0, {"0000:00:02.0": ["desktop"]}))
    with pytest.raises(CardDataError, match=r"no card 0000:03:00\.0 \(cards: 0000:00:02\.0\)"):
        await source.read()


# -- issue: the smaller items, through real HTTP ---------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError, not ValueError


@pytest.mark.parametrize(
    ("body", "error_start"),
    [
        (
            {"workflow": WORKFLOW, "inputs": {"in\r\nX-Injected: 1.png": "AA=="}},
            "input name 'in\\r\\nX-Injected: 1.png' must be a plain file name",
        ),
        (
            {"workflow": WORKFLOW, "inputs": {"in\x00.png": "AA=="}},
            "input name 'in\\x00.png' must be a plain file name",
        ),
        (
            {"workflow": WORKFLOW, "inputs": {"x" * 201: "AA=="}},
            f"input name '{'x' * 77}",
        ),
        (
            {"workflow": {"1": {"class_type": "PreviewImage", "inputs": {}}}},
            "workflow has no save node (SaveImage, or a node with a filename_prefix input)",
        ),
        (
            {"workflow": {**WORKFLOW, "3": {"class_type": "X", "inputs": {"a": [[[[[]]]]] * 1}}}},
            None,
        ),
    ],
    ids=["crlf-name", "nul-name", "long-name", "no-save-node", "shallow-ok"],
)
async def test_bad_submissions_are_400_and_leave_nothing(
    rig: Rig, body: Any, error_start: str | None
) -> None:
    rig.world.others.append(CardClient("plex", 1, ()))  # keep jobs queued
    resp = await rig.client.post("/v1/jobs", json=body, headers=AUTH)
    if error_start is None:
        assert resp.status == 201
        return
    assert resp.status == 400
    assert (await resp.json())["error"].startswith(error_start)
    jobs = rig.engine.config.data_dir / "jobs"
    assert not jobs.exists() or list(jobs.iterdir()) == []


async def test_lone_surrogate_and_deep_nesting_are_400(rig: Rig) -> None:
    raw = b'{"workflow": {"1": {"class_type": "SaveImage", "inputs": {"t": "\\ud800"}}}}'
    resp = await rig.client.post(
        "/v1/jobs", data=raw, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert (resp.status, (await resp.json())["error"][:50]) == (
        400,
        "workflow holds a string with a lone surrogate or a",
    )
    nested: Any = {"class_type": "SaveImage", "inputs": {}}
    for _ in range(40):
        nested = {"a": nested}
    resp = await rig.client.post("/v1/jobs", json={"workflow": {"1": nested}}, headers=AUTH)
    assert (resp.status, (await resp.json())["error"]) == (
        400,
        "workflow is nested deeper than 32 levels",
    )
    # deeply nested JSON text within the size bound: json.loads raises RecursionError
    deep = DEEP[: rig.engine.config.max_payload_bytes // 2]
    resp = await rig.client.post(
        "/v1/jobs", data=deep, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert resp.status == 400


async def test_status_names_jobs_only_with_the_token(rig: Rig) -> None:
    rig.world.hang_next = 1
    resp = await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    job_id = (await resp.json())["id"]
    await rig.wait_for(lambda: rig.engine.jobs.current_job == job_id)
    public = await (await rig.client.get("/v1/status")).json()
    assert (public["job_running"], public["current_job"]) == (True, None)
    private = await (await rig.client.get("/v1/status", headers=AUTH)).json()
    assert private["current_job"] == job_id
    assert private["engine"]["alive"] and private["engine"]["healthy"]
    # cancel the running job: 202, its prompt interrupted, then cancelled
    resp = await rig.client.delete(f"/v1/jobs/{job_id}", headers=AUTH)
    assert (resp.status, (await resp.json())["cancel_requested"]) == (202, True)
    await rig.wait_for(lambda: rig.engine.store.queue_length() == 0)
    doc = await (await rig.client.get(f"/v1/jobs/{job_id}", headers=AUTH)).json()
    assert (doc["state"], doc["reason"]) == ("cancelled", "cancelled by request while running")


async def test_health_follows_the_engine(rig: Rig) -> None:
    resp = await rig.client.get("/v1/health")
    assert (resp.status, (await resp.json())["healthy"]) == (200, True)
    rig.engine.pace.heartbeat_mono -= 10_000  # its age is read on the monotonic clock
    resp = await rig.client.get("/v1/health")
    assert resp.status == 503
    assert (await resp.json())["health"].startswith("the engine's heartbeat is ")
    m = Exposition(await (await rig.client.get("/metrics")).text())
    assert m("cardshare_arbiter_engine_up") == 1
    assert m("cardshare_arbiter_heartbeat_age_seconds") >= 10_000
    assert m("cardshare_arbiter_faults_total", kind="engine_error") == 0


async def test_hold_blocks_swaps_and_is_refused_mid_image(rig: Rig) -> None:
    body = {"seconds": 60, "holder": "comfyui-probe"}
    assert (await rig.client.post("/v1/hold", json=body)).status == 401
    resp = await rig.client.post("/v1/hold", json=body, headers=AUTH)
    assert resp.status == 200
    assert (await resp.json())["holder"] == "comfyui-probe"
    await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    await rig.wait_for(lambda: rig.engine.last_decision.reasons[:1] != ("not evaluated yet",))
    await asyncio.sleep(0.5)
    assert rig.engine.mode.value == "llm"
    assert "swaps are held by comfyui-probe" in rig.engine.last_decision.reasons
    assert (await rig.client.delete("/v1/hold", headers=AUTH)).status == 200
    assert (await rig.client.delete("/v1/hold", headers=AUTH)).status == 404
    rig.world.hang_next = 1
    await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    await rig.wait_for(lambda: rig.engine.jobs.current_job is not None)
    resp = await rig.client.post("/v1/hold", json=body, headers=AUTH)
    assert (resp.status, (await resp.json())["mode"]) == (409, "image")
    for bad in ({"seconds": 0, "holder": "x"}, {"seconds": 60, "holder": ""}, []):
        assert (await rig.client.post("/v1/hold", json=bad, headers=AUTH)).status == 400


async def test_storage_problem_refuses_jobs_with_503(rig: Rig) -> None:
    rig.engine.alerts["storage"] = "/data has 1 MiB free"
    resp = await rig.client.post("/v1/jobs", json={"workflow": WORKFLOW}, headers=AUTH)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"] == "the arbiter cannot store jobs now: /data has 1 MiB free"
