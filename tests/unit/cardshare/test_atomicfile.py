"""The one atomic-write helper, shared by the recorder (wrapped in OutputError) and the
arbiter (its store, job inputs and outputs, the storage probe)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cardshare import atomicfile
from cardshare.atomicfile import FileOps, replacing, write_atomic


def enospc_write(fd: int, data: bytes) -> int:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def zero_write(fd: int, data: bytes) -> int:
    return 0


def half_write(fd: int, data: bytes) -> int:
    return os.write(fd, data[: max(1, len(data) // 2)])


def erofs_mkstemp(directory: str, prefix: str) -> tuple[int, str]:
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def exdev_replace(src: str, dst: str) -> None:
    raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))


def test_replaces_with_mode_and_leaves_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "out.png"
    write_atomic(path, b"one")
    write_atomic(path, b"two" * 100_000, mode=0o600)
    assert path.read_bytes() == b"two" * 100_000
    assert path.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["out.png"]


def test_partial_writes_are_continued(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"0123456789", FileOps(write=half_write))
    assert path.read_bytes() == b"0123456789"


def test_make_parents(tmp_path: Path) -> None:
    path = tmp_path / "jobs" / "j1" / "inputs" / "a.png"
    with pytest.raises(FileNotFoundError):
        write_atomic(path, b"x")
    write_atomic(path, b"x", make_parents=True)
    assert path.read_bytes() == b"x"


@pytest.mark.parametrize(
    ("ops", "errno_"),
    [
        (FileOps(write=enospc_write), errno.ENOSPC),
        (FileOps(write=zero_write), 0),
        (FileOps(mkstemp=erofs_mkstemp), errno.EROFS),
        (FileOps(replace=exdev_replace), errno.EXDEV),
    ],
    ids=["write-enospc", "write-no-progress", "mkstemp-erofs", "replace-exdev"],
)
def test_failure_keeps_previous_and_no_temporary_file(
    tmp_path: Path, ops: FileOps, errno_: int
) -> None:
    path = tmp_path / "current.json"
    path.write_bytes(b"previous")
    with pytest.raises(OSError) as info:
        write_atomic(path, b"new", ops)
    assert info.value.errno == errno_
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["current.json"]


def test_replacing_removes_the_temporary_file_on_any_error(tmp_path: Path) -> None:
    path = tmp_path / "archive.gz"

    class Stop(Exception):
        pass

    with pytest.raises(Stop), replacing(path) as fd:
        os.write(fd, b"half")
        raise Stop
    assert os.listdir(tmp_path) == []
    with replacing(path, mode=0o640) as fd:
        os.write(fd, b"whole")
    assert path.read_bytes() == b"whole"
    assert path.stat().st_mode & 0o777 == 0o640


def test_temporary_names_sit_beside_the_target(tmp_path: Path) -> None:
    seen: list[str] = []

    def spy(src: str, dst: str) -> None:
        seen.append(src)
        os.replace(src, dst)

    write_atomic(tmp_path / "state.json", b"{}", FileOps(replace=spy))
    (name,) = (Path(p).name for p in seen)
    assert name.startswith(".state.json.") and name.endswith(atomicfile.TMP_SUFFIX)
    assert Path(seen[0]).parent == tmp_path
