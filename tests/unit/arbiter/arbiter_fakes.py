"""Fakes at the arbiter's I/O edges: one small in-memory world (containers, card, vLLM,
ComfyUI, proxy) and a clock that advances only when the code sleeps."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cardshare.arbiter.cardview import CardClient, CardView
from cardshare.arbiter.config import Config, ContainerRef
from cardshare.arbiter.edges import Rejected, Role, Unavailable
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.resume import prompt_writes_under
from cardshare.arbiter.store import Store
from cardshare.docker_api import ContainerState, DockerError

PNG = b"\x89PNG\r\n\x1a\n" + b"fake image"
WORKFLOW: dict[str, Any] = {
    "1": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}},
}


class FakeClock:
    """Both clocks advance together when the code sleeps; ``wall_step`` steps the wall clock
    alone (an NTP correction, a manual change), as the real one can."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start
        self.wall_step = 0.0

    def now(self) -> float:
        return self.t + self.wall_step

    def monotonic(self) -> float:
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
    start_fails: bool = False  # Docker refuses to start it (e.g. a missing device)
    exits_at_start: bool = False  # it starts, then exits at once (a broken image)
    starts: int = 0  # State.StartedAt moves with every real start
    finished: float = 0.0  # State.FinishedAt on the world's clock (0: it never exited)
    restarting: bool = False  # exited, and its restart policy starts it again (Running true)

    @property
    def started_at(self) -> str:
        return f"2026-01-01T00:00:{self.starts:02d}Z" if self.starts else ""


@dataclass
class World:
    """Containers, card, vLLM and ComfyUI behaving together, with the real services'
    semantics: Docker's start of a running container and stop of a stopped one do nothing
    (304); ComfyUI runs one prompt at a time, moves it from its queue to its history in one
    step, keeps the history in memory only (a restart forgets it) and its saved files on
    disk (they survive)."""

    clock: FakeClock
    llm: FakeContainer = field(default_factory=lambda: FakeContainer("vllm-vllm-1", True))
    image: FakeContainer = field(default_factory=lambda: FakeContainer("comfyui-comfyui-1", False))
    calls: list[str] = field(default_factory=list)
    others: list[CardClient] = field(default_factory=list)
    llm_vram_lingers: bool = False  # vLLM's memory never leaves the card
    llm_release_seconds: float = 0.0  # vLLM's memory leaves the card this long after its exit
    llm_never_ready: bool = False
    llm_fails_start: str | None = None  # log text of a vLLM that exits at start
    # vLLM's /metrics
    running: int = 0
    waiting: int = 0
    success: int = 0
    # ComfyUI: its memory (lost at every start) ...
    prompts: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    queue: list[str] = field(default_factory=list)  # queue[0] runs
    head_since: float | None = None
    # ... and its disk (kept)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    uploads: dict[str, bytes] = field(default_factory=dict)
    executions: Counter[str] = field(default_factory=Counter)  # finished runs per subfolder
    job_seconds: float = 0.5  # how long a prompt runs
    job_seconds_range: tuple[float, float] | None = None  # or a random time in this range
    hang_next: int = 0  # the next N prompts never finish (only /interrupt ends them)
    durations: dict[str, float] = field(default_factory=dict)
    after_submit: Callable[[str], None] | None = None  # once, right after the next /prompt
    latency: tuple[float, float] = (0.0, 0.0)  # each ComfyUI call takes this long (range)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    reject_next: dict[str, Any] | None = None
    error_next: list[str] = field(default_factory=list)  # exception messages, one per prompt
    die_on_submit: int = 0  # ComfyUI dies at the next N submissions
    oom_on_die: bool = False
    garbage_next: dict[str, int] = field(default_factory=dict)  # call -> answers of garbage
    interrupts: int = 0
    # vLLM's plans: one container per compose service (the first, "vllm", is llm above); a
    # start asks plan_reservations[service] free of card_total, and exits with vLLM's own
    # message when it is not (as vLLM's startup check does)
    plans: dict[str, FakeContainer] = field(default_factory=dict)
    plan_reservations: dict[str, int] = field(default_factory=dict)
    card_total: int | None = None
    llm_service: str = "vllm"
    plan_starts: list[str] = field(default_factory=list)  # the service of each real start
    # ComfyUI's VRAM: its models while loaded; /free drops it to the baseline after a delay
    # (it answers at once, as the real one does), a new prompt loads them again
    comfy_vram: int = 20 * 2**30
    comfy_baseline: int = 512 * 2**20
    free_delay: float = 3.0
    freed_at: float | None = None
    view_not_found: int = 0  # the next N /view calls answer 404 whatever is on disk
    view_not_image: int = 0  # the next N /view calls answer 200 with an HTML error page
    proxy: dict[str, Any] = field(
        default_factory=lambda: {"in_flight": 0, "held": 0, "oldest_held_seconds": None}
    )
    submissions: int = 0

    def use_plan(self, service: str) -> None:
        if not self.plans:
            self.plans["vllm"] = self.llm
        self.llm = self.plans.setdefault(service, FakeContainer(f"vllm-{service}-1", False))
        self.llm_service = service

    def llm_vram(self) -> int:
        return self.plan_reservations.get(self.llm_service, 27 * 2**30)

    def held_by_others(self) -> int:
        held = sum(c.vram_bytes for c in self.others)
        if self.image.running:
            held += self.comfy_now()
        return held

    def comfy_now(self) -> int:
        if self.freed_at is not None and self.clock.now() >= self.freed_at:
            return self.comfy_baseline
        return self.comfy_vram

    def container(self, role: Role) -> FakeContainer:
        return self.llm if role == "llm" else self.image

    def comfy_process_started(self) -> None:
        """A new ComfyUI process: empty queue and history (memory), same files (disk)."""
        self.history.clear()
        self.queue.clear()
        self.head_since = None

    def duplicates(self) -> dict[str, int]:
        return {k: n for k, n in self.executions.items() if n > 1}


