"""A process whose leader thread exited while other threads run keeps its clients.

After ``pthread_exit()`` in ``main`` the thread group's leader is a zombie: on the real kernel
its ``/proc/<pid>/fd`` lists empty, its ``ns/mnt`` is gone and ``kcmp`` on its pid answers
``EBADF``, while a live thread holds every descriptor (checked by the first test).  The scan
reads them under ``task/<tid>/`` and records the client under the process's pid.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_recorder_scan_reuse import standin_opener

from cardshare.recorder.procfs import leader_exited, parse_stat
from cardshare.recorder.scan import scan_proc

PDEV = "0000:03:00.0"


def _state(pid: int) -> bytes:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rfind(b")") + 2 :].split()[0]


@pytest.fixture
def zombie_leader(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A forked child holding two descriptors (one open file, ``dup()``-ed) of a stand-in
    file, whose main thread has called ``pthread_exit()`` while a second thread waits."""
    standin = tmp_path / "standin-node"
    standin.write_text("a DRM node stand-in\n")
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(hold_w)
            fd = os.open(standin, os.O_RDONLY)
            os.dup(fd)

            def hold() -> None:
                os.read(hold_r, 1)  # until the test closes its end
                os._exit(0)

            threading.Thread(target=hold).start()
            ctypes.CDLL(None).pthread_exit(None)
        finally:
            os._exit(1)  # never back into pytest from a forked child
    os.close(hold_r)
    try:
        deadline = time.monotonic() + 10
        while _state(pid) != b"Z" or len(os.listdir(f"/proc/{pid}/task")) != 2:
            assert time.monotonic() < deadline, "the leader never exited"
            time.sleep(0.01)
        yield pid, standin
    finally:
        os.close(hold_w)
        os.waitpid(pid, 0)


def test_the_kernel_shows_a_zombie_leaders_descriptors_only_under_its_threads(
    zombie_leader: tuple[int, Path],
) -> None:
    pid, standin = zombie_leader
    (tid,) = (int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert os.listdir(f"/proc/{pid}/fd") == []
    held = [
        os.readlink(f"/proc/{pid}/task/{tid}/fd/{fd}")
        for fd in os.listdir(f"/proc/{pid}/task/{tid}/fd")
    ]
    assert held.count(str(standin)) == 2
    with pytest.raises(FileNotFoundError):
        os.readlink(f"/proc/{pid}/ns/mnt")
    assert leader_exited(Path(f"/proc/{pid}/stat").read_bytes())
    assert not leader_exited(Path(f"/proc/{tid}/stat").read_bytes())
    assert not leader_exited(Path("/proc/self/stat").read_bytes())


@pytest.mark.parametrize(("compare", "reads", "saved"), [("auto", 1, 1), ("off", 2, 0)])
def test_a_zombie_leaders_clients_are_found_under_its_live_thread(
    zombie_leader: tuple[int, Path],
    tmp_path: Path,
    rec_make_fdinfo: Callable[..., str],
    compare: str,
    reads: int,
    saved: int,
) -> None:
    pid, standin = zombie_leader
    target = standin.stat()

    def is_standin(st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)

    # simulation at the fdinfo edge: the stand-in's fdinfo read as an xe client's
    opener = standin_opener({target.st_ino: rec_make_fdinfo(77, PDEV, vram="24 MiB")})
    scan = scan_proc("/", is_standin, opener=opener, compare=compare)  # type: ignore[arg-type]
    if compare == "auto" and scan.dedupe != "kcmp":
        pytest.skip(f"kcmp is refused here (dedupe {scan.dedupe})")
    client = scan.clients[(PDEV, 77)]
    assert (client.pids, client.descriptors) == ({pid}, 2)
    record = scan.processes[pid]
    stat_now = parse_stat(Path(f"/proc/{pid}/stat").read_bytes())
    assert stat_now is not None
    assert (record.comm, record.start_time) == stat_now
    st = scan.stats
    assert (st.drm_descriptors, st.fdinfo_reads, st.fdinfo_reads_saved) == (2, reads, saved)
