"""Real vLLM start failures reach the arbiter's failure path and are classified right.

vLLM runs as the container ``vllm/vllm`` of the fault suite's Docker Engine API
(tests/faults/fake_docker.py: real processes, Docker's log semantics: one stream of stdout
and stderr lines, ``tail=N`` the last N lines, multiplexed frames). The arbiter's own code
starts it and reads it: ``DockerClient`` and ``DockerContainers`` (the logs as the arbiter
asks for them) and ``common.container_failure`` (the inspect, then ``classify_tail`` on that
log). Only a memory failure may come out as ``insufficient_vram``: it is what makes the
arbiter reclaim the card and step down the ladder.

The memory failure is forced with ``--kv-cache-memory-bytes 1048576`` (1 MiB of KV cache,
4096 tokens of the tiny model) against ``--max-model-len 32768``: on the CPU the KV cache is
not sized from ``--gpu-memory-utilization``, but the refusal is the same code and text as on a
card (vllm/v1/core/kv_cache_utils.py). ``VLLM_CPU_KVCACHE_SPACE`` is unset for it, or it
would override the flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import CACHE, REPO, SERVED_NAME, free_port, tiny_args, vllm_env

from cardshare.arbiter.common import ContainerFailure, FailureKind, container_failure
from cardshare.arbiter.config import Config, ContainerRef
from cardshare.arbiter.edges import DockerContainers, HttpComfy, HttpLlm
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.store import Store
from cardshare.docker_api import DockerClient

pytestmark = pytest.mark.conformance

FAKE_DOCKER = REPO / "tests" / "faults" / "fake_docker.py"
REF = ContainerRef("vllm", "vllm")
# The YaRN override as the vllm role renders it before the vllm-yarn change (issue 28):
# vLLM 0.32 derives the window from max_position_embeddings and refuses 65536.
OLD_YARN = (
    '{"rope_scaling":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":32768}}'
)


class NoCard:
    """The card source: _container_failure never reads the card."""

    async def read(self, newer_than: float | None) -> Any:
        raise AssertionError("the card is not read here")


class Rig:
    """The fake Docker Engine with vLLM as its one container, and the arbiter's engine."""

    def __init__(
        self, tmp: Path, vllm_bin: Path, args: list[str], env: dict[str, str | None]
    ) -> None:
        self.tmp = tmp
        self.sock = str(tmp / "docker.sock")
        # the fake Docker runs its containers in its own environment plus the spec's
        container_env = {k: v for k, v in vllm_env(env).items() if os.environ.get(k) != v}
        spec = {
            "socket": self.sock,
            "run_dir": str(tmp),
            "card_file": str(tmp / "current.json"),
            "containers": [
                {
                    "name": "vllm-vllm-1",
                    "project": REF.project,
                    "service": REF.service,
                    "image": "vllm-cpu:0.32.0",
                    "argv": [str(vllm_bin / "vllm"), "serve", *args],
                    "env": container_env,
                    "card_name": REF.client_name,
                    "vram_bytes": 0,
                    "autostart": False,
                }
            ],
        }
        (tmp / "settings.json").write_text(json.dumps({"card_interval": 5}), encoding="utf-8")
        (tmp / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        self.docker = subprocess.Popen(
            [sys.executable, str(FAKE_DOCKER), str(tmp / "spec.json")],
            stdout=open(tmp / "fake-docker.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its containers share its group: killed together
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            assert time.monotonic() < deadline, "the fake Docker Engine did not listen"
            time.sleep(0.1)
        self.client = DockerClient(self.sock)

    def close(self) -> None:
        self.docker.terminate()
        self.docker.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.docker.pid, signal.SIGKILL)

    def url(self, args: list[str]) -> str:
        return f"http://127.0.0.1:{args[args.index('--port') + 1]}"

    async def failure(self) -> tuple[ContainerFailure | None, Any]:
        """Start the container the arbiter's way, wait for its exit, and ask the engine why."""
        config = Config(
            data_dir=self.tmp / "arbiter",
            vllm_url="http://127.0.0.1:9",
            served_model_name=SERVED_NAME,
            comfyui_url="http://127.0.0.1:9",
            card_current_json=self.tmp / "current.json",
            token_file=self.tmp / "token",
            docker_socket=self.sock,
        )
        config.data_dir.mkdir(parents=True, exist_ok=True)
        containers = DockerContainers(self.client, {"llm": REF, "image": REF})
        async with aiohttp.ClientSession() as session:
            engine = Engine(
                config=config,
                store=Store(config.data_dir / "arbiter.sqlite3"),
                containers=containers,
                llm=HttpLlm(session, config),
                comfy=HttpComfy(session, config),
                card=NoCard(),  # type: ignore[arg-type]
            )
            try:
                state = await containers.state("llm")
                deadline = time.monotonic() + 600
                while state.running:
                    assert time.monotonic() < deadline, "vLLM did not exit"
                    await asyncio.sleep(1.0)
                    state = await containers.state("llm")
                return await container_failure(engine.containers, "llm", engine.alerts), state
            finally:
                engine.store.close()


def engine_core_pid(api_pid: int) -> int:
    """The pid of the engine core process vLLM's API server started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == api_pid and cmdline.startswith(b"VLLM::EngineCore"):
            return int(entry.name)
    raise AssertionError(f"no VLLM::EngineCore child of {api_pid}")


CASES = {
    # name: (extra args, env, expected kind)
    "kv_cache_too_small": (
        ["--kv-cache-memory-bytes", "1048576"],
        {"VLLM_CPU_KVCACHE_SPACE": None},
        FailureKind.INSUFFICIENT_VRAM,
    ),
    "yarn_refused": (["--max-model-len", "65536", "--hf-overrides", OLD_YARN], {}, None),
    "bad_flag_value": (["--max-num-seqs", "lots"], {}, None),
    "unknown_tool_call_parser": (["--tool-call-parser", "nosuchparser"], {}, None),
}


def with_overrides(args: list[str], extra: list[str]) -> list[str]:
    """``args`` with each flag of ``extra`` replaced (or appended when absent)."""
    out = list(args)
    for i in range(0, len(extra), 2):
        flag, value = extra[i], extra[i + 1]
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_start_is_classified_by_the_arbiter(
    case: str, vllm_bin: Path, model_root: Path, tmp_path: Path
) -> None:
    extra, env, expected = CASES[case]
    args = with_overrides(tiny_args(model_root, free_port()), extra)
    rig = Rig(tmp_path, vllm_bin, args, env)
    try:
        rig.client.start(rig.client.find_compose_container(REF.project, REF.service).id)
        failure, state = asyncio.run(rig.failure())
    finally:
        rig.close()
    (CACHE / "logs").mkdir(parents=True, exist_ok=True)
    log = tmp_path / "logs" / "vllm.log"
    (CACHE / "logs" / f"failure-{case}.log").write_bytes(log.read_bytes())
    assert failure is not None
    assert state.exit_code != 0, state
    want = expected or FailureKind.EXITED
    assert failure.kind is want, f"{case}: {failure} (vLLM's log: {log})"
    if want is FailureKind.INSUFFICIENT_VRAM:
        assert "larger than the available KV cache memory" in failure.message


def test_a_killed_engine_core_is_not_a_memory_failure(
    vllm_bin: Path, model_root: Path, tmp_path: Path
) -> None:
    args = tiny_args(model_root, free_port())
    rig = Rig(tmp_path, vllm_bin, args, {})
    try:
        found = rig.client.find_compose_container(REF.project, REF.service)
        rig.client.start(found.id)
        url = rig.url(args)
        deadline = time.monotonic() + 600
        while True:
            assert time.monotonic() < deadline, "vLLM did not come up"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        api_pid = int(rig.client.inspect_document(found.id)["State"]["Pid"])
        os.kill(engine_core_pid(api_pid), signal.SIGKILL)
        failure, state = asyncio.run(rig.failure())
    finally:
        rig.close()
    assert failure is not None
    assert failure.kind is FailureKind.EXITED, failure
    # vLLM 0.32's API server shuts down cleanly when its engine core dies: exit code 0, as a
    # stop would leave it (tests/fixtures/vllm/engine-killed-exit.md)
    assert state.exit_code == 0, state