class FakeContainers:
    def __init__(self, world: World) -> None:
        self.w = world

    def use(self, role: Role, ref: ContainerRef) -> None:
        if role == "llm":
            self.w.use_plan(ref.service)

    async def state(self, role: Role) -> ContainerState:
        c = self.w.container(role)
        return ContainerState(
            id=role,
            name=c.name,
            running=c.running or c.restarting,
            status="restarting" if c.restarting else ("running" if c.running else "exited"),
            oom_killed=c.oom_killed,
            exit_code=c.exit_code,
            health="none",
            error="",
            started_at=c.started_at,
            finished_at=(
                datetime.fromtimestamp(c.finished, UTC).isoformat().replace("+00:00", "Z")
                if c.finished
                else "0001-01-01T00:00:00Z"
            ),
        )

    def _really_start(self, role: Role) -> None:
        c = self.w.container(role)
        if c.start_fails:
            raise DockerError(
                f"Docker Engine POST /containers/{role}/start answered 500: "
                "error gathering device information",
                500,
            )
        c.running = True
        c.oom_killed = False
        c.starts += 1
        if role == "llm":
            self.w.plan_starts.append(self.w.llm_service)
        if role == "llm" and self.w.llm_fails_start:
            c.running = False
            c.exit_code = 1
            c.logs = self.w.llm_fails_start
        want = self.w.plan_reservations.get(self.w.llm_service)
        total = self.w.card_total
        if role == "llm" and want is not None and total is not None:
            free = total - self.w.held_by_others()
            if free < want:
                c.running = False
                c.exit_code = 1
                c.logs = (
                    f"ValueError: Free memory on device xpu:0 ({free / 2**30:.2f}/"
                    f"{total / 2**30:.2f} GiB) on startup is less than desired GPU memory "
                    f"utilization ({want / total:.2f}, {want / 2**30:.2f} GiB). Decrease GPU "
                    "memory utilization or reduce GPU memory used by other processes.\n"
                )
        if role == "image":
            self.w.comfy_process_started()
            if c.exits_at_start:
                c.running = False
                c.exit_code = 1

    async def start(self, role: Role) -> None:
        self.w.calls.append(f"start {role}")
        if self.w.container(role).running:
            return  # 304: starting a running container does nothing
        self._really_start(role)

    async def stop(self, role: Role, timeout_seconds: int) -> None:
        self.w.calls.append(f"stop {role}")
        c = self.w.container(role)
        if c.stop_fails:
            raise DockerError(f"Docker Engine POST /containers/{role}/stop answered 500: boom", 500)
        c.restarting = False  # a stop ends a restart policy's loop
        if c.running:  # 304 when it was stopped already: nothing changes
            c.running = False
            c.finished = self.w.clock.now()

    async def restart(self, role: Role, timeout_seconds: int) -> None:
        self.w.calls.append(f"restart {role}")
        c = self.w.container(role)
        if c.stop_fails:
            raise DockerError(f"Docker Engine POST /containers/{role}/restart answered 500", 500)
        c.running = False
        self._really_start(role)

    async def logs_tail(self, role: Role, max_bytes: int, since: str = "") -> str:
        """The real edge's window: the last ``max_bytes`` of the output (UTF-8), from a line's
        start when cut, not the whole log. ``logs`` is the output of the container's last start
        (what ``since`` at its StartedAt selects)."""
        data = self.w.container(role).logs.encode()
        if len(data) > max_bytes:
            data = data[-max_bytes:]
            data = data[data.find(b"\n") + 1 :] if b"\n" in data[:-1] else data
        return data.decode("utf-8", "replace")


