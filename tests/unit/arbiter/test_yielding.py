"""Yielding tenants (a re-encode campaign): asked to step aside for a swap to image or for
vLLM's memory, acknowledged within their bound, resumed when the card is back with vLLM.
The engine with a fake tenant; the HTTP edge against a real server on 127.0.0.1 that acks,
answers garbage, an error status, or hangs past the bound."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.config import ConfigError, YieldingTenant, parse_config
from cardshare.arbiter.edges import HttpYielding, Rejected, Unavailable
from cardshare.arbiter.states import Mode

GIB = 2**30
NAME = "campaign/encoder"


class FakeTenant:
    """Steps aside on a pause: its card client's memory goes (the encoder releases its
    surfaces), and comes back on resume."""

    def __init__(self, world: World, acks: bool = True) -> None:
        self.world = world
        self.acks = acks
        self.calls: list[str] = []
        self.client = CardClient(NAME, GIB, ("vcs",))
        world.others.append(self.client)

    async def pause(self, name: str, seconds: float, reason: str) -> int:
        self.calls.append(f"pause {name} {seconds:g}")
        if not self.acks:
            raise Unavailable("POST /v1/pause: timed out")
        self.world.others[:] = [c for c in self.world.others if c.name != NAME]
        self.world.others.append(CardClient(NAME, 0, ()))
        return 0

    async def resume(self, name: str) -> None:
        self.calls.append(f"resume {name}")
        self.world.others[:] = [c for c in self.world.others if c.name != NAME]
        self.world.others.append(self.client)


def engine_with(tmp_path: Path, world: World, tenant: FakeTenant) -> Any:
    engine = make_engine(
        tmp_path,
        world,
        idle_seconds=1.0,
        yielding_tenants=(YieldingTenant(NAME, "http://127.0.0.1:1", 5.0),),
        yield_lease_seconds=60.0,
    )
    engine.yielders.api = tenant
    return engine


async def test_a_yielding_tenant_steps_aside_for_the_swap_and_resumes_after(
    tmp_path: Path,
) -> None:
    world = World(FakeClock())
    tenant = FakeTenant(world)
    engine = engine_with(tmp_path, world, tenant)
    job = engine.submit_job(WORKFLOW, {"in.png": PNG}).id
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)
    assert tenant.calls == [f"pause {NAME} 60"]
    await run_until(
        engine,
        lambda e: e.store.job(job).state.value == "done" and e.mode is Mode.LLM,  # type: ignore[union-attr]
    )
    assert tenant.calls == [f"pause {NAME} 60", f"resume {NAME}"]
    assert not engine.yielders.paused


async def test_a_tenant_that_does_not_ack_holds_the_swap(tmp_path: Path) -> None:
    world = World(FakeClock())
    tenant = FakeTenant(world, acks=False)
    engine = engine_with(tmp_path, world, tenant)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    for _ in range(20):
        await engine.step()
    assert engine.mode is Mode.LLM
    assert tenant.calls and all(c.startswith("pause") for c in tenant.calls)
    assert any(
        "yielding tenant is on the card (not paused)" in r for r in engine.last_decision.reasons
    )
    # it acks at last: the swap goes
    tenant.acks = True
    await run_until(engine, lambda e: e.mode is Mode.IMAGE)


class SlowTenant(FakeTenant):
    """Acknowledges a pause at once; its memory leaves the card ``release_after`` seconds
    later (``None``: never)."""

    def __init__(self, world: World, release_after: float | None) -> None:
        super().__init__(world)
        self.release_after = release_after
        self.acked_at: float | None = None

    async def pause(self, name: str, seconds: float, reason: str) -> int:
        self.calls.append(f"pause {name} {seconds:g}")
        self.acked_at = self.world.clock.now()
        return GIB

    def tick(self) -> None:
        after, acked = self.release_after, self.acked_at
        if after is not None and acked is not None and self.world.clock.now() >= acked + after:
            self.world.others[:] = [c for c in self.world.others if c.name != NAME]
            self.world.others.append(CardClient(NAME, 0, ()))


async def test_a_paused_tenants_release_is_seen_within_a_poll(tmp_path: Path) -> None:
    """Its memory leaves 4 s after the ack: the card is scanned at each poll meanwhile, so
    the swap goes then, not when the data would age past card_data_max_age_seconds."""
    world = World(FakeClock())
    tenant = SlowTenant(world, release_after=4.0)
    engine = engine_with(tmp_path, world, tenant)
    engine.config = dataclasses.replace(engine.config, card_data_max_age_seconds=120.0)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    for _ in range(200):
        tenant.tick()
        if engine.mode is Mode.IMAGE or engine.state.phase.value != "serve_llm":
            break
        await engine.step()
    assert tenant.acked_at is not None
    assert engine.state.phase.value != "serve_llm", engine.last_decision
    waited = world.clock.now() - tenant.acked_at
    assert 4.0 <= waited < 4.0 + 3 * engine.config.poll_interval_seconds, waited


async def test_a_tenant_that_keeps_its_memory_is_not_scanned_at_every_poll(
    tmp_path: Path,
) -> None:
    """Acknowledged but never released: scans at each poll only for the release timeout
    after the ack, then as the data ages; the swap stays held."""
    world = World(FakeClock())
    tenant = SlowTenant(world, release_after=None)
    engine = engine_with(tmp_path, world, tenant)
    engine.config = dataclasses.replace(engine.config, card_data_max_age_seconds=120.0)
    engine.submit_job(WORKFLOW, {"in.png": PNG})
    await run_until(engine, lambda e: tenant.acked_at is not None)
    scans = engine.card.scans
    start = world.clock.now()
    while world.clock.now() - start < 110.0:
        await engine.step()
    assert engine.mode is Mode.LLM
    timeout = engine.config.llm_release_timeout_seconds
    polls = timeout / engine.config.poll_interval_seconds
    assert engine.card.scans - scans <= polls + 2, (engine.card.scans - scans, polls)
    assert any("paused, its memory not released yet" in r for r in engine.last_decision.reasons)


async def test_no_pause_when_nothing_waits_for_the_card(tmp_path: Path) -> None:
    world = World(FakeClock())
    tenant = FakeTenant(world)
    engine = engine_with(tmp_path, world, tenant)
    for _ in range(20):
        await engine.step()
    assert tenant.calls == []


def test_yielding_tenants_are_read_and_checked() -> None:
    base = {
        "data_dir": "/d",
        "vllm_url": "http://v",
        "served_model_name": "m",
        "comfyui_url": "http://c",
        "card_current_json": "/c.json",
        "token_file": "/t",
    }
    config = parse_config(
        {**base, "yielding_tenants": [{"name": NAME, "url": "http://127.0.0.1:8097/"}]}
    )
    assert config.yielding_tenants == (YieldingTenant(NAME, "http://127.0.0.1:8097", 30.0),)
    assert config.yielding_names == (NAME,)
    for bad, key in (
        ({"name": "encoder", "url": "http://x"}, "yielding_tenants[0].name"),
        ({"name": NAME, "url": "ftp://x"}, "yielding_tenants[0].url"),
        ({"name": NAME, "url": "http://x", "ack_seconds": 0}, "yielding_tenants[0].ack_seconds"),
        ({"name": NAME}, "yielding_tenants[0]"),
    ):
        with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
            parse_config({**base, "yielding_tenants": [bad]})


# -- the HTTP edge, against a real server ----------------------------------------------


def tenant_app(mode: str) -> web.Application:
    async def pause(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["holder"] == "cardshare-arbiter" and body["seconds"] == 60
        if mode == "ack":
            return web.json_response({"paused": True, "vram_bytes": 0})
        if mode == "garbage":
            return web.Response(text="<html>Bad Gateway</html>")
        if mode == "refuses":
            return web.json_response({"paused": False, "vram_bytes": GIB})
        if mode == "error":
            return web.Response(status=500, text="boom")
        if mode == "bad request":
            return web.Response(status=400, text="seconds must be a number")
        await asyncio.sleep(2)  # hangs past the bound
        return web.json_response({"paused": True, "vram_bytes": 0})

    async def resume(request: web.Request) -> web.StreamResponse:
        return web.json_response({"paused": False})

    app = web.Application()
    app.router.add_post("/v1/pause", pause)
    app.router.add_post("/v1/resume", resume)
    return app


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("ack", None),
        ("garbage", Unavailable),
        ("refuses", Unavailable),
        ("error", Unavailable),
        ("bad request", Rejected),
        ("hang", Unavailable),
    ],
)
async def test_the_http_edge(mode: str, error: type[Exception] | None) -> None:
    server = TestServer(tenant_app(mode), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            edge = HttpYielding(session, {NAME: (str(server.make_url("")).rstrip("/"), 0.5)})
            if error is None:
                assert await edge.pause(NAME, 60, "a swap") == 0
                await edge.resume(NAME)
            else:
                with pytest.raises(error):
                    await edge.pause(NAME, 60, "a swap")
    finally:
        await server.close()


async def test_a_tenant_that_is_not_there_is_unavailable() -> None:
    async with aiohttp.ClientSession() as session:
        edge = HttpYielding(session, {NAME: ("http://127.0.0.1:9", 0.5)})
        with pytest.raises(Unavailable):
            await edge.pause(NAME, 60, "a swap")
