"""The database and data directory edge: the arbiter runs in a private mount namespace
(``unshare -m``) with its data directory on a 16 MiB tmpfs, which the test fills from
outside through ``/proc/<pid>/root``: free space below ``min_free_bytes``, and a real ENOSPC
while a job's outputs are written. Skipped where a tmpfs cannot be mounted."""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from batch import Batch, Case, Record, Worker
from rig import AUTH, WORKFLOW, Rig
from scenario import Scenario, run_scenario

SIZE = 16 << 20
MIN_FREE = 4 << 20


def _tmpfs_possible() -> bool:
    try:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o size=1m tmpfs /mnt && umount /mnt"],
            capture_output=True,
            timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(not _tmpfs_possible(), reason="cannot mount a tmpfs (unshare -m)"),
]


def tmpfs_rig(worker: Worker, **settings: object) -> Rig:
    rig = worker.fresh(start=False, config={"min_free_bytes": MIN_FREE}, settings=settings)
    script = f'mkdir -p "$0" && mount -t tmpfs -o size={SIZE} tmpfs "$0" && exec "$@"'
    rig.wrapper = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        str(rig.data_dir),
    ]
    return rig.start()


def data_dir(rig: Rig) -> Path:
    assert rig.arbiter is not None
    return Path(f"/proc/{rig.arbiter.pid}/root") / str(rig.data_dir).lstrip("/")


def fill(rig: Rig, leave: int) -> int:
    """Fill the arbiter's data directory until ``leave`` bytes are free (0: until ENOSPC)."""
    base = data_dir(rig)
    chunk = b"\0" * 65536
    with open(base / "filler", "ab") as fh:
        while True:
            free = shutil.disk_usage(base).free
            if free <= leave:
                break
            try:
                fh.write(chunk[: max(4096, min(len(chunk), free - leave))])
                fh.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    return shutil.disk_usage(base).free


def free(rig: Rig) -> None:
    with contextlib.suppress(FileNotFoundError):
        (data_dir(rig) / "filler").unlink()