class FakeCard:
    """The card data as RecorderFileSource gives it: the newer of the arbiter's last scan and
    the recorder's (its timer scans every ``recorder_every`` seconds; None: no recorder
    file); the arbiter scans only when the newer is older than ``newer_than`` (or there is
    none), so a client that arrived since the last scan is not seen until the next one.  A
    scan is stamped when it starts, as the recorder stamps it; the arbiter's takes
    ``SCAN_SECONDS``."""

    SCAN_SECONDS = 0.0625  # a binary fraction: times stay exact through Docker's time format

    def __init__(self, world: World, recorder_every: float | None = 60.0) -> None:
        self.w = world
        self.recorder_every = recorder_every
        self.reads = 0
        self.scans = 0
        self.view: CardView | None = None
        self.recorder_view: CardView | None = None

    async def read(self, newer_than: float | None = None) -> CardView:
        self.reads += 1
        now = self.w.clock.now()
        every = self.recorder_every
        if every is not None and (
            self.recorder_view is None or now - self.recorder_view.scanned_at >= every
        ):
            self.recorder_view = self.look()
        views = [v for v in (self.view, self.recorder_view) if v is not None]
        newest = max(views, key=lambda v: v.scanned_at) if views else None
        if newest is None or (newer_than is not None and newest.scanned_at < newer_than):
            newest = self.view = self.scan()
            self.scans += 1
        return newest

    def scan(self) -> CardView:
        view = self.look()
        if isinstance(self.w.clock, FakeClock):
            self.w.clock.t += self.SCAN_SECONDS
        return view

    def look(self) -> CardView:
        clients = list(self.w.others)
        llm = self.w.llm
        if (
            llm.running
            or self.w.llm_vram_lingers
            or self.w.clock.now() < llm.finished + self.w.llm_release_seconds
        ):
            clients.append(CardClient(f"vllm/{self.w.llm_service}", self.w.llm_vram(), ("ccs",)))
        if self.w.image.running:
            clients.append(CardClient("comfyui/comfyui", self.w.comfy_now(), ()))
        return CardView(self.w.clock.now(), tuple(clients), self.w.card_total)


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

    async def _arrive(self, call: str) -> None:
        """The call's latency passes (prompts run meanwhile), then the server answers."""
        low, high = self.w.latency
        if high > 0:
            await self.w.clock.sleep(self.w.rng.uniform(low, high))
        if not self.w.image.running:
            raise Unavailable("connection refused")
        self._run()
        if self.w.garbage_next.get(call):
            self.w.garbage_next[call] -= 1
            raise Unavailable(f"{call} answered no JSON: b'<html>Bad Gateway'")

    def _run(self) -> None:
        """Finish the prompts whose time has come: out of the queue, into the history."""
        w = self.w
        now = w.clock.now()
        while w.queue:
            if w.head_since is None:
                w.head_since = now
            done_at = w.head_since + w.durations.get(w.queue[0], w.job_seconds)
            if now < done_at:
                return
            pid = w.queue.pop(0)
            w.history[pid] = self._finished(pid)
            w.head_since = done_at if w.queue else None

    def _finished(self, prompt_id: str) -> dict[str, Any]:
        if self.w.error_next:
            message = self.w.error_next.pop(0)
            return _error_entry(prompt_id, "execution_error", message)
        outputs: dict[str, Any] = {}
        for node_id, node in self.w.prompts[prompt_id].items():
            prefix = node.get("inputs", {}).get("filename_prefix")
            if node.get("class_type") != "SaveImage" or not isinstance(prefix, str):
                continue
            subfolder, _, stem = prefix.rpartition("/")
            counter = 1 + sum(
                1 for sub, name in self.w.files if sub == subfolder and name.startswith(stem + "_")
            )
            filename = f"{stem}_{counter:05}_.png"
            self.w.files[(subfolder, filename)] = PNG + filename.encode()
            self.w.executions[subfolder] += 1
            outputs[node_id] = {
                "images": [{"filename": filename, "subfolder": subfolder, "type": "output"}]
            }
        return {
            "status": {"status_str": "success", "completed": True, "messages": []},
            "outputs": outputs,
        }

    async def ready(self) -> bool:
        return self.w.image.running

    async def upload_image(self, name: str, data: bytes) -> str:
        await self._arrive("upload")
        self.w.uploads[name] = data
        return name

    async def submit(self, workflow: dict[str, Any], prompt_id: str) -> str:
        await self._arrive("prompt")
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
        self.w.freed_at = None  # the prompt loads its models again
        if self.w.hang_next:
            self.w.hang_next -= 1
            self.w.durations[prompt_id] = float("inf")
        elif self.w.job_seconds_range is not None:
            self.w.durations[prompt_id] = self.w.rng.uniform(*self.w.job_seconds_range)
        self.w.queue.append(prompt_id)
        self._run()
        hook, self.w.after_submit = self.w.after_submit, None
        if hook is not None:
            hook(prompt_id)
        return prompt_id

    async def history(self, prompt_id: str) -> dict[str, Any] | None:
        await self._arrive("history")
        return self.w.history.get(prompt_id)

    async def queued(self, prompt_id: str, subfolder: str) -> str | None:
        await self._arrive("queue")
        found = [p for p in self.w.queue if prompt_writes_under(self.w.prompts[p], subfolder)]
        return prompt_id if prompt_id in found else (found[0] if found else None)

    def _view_fault(self) -> bytes | None:
        if self.w.view_not_found:
            self.w.view_not_found -= 1
            raise Rejected("GET /view answered 404", None, 404)
        if self.w.view_not_image:
            self.w.view_not_image -= 1
            return b"<html><body>502 Bad Gateway</body></html>"
        return None

    async def view(self, filename: str, subfolder: str, kind: str) -> bytes:
        await self._arrive("view")
        fault = self._view_fault()
        if fault is not None:
            return fault
        data = self.w.files.get((subfolder, filename))
        if data is None:
            raise Rejected("GET /view answered 404", None, 404)
        return data

    async def saved(self, filename: str, subfolder: str) -> bytes | None:
        await self._arrive("view")
        return self.w.files.get((subfolder, filename))

    async def interrupt(self, prompt_id: str | None = None) -> None:
        await self._arrive("interrupt")
        self.w.interrupts += 1
        if self.w.queue and (prompt_id is None or self.w.queue[0] == prompt_id):
            pid = self.w.queue.pop(0)
            self.w.history[pid] = _error_entry(pid, "execution_interrupted", "")
            self.w.head_since = None

    async def clear_queue(self) -> None:
        await self._arrive("queue_clear")
        del self.w.queue[1:]  # the running prompt stays: only /interrupt stops it

    async def delete_queued(self, prompt_id: str) -> None:
        await self._arrive("queue_delete")
        self.w.queue[1:] = [p for p in self.w.queue[1:] if p != prompt_id]

    async def free(self) -> None:
        await self._arrive("free")
        self.w.calls.append(f"free (queue {len(self.w.queue)})")
        self.w.freed_at = self.w.clock.now() + self.w.free_delay


def _error_entry(prompt_id: str, kind: str, message: str) -> dict[str, Any]:
    data: dict[str, Any] = {"prompt_id": prompt_id, "node_id": "2", "node_type": "KSampler"}
    if kind == "execution_error":
        data.update(exception_message=message, exception_type="RuntimeError")
    return {
        "status": {
            "status_str": "error",
            "completed": False,
            "messages": [["execution_start", {"prompt_id": prompt_id}], [kind, data]],
        },
        "outputs": {},
    }


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
