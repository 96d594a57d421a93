"""The fakes themselves: Docker's and ComfyUI's semantics as facts.md records them, and each
fault kind reaching the arbiter's own edge clients as the error it stands for."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from rig import WORKFLOW, Http, Rig

from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import HttpComfy, HttpLlm, Rejected, Unavailable
from cardshare.docker_api import DockerClient, DockerError

pytestmark = pytest.mark.faults


def _prompt(prefix: str) -> dict[str, Any]:
    wf = json.loads(json.dumps(WORKFLOW))
    wf["9"]["inputs"]["filename_prefix"] = prefix
    return wf


def test_docker_semantics(fresh: Callable[..., Rig]) -> None:
    rig = fresh(arbiter=False)
    client = DockerClient(rig.docker_sock, timeout=5)
    vllm = client.find_compose_container("vllm", "vllm")
    comfy = client.find_compose_container("comfyui", "comfyui")
    assert (vllm.state, comfy.state, comfy.names) == ("running", "created", ("comfyui-comfyui-1",))
    assert client.list_containers({"com.docker.compose.project": "plex"}) == []
    assert client.start(vllm.id) is False  # running: 304, nothing happens
    assert client.stop(comfy.id, 1) is False  # not running: 304
    assert client.start(comfy.id) is True
    rig.wait(lambda: Http(rig.ports["comfyui"]).request("GET", "/object_info")[0] == 200, 10, "up")
    first = client.inspect(comfy.id)
    assert first.running and first.started_at.endswith("Z") and first.health == "none"
    client.restart(comfy.id, 1)
    second = client.inspect(comfy.id)
    assert second.running and second.started_at != first.started_at
    rig.wait(lambda: Http(rig.ports["comfyui"]).request("GET", "/object_info")[0] == 200, 10, "up")
    assert "comfyui listening" in client.logs_tail(comfy.id, 5)
    assert client.stop(comfy.id, 1) is True
    stopped = client.inspect(comfy.id)
    assert (stopped.running, stopped.status, stopped.exit_code) == (False, "exited", 0)
    with pytest.raises(DockerError, match="answered 404: No such container: nope"):
        client.inspect("nope")
    # a crash as the kernel's OOM killer would do it
    assert rig.docker.crash("vllm", oom=True)
    rig.wait(lambda: not client.inspect(vllm.id).running, 5, "vLLM dead")
    dead = client.inspect(vllm.id)
    assert (dead.oom_killed, dead.exit_code) == (True, 137)


def test_comfyui_semantics(fresh: Callable[..., Rig]) -> None:
    rig = fresh(arbiter=False, settings={"comfyui_job_seconds": 0.2})
    client = DockerClient(rig.docker_sock, timeout=5)
    comfy_id = client.find_compose_container("comfyui", "comfyui").id
    client.start(comfy_id)
    http = Http(rig.ports["comfyui"])
    rig.wait(lambda: http.request("GET", "/object_info")[0] == 200, 10, "ComfyUI up")
    status, doc = http.request(
        "POST", "/prompt", {"prompt": _prompt("cardshare/j1/s0"), "prompt_id": "p-1"}
    )
    assert (status, doc["prompt_id"], doc["node_errors"]) == (200, "p-1", {})
    queue = http.request("GET", "/queue")[1]
    assert [item[1] for item in queue["queue_running"] + queue["queue_pending"]] == ["p-1"]
    rig.wait(lambda: http.request("GET", "/history/p-1")[1] != {}, 5, "p-1 in the history")
    entry = http.request("GET", "/history/p-1")[1]["p-1"]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert entry["outputs"]["9"]["images"] == [
        {"filename": "s0_00001_.png", "subfolder": "cardshare/j1", "type": "output"}
    ]
    assert http.request("GET", "/queue")[1] == {"queue_running": [], "queue_pending": []}
    client.restart(comfy_id, 1)  # the history is in memory only; the files stay
    rig.wait(lambda: http.request("GET", "/object_info")[0] == 200, 10, "ComfyUI up again")
    assert http.request("GET", "/history/p-1") == (200, {})
    status, png = http.request(
        "GET", "/view?filename=s0_00001_.png&subfolder=cardshare/j1&type=output"
    )
    assert status == 200 and png.startswith(b"\x89PNG") and b"cardshare/j1/s0" in png
    assert (
        http.request("GET", "/view?filename=s0_00002_.png&subfolder=cardshare/j1&type=output")[0]
        == 404
    )
    # the same prefix again: the counter continues
    http.request("POST", "/prompt", {"prompt": _prompt("cardshare/j1/s0"), "prompt_id": "p-2"})
    rig.wait(lambda: http.request("GET", "/history/p-2")[1] != {}, 5, "p-2 done")
    assert (
        http.request("GET", "/history/p-2")[1]["p-2"]["outputs"]["9"]["images"][0]["filename"]
        == "s0_00002_.png"
    )
    # interrupt: the running prompt ends with execution_interrupted; clear drops the pending
    rig.settings(comfyui_job_seconds=5.0)
    for pid in ("p-3", "p-4"):
        http.request(
            "POST", "/prompt", {"prompt": _prompt(f"cardshare/{pid}/s0"), "prompt_id": pid}
        )
    rig.wait(lambda: http.request("GET", "/queue")[1]["queue_running"], 5, "p-3 running")
    assert http.request("POST", "/queue", {"clear": True})[0] == 200
    assert http.request("POST", "/interrupt", {})[0] == 200
    rig.wait(lambda: http.request("GET", "/history/p-3")[1] != {}, 5, "p-3 ended")
    status3 = http.request("GET", "/history/p-3")[1]["p-3"]["status"]
    assert status3["status_str"] == "error"
    assert status3["messages"][-1][0] == "execution_interrupted"
    assert http.request("GET", "/queue")[1] == {"queue_running": [], "queue_pending": []}
    events = [(r["event"], r["prompt_id"]) for r in rig.executions_log()]
    assert events.count(("saved", "p-1")) == 1 and ("saved", "p-3") not in events
    assert ("start", "p-4") not in events


KIND_CASES = [
    ("exception", None, Unavailable),
    ("garbage", None, Unavailable),
    ("badjson", None, Unavailable),
    ("hang", None, Unavailable),
    ("status", 500, Unavailable),
    ("status", 400, Rejected),
]


@pytest.mark.parametrize(
    ("kind", "status", "error"), KIND_CASES, ids=[f"{k}{s or ''}" for k, s, _ in KIND_CASES]
)
def test_fault_kinds_reach_the_arbiters_clients(
    fresh: Callable[..., Rig], kind: str, status: int | None, error: type[Exception]
) -> None:
    """Each kind, on ComfyUI's /queue, vLLM's /metrics and Docker, is the error it stands for
    in the arbiter's own clients (HttpComfy, HttpLlm, DockerClient)."""
    rig = fresh(arbiter=False)
    client = DockerClient(rig.docker_sock, timeout=1)
    comfy_id = client.find_compose_container("comfyui", "comfyui").id
    client.start(comfy_id)
    rig.wait(lambda: Http(rig.ports["comfyui"]).request("GET", "/object_info")[0] == 200, 10, "up")
    config = Config(
        data_dir=Path("/nonexistent"),
        vllm_url=f"http://127.0.0.1:{rig.ports['vllm']}",
        served_model_name="fake-model",
        comfyui_url=f"http://127.0.0.1:{rig.ports['comfyui']}",
        card_current_json=Path("/nonexistent"),
        token_file=Path("/nonexistent"),
        http_timeout_seconds=0.5,
    )
    extra: dict[str, Any] = {"status": status} if status else {}

    async def edges() -> None:
        async with aiohttp.ClientSession() as session:
            comfy, llm = HttpComfy(session, config), HttpLlm(session, config)
            # until cleared: aiohttp retries an idempotent request once after a reset
            rule = rig.fault("comfyui", "GET /queue", kind, None, **extra)
            with pytest.raises(error):
                await comfy.queued("x", "cardshare/x")
            rig.clear("comfyui", rule)
            assert await comfy.queued("x", "cardshare/x") is None
            rule = rig.fault("vllm", "GET /metrics", kind, None, **extra)
            if kind == "badjson":  # /metrics is text: a garbled 200 fails the parser instead
                assert "vllm:" not in await llm.metrics()
            else:
                with pytest.raises(error):
                    await llm.metrics()
            rig.clear("vllm", rule)
            assert "vllm:num_requests_running" in await llm.metrics()

    asyncio.run(edges())
    rule = rig.fault("docker", "inspect:comfyui", kind, None, **extra)
    started = time.time()
    with pytest.raises(DockerError):
        client.inspect(comfy_id)
    assert time.time() - started < 3
    rig.clear("docker", rule)
    assert client.inspect(comfy_id).running


def test_one_reset_of_a_get_is_retried_by_aiohttp(fresh: Callable[..., Rig]) -> None:
    """aiohttp (3.9+) retries a GET once after a reset or a disconnect: one such fault on a
    GET never reaches the engine; a POST (/prompt) is never retried."""
    rig = fresh(arbiter=False)
    client = DockerClient(rig.docker_sock, timeout=1)
    client.start(client.find_compose_container("comfyui", "comfyui").id)
    rig.wait(lambda: Http(rig.ports["comfyui"]).request("GET", "/object_info")[0] == 200, 10, "up")
    url = f"http://127.0.0.1:{rig.ports['comfyui']}"

    async def calls() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            rig.fault("comfyui", "GET /queue", "exception", 1)
            async with session.get(f"{url}/queue") as resp:
                got = resp.status
            rig.fault("comfyui", "POST /prompt", "exception", 1)
            try:
                async with session.post(f"{url}/prompt", json={"prompt": WORKFLOW}) as resp:
                    return got, str(resp.status)
            except aiohttp.ClientError as exc:
                return got, type(exc).__name__

    got, post = asyncio.run(calls())
    assert (got, post in ("ClientOSError", "ServerDisconnectedError")) == (200, True), post
