"""Fakes at the arbiter's I/O edges: one small in-memory world (containers, card, vLLM,
ComfyUI, proxy) and a clock that advances only when the code sleeps."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cardshare.arbiter.cardview import CardClient, CardView
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import Rejected, Role, Unavailable
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.store import Store
from cardshare.docker_api import ContainerState, DockerError

PNG = b"\x89PNG\r\n\x1a\n" + b"fake image"
WORKFLOW: dict[str, Any] = {
    "1": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}},
}


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        await asyncio.sleep(0)


@dataclass
class FakeContainer:
    name: str
    running: bool
    oom_killed: bool = False
    exit_code: int = 0
    logs: str = ""
    stop_fails: bool = False


@dataclass
class World:
    """Containers, card, vLLM and ComfyUI behaving together."""

    clock: FakeClock
    llm: FakeContainer = field(default_factory=lambda: FakeContainer("vllm-vllm-1", True))
    image: FakeContainer = field(default_factory=lambda: FakeContainer("comfyui-comfyui-1", False))
    calls: list[str] = field(default_factory=list)
    others: list[CardClient] = field(default_factory=list)
    llm_vram_lingers: bool = False  # vLLM's memory never leaves the card
    llm_never_ready: bool = False
    llm_fails_start: str | None = None  # log text of a vLLM that exits at start
    # vLLM's /metrics
    running: int = 0
    waiting: int = 0
    success: int = 0
    # ComfyUI
    prompts: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    queue: list[str] = field(default_factory=list)
    uploads: dict[str, bytes] = field(default_factory=dict)
    reject_next: dict[str, Any] | None = None
    error_next: list[str] = field(default_factory=list)  # exception messages, one per prompt
    die_on_submit: int = 0  # ComfyUI dies at the next N submissions
    oom_on_die: bool = False
    polls_to_finish: int = 1
    _polls: dict[str, int] = field(default_factory=dict)
    proxy: dict[str, Any] = field(
        default_factory=lambda: {"in_flight": 0, "held": 0, "oldest_held_seconds": None}
    )
    submissions: int = 0

    def container(self, role: Role) -> FakeContainer:
        return self.llm if role == "llm" else self.image


class FakeContainers:
    def __init__(self, world: World) -> None:
        self.w = world

    async def state(self, role: Role) -> ContainerState:
        c = self.w.container(role)
        return ContainerState(
            id=role,
            name=c.name,
            running=c.running,
            status="running" if c.running else "exited",
            oom_killed=c.oom_killed,
            exit_code=c.exit_code,
            health="none",
            error="",
        )

    async def start(self, role: Role) -> None:
        self.w.calls.append(f"start {role}")
        c = self.w.container(role)
        c.running = True
        c.oom_killed = False
        if role == "llm" and self.w.llm_fails_start:
            c.running = False
            c.exit_code = 1
            c.logs = self.w.llm_fails_start
        if role == "image":
            self.w.history.clear()  # ComfyUI keeps its history in memory only
            self.w.queue.clear()

    async def stop(self, role: Role, timeout_seconds: int) -> None:
        self.w.calls.append(f"stop {role}")
        c = self.w.container(role)
        if c.stop_fails:
            raise DockerError(f"Docker Engine POST /containers/{role}/stop answered 500: boom", 500)
        c.running = False

    async def logs_tail(self, role: Role, lines: int = 50) -> str:
        return self.w.container(role).logs


class FakeCard:
    def __init__(self, world: World) -> None:
        self.w = world
        self.reads = 0

    async def read(self, newer_than: float | None = None) -> CardView:
        self.reads += 1
        clients = list(self.w.others)
        if self.w.llm.running or self.w.llm_vram_lingers:
            clients.append(CardClient("vllm/vllm", 27 * 2**30, ("ccs",)))
        if self.w.image.running:
            clients.append(CardClient("comfyui/comfyui", 20 * 2**30, ()))
        return CardView(self.w.clock.now(), tuple(clients))


class FakeLlm:
    def __init__(self, world: World) -> None:
        self.w = world

    async def metrics(self) -> str:
        if not self.w.llm.running:
            raise Unavailable("GET /metrics: connection refused")
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.w.running}.0\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {self.w.waiting}.0\n'
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} '
            f"{self.w.success}.0\n"
        )

    async def health(self) -> int:
        if not self.w.llm.running:
            raise Unavailable("GET /health: connection refused")
        if self.w.llm_never_ready:
            raise Unavailable("GET /health answered 503: ")
        return 200

    async def one_token(self) -> None:
        self.w.calls.append("one_token")


class FakeComfy:
    def __init__(self, world: World) -> None:
        self.w = world

    def _up(self) -> None:
        if not self.w.image.running:
            raise Unavailable("connection refused")

    async def ready(self) -> bool:
        return self.w.image.running

    async def upload_image(self, name: str, data: bytes) -> str:
        self._up()
        self.w.uploads[name] = data
        return name

    async def submit(self, workflow: dict[str, Any], prompt_id: str) -> str:
        self._up()
        self.w.submissions += 1
        if self.w.die_on_submit:
            self.w.die_on_submit -= 1
            self.w.image.running = False
            self.w.image.oom_killed = self.w.oom_on_die
            raise Unavailable("POST /prompt: connection reset")
        if self.w.reject_next is not None:
            detail, self.w.reject_next = self.w.reject_next, None
            raise Rejected("POST /prompt answered 400", detail)
        self.w.prompts[prompt_id] = workflow
        self.w.queue.append(prompt_id)
        return prompt_id

    async def history(self, prompt_id: str) -> dict[str, Any] | None:
        self._up()
        if prompt_id in self.w.queue:
            n = self.w._polls.get(prompt_id, 0) + 1
            self.w._polls[prompt_id] = n
            if n >= self.w.polls_to_finish:
                self.w.queue.remove(prompt_id)
                self.w.history[prompt_id] = self._finished(prompt_id)
        return self.w.history.get(prompt_id)

    def _finished(self, prompt_id: str) -> dict[str, Any]:
        if self.w.error_next:
            message = self.w.error_next.pop(0)
            return {
                "status": {
                    "status_str": "error",
                    "completed": False,
                    "messages": [
                        ["execution_start", {"prompt_id": prompt_id}],
                        [
                            "execution_error",
                            {
                                "prompt_id": prompt_id,
                                "node_id": "2",
                                "node_type": "KSampler",
                                "exception_message": message,
                                "exception_type": "RuntimeError",
                            },
                        ],
                    ],
                },
                "outputs": {},
            }
        return {
            "status": {"status_str": "success", "completed": True, "messages": []},
            "outputs": {
                "2": {
                    "images": [{"filename": f"{prompt_id}.png", "subfolder": "", "type": "output"}]
                }
            },
        }

    async def in_queue(self, prompt_id: str) -> bool:
        self._up()
        return prompt_id in self.w.queue

    async def view(self, filename: str, subfolder: str, kind: str) -> bytes:
        self._up()
        return PNG + filename.encode()


class FakeProxy:
    def __init__(self, world: World) -> None:
        self.w = world

    async def state(self) -> dict[str, Any]:
        return dict(self.w.proxy)


def make_config(tmp_path: Path, **overrides: Any) -> Config:
    base: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "vllm_url": "http://vllm.invalid",
        "served_model_name": "m",
        "comfyui_url": "http://comfy.invalid",
        "card_current_json": tmp_path / "current.json",
        "token_file": tmp_path / "token",
        "idle_seconds": 60.0,
        "poll_interval_seconds": 1.0,
        "llm_release_timeout_seconds": 10.0,
        "image_release_timeout_seconds": 10.0,
        "image_ready_timeout_seconds": 10.0,
        "llm_ready_timeout_seconds": 10.0,
        "llm_retry_backoff_seconds": 1.0,
        "llm_retry_backoff_max_seconds": 4.0,
    }
    base.update(overrides)
    return Config(**base)


def make_engine(tmp_path: Path, world: World, **overrides: Any) -> Engine:
    config = make_config(tmp_path, **overrides)
    return Engine(
        config=config,
        store=Store(config.data_dir / "arbiter.sqlite3"),
        containers=FakeContainers(world),
        llm=FakeLlm(world),
        comfy=FakeComfy(world),
        card=FakeCard(world),
        proxy=FakeProxy(world),
        clock=world.clock,
    )


async def run_until(engine: Engine, predicate: Any, max_steps: int = 500) -> int:
    """Step the engine until ``predicate(engine)`` holds; return the steps taken."""
    for n in range(max_steps):
        if predicate(engine):
            return n
        await engine.step()
    raise AssertionError(
        f"not reached after {max_steps} steps; phase {engine.state.phase}, "
        f"decision {engine.last_decision}, alerts {engine.alerts}"
    )