def post_job(rig: Rig) -> tuple[int, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", rig.ports["arbiter"], timeout=5)
    try:
        conn.request(
            "POST",
            "/v1/jobs",
            body=json.dumps({"workflow": WORKFLOW}),
            headers={**AUTH, "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    if resp.status == 201:
        rig.jobs[body["id"]] = time.time()
    return resp.status, resp.getheader("Retry-After")


def alert(rig: Rig, name: str) -> bool:
    return any(a["name"] == name for a in rig.status()["alerts"])


def low_free_space_refuses_jobs(worker: Worker, record: Record, name: str) -> None:
    """Below min_free_bytes: the storage alert, POST /v1/jobs 503 with Retry-After; once
    space is back jobs are taken and run."""
    rig = tmpfs_rig(worker)
    start = time.time()
    left = fill(rig, MIN_FREE // 2)
    assert left < MIN_FREE
    rig.wait(lambda: alert(rig, "storage"), 5, "the storage alert")
    status, retry_after = post_job(rig)
    assert (status, retry_after is not None) == (503, True)
    assert "storage" in rig.alerts_up()
    assert (
        rig.metric_samples()[("cardshare_arbiter_faults_total", frozenset({("kind", "storage")}))]
        >= 1
    )
    free(rig)
    rig.wait(lambda: not alert(rig, "storage"), 5, "the storage alert cleared")
    sc = Scenario((), "serve_llm (disk low)", alerts=("storage",))
    run_scenario(rig, sc, record, name, since=start)


def enospc_while_storing_outputs(worker: Worker, record: Record, name: str) -> None:
    """The disk fills up (ENOSPC) while ComfyUI runs a job: the outputs cannot be written;
    jobs pause with the storage alert; once space is back the job ends done, run once."""
    rig = tmpfs_rig(worker, comfyui_job_seconds=1.0)
    start = time.time()
    rig.submit(2)
    rig.wait(rig.executing, 15, "ComfyUI runs the first job")
    assert fill(rig, 0) < 4096
    rig.wait(lambda: alert(rig, "storage"), 5, "the storage alert")
    assert post_job(rig)[0] == 503
    time.sleep(1.5)  # the job has finished in ComfyUI meanwhile
    free(rig)
    sc = Scenario((), "run_jobs (ENOSPC)", jobs=0, alerts=("storage",))
    run_scenario(rig, sc, record, name, since=start)


def low_disk_in_image_mode_hands_back(worker: Worker, record: Record, name: str) -> None:
    """The data directory runs low (below min_free_bytes, still room for the database) while
    in image mode. Jobs pause; expected: the card goes back to vLLM meanwhile instead of
    staying with an idle ComfyUI for as long as the disk stays low."""
    rig = tmpfs_rig(worker, comfyui_job_seconds=0.5)
    start = time.time()
    rig.submit(3)
    rig.wait(rig.executing, 15, "ComfyUI runs a job")
    fill(rig, MIN_FREE // 2)
    rig.wait(lambda: alert(rig, "storage"), 5, "the storage alert")
    try:
        rig.wait(lambda: rig.status()["mode"] == "llm", 10, "mode llm while the disk is low")
        got_llm = True
    except AssertionError:
        got_llm = False
    phase = rig.status()["phase"]
    free(rig)
    sc = Scenario((), "run_jobs (disk low)", jobs=0, alerts=("storage",))
    run_scenario(
        rig,
        sc,
        record,
        name,
        since=start,
        checks=(
            lambda: (
                None
                if got_llm
                else f"still in {phase} with vLLM stopped 10 s after the disk ran low"
            ),
        ),
    )


def safe_state(rig: Rig) -> bool:
    """vLLM serving and ComfyUI stopped (the queue may hold jobs: they wait for the disk)."""
    st = rig.status()
    c = rig.docker.containers()
    return (
        st["mode"] == "llm"
        and c["vllm"]["running"]
        and not c["comfyui"]["running"]
        and rig.vllm_healthy()
    )


def _store_fails_in_image_mode(
    worker: Worker, record: Record, name: str, how: str, heal: Callable[[Rig], None]
) -> None:
    """The database cannot be written while ComfyUI runs a job (no transition can be
    persisted). Expected: the card goes back to vLLM anyway (the safe state), new jobs are
    refused with a 503, the storage alert; once storage heals the jobs run, once."""
    rig = tmpfs_rig(worker, comfyui_job_seconds=0.5)
    start = time.time()
    rig.submit(3)
    rig.wait(rig.executing, 15, "ComfyUI runs a job")
    fill(rig, 0)
    failed_at = time.time()
    try:
        rig.wait(lambda: safe_state(rig), 20, "vLLM serving while the data directory fails")
        in_llm: float | None = time.time() - failed_at
    except AssertionError:
        in_llm = None
    phase = rig.status()["phase"]
    refused = post_job(rig)
    storage_alert = alert(rig, "storage")
    time.sleep(1.0)
    heal(rig)
    sc = Scenario((), f"run_jobs ({how})", jobs=0, alerts=("storage",))
    run_scenario(
        rig,
        sc,
        record,
        name,
        since=start,
        checks=(
            lambda: (
                None
                if in_llm is not None
                else f"still in {phase} (vLLM not serving) 20 s after the data directory failed"
            ),
            lambda: None if refused[0] == 503 else f"POST /v1/jobs answered {refused[0]}, not 503",
            lambda: None if storage_alert else "no storage alert while it failed",
        ),
    )
    print(f"{name}: vLLM serving {in_llm} s after the data directory failed")


def full_at_once_in_image_mode_falls_back(worker: Worker, record: Record, name: str) -> None:
    """The disk fills up at once (ENOSPC: SQLite answers "database or disk is full") while
    ComfyUI runs a job. (A read-only remount of the tmpfs is refused while SQLite holds its
    files open for writing: the read-only database is tried in the unit tests.)"""
    _store_fails_in_image_mode(worker, record, name, "full", free)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(Case(low_free_space_refuses_jobs, 4.0), id="low-free-space"),
        pytest.param(Case(enospc_while_storing_outputs, 6.0), id="enospc-storing-outputs"),
        pytest.param(Case(low_disk_in_image_mode_hands_back, 14.0), id="low-disk-in-image-mode"),
        pytest.param(Case(full_at_once_in_image_mode_falls_back, 14.0), id="full-in-image-mode"),
    ],
)
def test_storage_fault(batch: Batch, request: pytest.FixtureRequest, case: Case) -> None:
    batch.check(request.node)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_deleted_or_replaced_under_the_arbiter_is_noticed(
    fresh: Callable[..., Rig], record: Callable[..., None], how: str
) -> None:
    """The database file is deleted (or replaced by another file) while the arbiter runs: it
    went on writing into a file nobody could open again, took jobs, and said healthy until a
    restart. Now its heartbeat checks the file's identity: unhealthy (so that its supervisor
    restarts it, and the start refuses a lost database naming the fix), the storage alert,
    new jobs refused with a 503."""
    rig = fresh()
    rig.wait_llm(30.0)
    db = rig.data_dir / "arbiter.sqlite3"
    assert db.exists()
    if how == "deleted":
        db.unlink()
    else:
        tmp = db.with_name(".replacement")
        shutil.copyfile(db, tmp)
        tmp.replace(db)
    gone = time.time()

    def noticed() -> bool:
        return rig.api.request("GET", "/v1/health")[0] == 503

    seen: float | None = None
    with contextlib.suppress(AssertionError):
        seen = rig.wait(noticed, 10.0, "the health check fails")
    status, doc = rig.api.request("GET", "/v1/health")
    refused = post_job(rig)[0]
    record(
        fault=f"the database file {how} under the running arbiter",
        phase="serve_llm",
        back_to_llm=None if seen is None else round(time.time() - gone, 1),
        alerts="storage" if alert(rig, "storage") else "",
        extra=f"health {status}: {doc.get('health', '') if isinstance(doc, dict) else doc}",
        result="ok" if seen is not None and refused == 503 else "FAILED",
    )
    assert seen is not None, "still healthy 10 s after the database file was " + how
    assert "arbiter.sqlite3" in doc["health"] and how in doc["health"], doc
    assert refused == 503
    assert alert(rig, "storage")
