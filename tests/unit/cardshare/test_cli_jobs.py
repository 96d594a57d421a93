"""The arbiter verbs of the ``cardshare`` command line (``status``, ``job submit|show|outputs|
cancel``) against the real arbiter app: ``build_app`` and an ``Engine`` on 127.0.0.1 with the
integration tests' fake vLLM, ComfyUI and proxy apps (real HTTP) and an in-memory Docker.

The CLI is synchronous (``urllib``): each call runs ``main()`` in a thread while the test's
event loop serves the arbiter."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arbiter"))

from aiohttp.test_utils import TestClient
from arbiter_fakes import (
    PNG,
    WORKFLOW,
    World,
)
from test_integration import TOKEN as INTEGRATION_TOKEN
from test_integration import running_arbiter

from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.common import RealClock
from cardshare.arbiter.engine import Engine
from cardshare.cli import arbiter as cli_arbiter
from cardshare.cli import main

ROOT = Path(__file__).resolve().parents[3]
TOKEN = INTEGRATION_TOKEN  # the token the running arbiter was given
Result = tuple[int, str, str]


class Box:
    """The arbiter on 127.0.0.1, its engine and world, and the CLI pointed at it."""

    def __init__(
        self,
        client: TestClient[Any, Any],
        engine: Engine,
        world: World,
        tmp: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        self.client = client
        self.engine = engine
        self.world = world
        self.tmp = tmp
        self.capsys = capsys
        self.url = str(client.make_url("")).rstrip("/")
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.workflow = tmp / "workflow.json"
        self.workflow.write_text(json.dumps(WORKFLOW))
        self.image = tmp / "in.png"
        self.image.write_bytes(PNG + b"input")

    async def cli(
        self, *argv: str, token_file: Path | None = None, url: str | None = None
    ) -> Result:
        """``cardshare ARGV --arbiter URL --token-file TOKEN``: (exit code, stdout, stderr)."""
        full = [*argv, "--arbiter", url or self.url]
        full += ["--token-file", str(token_file or self.token_file)]
        return await self.run(full)

    async def run(self, argv: list[str]) -> Result:
        code = await asyncio.to_thread(main, argv)
        out = self.capsys.readouterr()
        return code, out.out, out.err

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, self.engine.last_decision
            await asyncio.sleep(0.02)

    def veto(self) -> None:
        """Another client on the card: jobs stay queued."""
        self.world.others.append(CardClient("plex", 1, ()))

    async def submit(self) -> str:
        code, out, err = await self.cli("job", "submit", str(self.workflow))
        assert (code, err) == (0, "")
        return out.strip()


@pytest.fixture
async def box(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> AsyncIterator[Box]:
    world = World(RealClock())  # type: ignore[arg-type]
    async with running_arbiter(tmp_path, world, host="127.0.0.1") as (client, engine):
        yield Box(client, engine, world, tmp_path, capsys)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the whole path ---------------------------------------------------------------------------


async def test_submit_with_image_wait_outputs_show(box: Box) -> None:
    code, out, err = await box.cli(
        "job", "submit", str(box.workflow), "--image", str(box.image), "--wait"
    )
    assert code == 0, err
    job_id = out.split("\n")[0].removeprefix("job ").removesuffix(": done")
    assert len(job_id) == 32
    # the image reached ComfyUI under the arbiter's name for it; the workflow points there
    assert box.world.uploads[f"cardshare-{job_id}-in.png"] == PNG + b"input"
    prompt = next(iter(box.world.prompts.values()))
    assert prompt["1"]["inputs"]["image"] == f"cardshare-{job_id}-in.png"
    assert err.splitlines()[0] == f"job {job_id}: queued"
    assert err.splitlines()[-1] == f"job {job_id}: done"
    lines = out.splitlines()
    assert lines[1:3] == ["  reason:    -", "  attempts:  1"]
    assert lines[-1] == f"  outputs:   1 (cardshare job outputs {job_id} --to DIR)"

    target = box.tmp / "out" / "new"
    code, out, err = await box.cli("job", "outputs", job_id, "--to", str(target))
    png = target / f"{job_id}-0.png"
    assert (code, out, err) == (0, f"wrote {png} ({len(png.read_bytes())} bytes)\n", "")
    assert png.read_bytes().startswith(PNG)
    assert sorted(p.name for p in target.iterdir()) == [png.name]  # no temporary file left

    code, out, err = await box.cli("job", "outputs", job_id, "--to", str(target), "--json")
    assert (code, json.loads(out), err) == (0, {"id": job_id, "files": [str(png)]}, "")

    code, out, _ = await box.cli("job", "show", job_id, "--json")
    doc = json.loads(out)
    assert (code, doc["state"], doc["attempts"], doc["outputs"]) == (
        0,
        "done",
        1,
        [f"/v1/jobs/{job_id}/outputs/0"],
    )
    code, text, _ = await box.cli("job", "show", job_id)
    assert (code, text) == (0, cli_arbiter.format_job(doc))


async def test_submit_prints_the_id_or_the_json(box: Box) -> None:
    box.veto()
    code, out, err = await box.cli("job", "submit", str(box.workflow))
    assert (code, err) == (0, "")
    assert box.engine.store.job(out.strip()) is not None
    assert out == out.strip() + "\n"
    code, out, err = await box.cli("job", "submit", str(box.workflow), "--json")
    assert (code, err) == (0, "")
    assert box.engine.store.job(json.loads(out)["id"]) is not None


@pytest.mark.parametrize("name", ["bild-ä.png", 'a"b.png', "with space.png"])
async def test_image_names_travel_as_given(box: Box, name: str) -> None:
    image = box.tmp / name
    image.write_bytes(PNG)
    workflow = box.tmp / "named.json"
    wf = json.loads(json.dumps(WORKFLOW))
    wf["1"]["inputs"]["image"] = name
    workflow.write_text(json.dumps(wf))
    code, out, err = await box.cli("job", "submit", str(workflow), "--image", str(image), "--wait")
    assert code == 0, err
    job_id = out.split("\n")[0].split()[1].rstrip(":")
    job = box.engine.store.job(job_id)
    assert job is not None and job.inputs == (name,)
    # the arbiter's own upload to ComfyUI may encode the name; the workflow follows it
    [(uploaded, data)] = box.world.uploads.items()
    assert data == PNG
    assert next(iter(box.world.prompts.values()))["1"]["inputs"]["image"] == uploaded


# -- cancel -----------------------------------------------------------------------------------


async def test_cancel_queued_then_ended_is_409(box: Box) -> None:
    box.veto()
    job_id = await box.submit()
    assert await box.cli("job", "cancel", job_id) == (
        0,
        f"job {job_id} cancelled (it was queued)\n",
        "",
    )
    code, out, err = await box.cli("job", "cancel", job_id)
    assert (code, out) == (1, "")
    assert err == (
        f"cardshare: error: the arbiter answered 409 to DELETE /v1/jobs/{job_id}: "
        "job is cancelled: it has ended and cannot be cancelled\n"
    )
    code, out, _ = await box.cli("job", "show", job_id)
    assert out.splitlines()[:2] == [f"job {job_id}: cancelled", "  reason:    cancelled by request"]


async def test_cancel_running_is_202_and_wait_exits_1(box: Box) -> None:
    box.world.hang_next = 1  # the prompt runs until interrupted
    waiting = asyncio.ensure_future(
        asyncio.to_thread(
            main,
            [
                "job",
                "submit",
                str(box.workflow),
                "--wait",
                "--json",
                "--arbiter",
                box.url,
                "--token-file",
                str(box.token_file),
            ],
        )
    )
    await box.wait_for(lambda: box.engine.jobs.current_job is not None)
    job_id = box.engine.jobs.current_job
    assert job_id is not None
    cancel = await asyncio.to_thread(
        main,
        ["job", "cancel", job_id, "--arbiter", box.url, "--token-file", str(box.token_file)],
    )
    assert cancel == 0
    assert await waiting == 1
    out = box.capsys.readouterr()
    cancel_line = (
        f"job {job_id} is running: cancel requested; the arbiter interrupts its prompt and "
        f"ends it (`cardshare job show {job_id}`)\n"
    )
    assert out.out.startswith(cancel_line)
    final = json.loads(out.out.removeprefix(cancel_line))
    assert (final["state"], final["reason"]) == ("cancelled", "cancelled by request while running")
    err = out.err.splitlines()
    assert err[-2:] == [
        f"job {job_id}: cancelled, cancel requested",
        f"cardshare: error: job {job_id} cancelled: cancelled by request while running",
    ]
    assert box.world.interrupts == 1


async def test_wait_timeout_leaves_the_job_queued(box: Box) -> None:
    box.veto()
    code, out, err = await box.cli("job", "submit", str(box.workflow), "--wait", "--timeout", "0.5")
    job_id = err.split()[1].rstrip(":")
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"job {job_id}: queued",
        f"cardshare: error: job {job_id} is still queued after 0.5 s; it stays on the arbiter: "
        f"`cardshare job show {job_id}`, or `cardshare job cancel {job_id}`",
    ]
    assert box.engine.store.queue_length() == 1


async def test_outputs_of_a_queued_job(box: Box) -> None:
    box.veto()
    job_id = await box.submit()
    code, out, err = await box.cli("job", "outputs", job_id, "--to", str(box.tmp / "o"))
    assert (code, out, err) == (
        1,
        "",
        f"cardshare: error: job {job_id} is queued: only a done job has outputs; wait for it: "
        f"`cardshare job show {job_id}`\n",
    )
    assert not (box.tmp / "o").exists()


# -- status -----------------------------------------------------------------------------------


async def test_status_text_and_json(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    box.world.hang_next = 1
    job_id = await box.submit()
    await box.wait_for(lambda: box.engine.jobs.current_job == job_id)
    code, out, err = await box.cli("status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"arbiter {box.url}"
    assert lines[1].startswith("mode:      image since ")
    assert lines[2].startswith("phase:     run_jobs since ")
    assert lines[3] == f"jobs:      1 queued or running; running: {job_id}"
    assert lines[4].startswith("engine:    healthy: heartbeat ")
    assert lines[5:7] == ["faults:    none", "hold:      none"]
    assert "alerts:    none" in lines
    assert lines[-2:-1] == ["swaps:     last 1"]
    assert lines[-1].startswith("  to_image at ") and lines[-1].endswith(" ok")

    code, out, err = await box.cli("status", "--json")
    doc = json.loads(out)
    assert (code, err, doc["mode"], doc["current_job"]) == (0, "", "image", job_id)

    # without the token (the default file unreadable): the open view, the job's id hidden
    monkeypatch.setattr(cli_arbiter, "DEFAULT_TOKEN_FILE", str(box.tmp / "absent"))
    code, out, err = await box.run(["status", "--arbiter", box.url])
    assert (code, err) == (0, "")
    assert out.splitlines()[3] == (
        "jobs:      1 queued or running; running: a job (its id needs the token: run as root "
        "or pass --token-file)"
    )
    code, out, _ = await box.run(["status", "--arbiter", box.url, "--json"])
    assert (code, json.loads(out)["current_job"]) == (0, None)


async def test_status_address_from_the_environment(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli_arbiter.ARBITER_URL_ENV, box.url + "/")
    code, out, err = await box.run(["status", "--token-file", str(box.token_file)])
    assert (code, err, out.splitlines()[0]) == (0, "", f"arbiter {box.url}")
    monkeypatch.setenv(cli_arbiter.ARBITER_URL_ENV, "localhost:8090")
    assert await box.run(["status"]) == (
        2,
        "",
        f"cardshare: error: {cli_arbiter.ARBITER_URL_ENV}: expected the arbiter's address as "
        "http://HOST:PORT, got 'localhost:8090'\n",
    )


def test_format_status_of_a_swap_to_image() -> None:
    doc = {
        "mode": "swapping",
        "since": 1000.0,
        "phase": "wait_llm_release",
        "phase_since": 1030.0,
        "queue_length": 2,
        "job_running": False,
        "current_job": None,
        "engine": {
            "healthy": False,
            "health": "the engine's heartbeat is 200 s old",
            "faults": {"docker": 0, "engine_error": 2},
        },
        "hold": {"holder": "comfyui-probe", "until": 1100.0},
        "decision": {"go": True, "reasons": []},
        "card": {
            "scanned_at": 1035.0,
            "age_seconds": 5.0,
            "clients": [
                {"name": "vllm", "vram_bytes": 27 * 2**30, "busy_engines": []},
                {"name": "plex", "vram_bytes": 2**30, "busy_engines": ["vcs", "vecs"]},
            ],
        },
        "alerts": [{"name": "llm_release_timeout", "message": "vLLM's memory stayed"}],
        "swaps": [
            {"direction": "to_image", "started": 1000.0, "total_seconds": None, "ok": None},
            {"direction": "to_llm", "started": 500.0, "total_seconds": 95.5, "ok": False},
        ],
    }
    assert cli_arbiter.format_status(doc, "http://127.0.0.1:8090", 1040.0, authorized=True) == (
        "arbiter http://127.0.0.1:8090\n"
        "mode:      swapping since 1970-01-01T00:16:40Z (40.0 s ago)\n"
        "phase:     wait_llm_release since 1970-01-01T00:17:10Z (10.0 s ago)\n"
        "jobs:      2 queued or running; running: none\n"
        "engine:    UNHEALTHY: the engine's heartbeat is 200 s old\n"
        "faults:    engine_error=2\n"
        "hold:      swaps held by comfyui-probe until 1970-01-01T00:18:20Z\n"
        "to image:  go\n"
        "card:      scanned 5.0 s ago: vllm 27.00 GiB, plex 1.00 GiB (vcs vecs busy)\n"
        "alerts:    1\n"
        "  llm_release_timeout: vLLM's memory stayed\n"
        "swaps:     last 2\n"
        "  to_image at 1970-01-01T00:16:40Z: in progress\n"
        "  to_llm at 1970-01-01T00:08:20Z: took 1 min 35 s FAILED\n"
    )


# -- errors -----------------------------------------------------------------------------------


async def test_no_token_file(box: Box) -> None:
    missing = box.tmp / "nope" / "token"
    assert await box.cli("job", "show", "x", token_file=missing) == (
        1,
        "",
        f"cardshare: error: cannot read the arbiter's token {missing}: no such file; apply the "
        "arbiter role to this host (it creates the token) or pass --token-file PATH\n",
    )
    # an explicit --token-file must be readable for status too
    code, _, err = await box.cli("status", token_file=missing)
    assert (code, err.startswith("cardshare: error: cannot read the arbiter's token")) == (1, True)


async def test_unreadable_token_file(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    # the tests may run as root, which reads any file: the denial is simulated
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == box.token_file:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert await box.cli("job", "submit", str(box.workflow)) == (
        1,
        "",
        f"cardshare: error: cannot read the arbiter's token {box.token_file}: permission "
        "denied; run as root (sudo cardshare ...) or pass --token-file PATH\n",
    )


async def test_wrong_token_is_401(box: Box) -> None:
    wrong = box.tmp / "wrong"
    wrong.write_text("not-the-arbiters-token\n")
    assert await box.cli("job", "show", "abc", token_file=wrong) == (
        1,
        "",
        "cardshare: error: the arbiter answered 401 to GET /v1/jobs/abc: missing or wrong "
        f"bearer token; the token in {wrong} is not the arbiter's: pass --token-file with the "
        "file the arbiter reads (the role's arbiter_token_file)\n",
    )


async def test_arbiter_down(box: Box) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    expected = (
        f"cardshare: error: cannot reach the arbiter at {url}: connection refused; is it "
        "running? check `docker compose -p arbiter ps` on the host, or give its address with "
        "--arbiter URL or CARDSHARE_ARBITER_URL\n"
    )
    assert await box.cli("status", url=url) == (1, "", expected)
    assert await box.cli("job", "cancel", "x", url=url) == (1, "", expected)


def test_wait_gives_up_when_the_arbiter_stays_down() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    arbiter = cli_arbiter.Arbiter(url, TOKEN, Path("/t"))
    now = [0.0]
    progress = io.StringIO()

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 1.0)

    with pytest.raises(cli_arbiter.ArbiterError) as info:
        cli_arbiter.wait_for_job(arbiter, "j1", None, progress, clock=lambda: now[0], sleep=sleep)
    assert str(info.value).startswith(f"cannot reach the arbiter at {url}: connection refused")
    assert str(info.value).endswith("CARDSHARE_ARBITER_URL (for 60 s)")
    assert progress.getvalue() == "job j1: the arbiter does not answer, still waiting\n"


@pytest.mark.parametrize(
    ("workflow", "error"),
    [
        (
            {"1": {"class_type": "PreviewImage", "inputs": {}}},
            "the arbiter answered 400 to POST /v1/jobs: workflow has no save node (SaveImage, "
            "or a node with a filename_prefix input): the arbiter returns saved images only",
        ),
        (
            {"1": {"inputs": {}}},
            "the arbiter answered 400 to POST /v1/jobs: workflow node '1' has no class_type "
            "(use the API format)",
        ),
        (
            {"2": {"class_type": "SaveImage", "inputs": {"pad": "x" * 5000}}},
            "the arbiter answered 413 to POST /v1/jobs: Maximum request body size 4096 "
            "exceeded; the workflow and its images exceed the arbiter's max_payload_bytes",
        ),
        (
            {"nodes": [], "links": []},
            "{wf} is a workflow in ComfyUI's UI format: export it in the API format (ComfyUI: "
            "Workflow > Export (API))",
        ),
        ([1], "{wf} holds a JSON list, not a ComfyUI API-format workflow object"),
    ],
    ids=["no-save-node", "no-class-type", "too-large", "ui-format", "not-an-object"],
)
async def test_refused_workflows(box: Box, workflow: Any, error: str) -> None:
    box.workflow.write_text(json.dumps(workflow))
    code, out, err = await box.cli("job", "submit", str(box.workflow))
    assert (code, out) == (1, "")
    assert err.startswith("cardshare: error: " + error.format(wf=box.workflow)), err
    assert box.engine.store.queue_length() == 0


async def test_large_image_is_413_not_a_broken_connection(box: Box) -> None:
    big = box.tmp / "big.png"
    big.write_bytes(PNG + bytes(4 * 2**20))
    code, out, err = await box.cli("job", "submit", str(box.workflow), "--image", str(big))
    assert (code, out) == (1, "")
    assert err.startswith("cardshare: error: the arbiter answered 413 to POST /v1/jobs: "), err


async def test_storage_refusal_says_when_to_retry(
    box: Box, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the data directory really short of space, as the engine's own check sees it (an alert
    # set by hand would be cleared by the engine's next look at the directory)
    monkeypatch.setattr(box.engine, "storage_problem", lambda: "/data has 1 MiB free")
    await box.wait_for(lambda: "storage" in box.engine.alerts)
    assert await box.cli("job", "submit", str(box.workflow)) == (
        1,
        "",
        "cardshare: error: the arbiter answered 503 to POST /v1/jobs: the arbiter cannot store "
        "jobs now: /data has 1 MiB free; jobs are paused and new ones refused; retry after 1 s\n",
    )


async def test_unknown_job_is_404(box: Box) -> None:
    assert await box.cli("job", "show", "nope/../x") == (
        1,
        "",
        "cardshare: error: the arbiter answered 404 to GET /v1/jobs/nope%2F..%2Fx: no such job\n",
    )


async def test_bad_files_and_usage(box: Box) -> None:
    box.workflow.write_text("{not json")
    code, _, err = await box.cli("job", "submit", str(box.workflow))
    assert (code, err) == (
        1,
        f"cardshare: error: {box.workflow} is not JSON: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)\n",
    )
    box.workflow.write_text(json.dumps(WORKFLOW))
    other = box.tmp / "other"
    other.mkdir()
    (other / "in.png").write_bytes(PNG)
    code, _, err = await box.cli(
        "job",
        "submit",
        str(box.workflow),
        "--image",
        str(box.image),
        "--image",
        str(other / "in.png"),
    )
    assert (code, err) == (
        2,
        f"cardshare: error: --image {other / 'in.png'}: another image is named 'in.png' too; "
        "the workflow names its inputs by file name, so rename one\n",
    )
    code, _, err = await box.cli("job", "submit", str(box.workflow), "--timeout", "5")
    assert (code, err) == (
        2,
        "cardshare: error: --timeout applies to --wait: add --wait or drop --timeout\n",
    )
    code, _, err = await box.cli("job", "submit", str(box.tmp / "absent.json"))
    assert (code, err) == (
        1,
        f"cardshare: error: {box.tmp / 'absent.json'} No such file or directory\n",
    )
    code, _, err = await box.run(["job"])
    assert code == 2 and err.endswith("error: the following arguments are required: VERB\n")
    code, _, err = await box.run(["job", "outputs", "x"])
    assert code == 2 and err.endswith("error: the following arguments are required: --to\n")
    assert box.engine.store.queue_length() == 0


# -- the zipapp carries the verbs -------------------------------------------------------------


async def test_zipapp_status_and_show(box: Box) -> None:
    pyz = box.tmp / "cardshare.pyz"
    build = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tools" / "build_zipapp.py"), str(pyz)
    )
    assert await build.wait() == 0
    box.veto()
    job_id = await box.submit()

    async def pyz_run(*argv: str) -> tuple[int, bytes]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(pyz),
            *argv,
            "--arbiter",
            box.url,
            "--token-file",
            str(box.token_file),
            "--json",
            stdout=asyncio.subprocess.PIPE,
            env={},
        )
        out, _ = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out

    code, out = await pyz_run("status")
    assert (code, json.loads(out)["queue_length"]) == (0, 1)
    code, out = await pyz_run("job", "show", job_id)
    assert (code, json.loads(out)["state"]) == (0, "queued")
