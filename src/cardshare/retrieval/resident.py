"""What the watchdog (:mod:`cardshare.retrieval.ratchet`) reads of the server's resident memory:
``shmem`` of its cgroup v2 ``memory.stat`` (an integrated GPU), or the resident VRAM of its DRM
clients (a discrete card); and :class:`RatchetError`, what a run cannot do."""

from __future__ import annotations

import os

from cardshare.naming import naming_pid
from cardshare.recorder.procfs import IsDrm, is_drm_char_device
from cardshare.recorder.scan import scan_proc


class RatchetError(Exception):
    """A run that cannot do its job: one line naming what failed (exit 1)."""


def cgroup_v2_path(text: str) -> str | None:
    """The path of the ``0::<path>`` line of a ``/proc/<pid>/cgroup`` text (cgroup v2), or None
    when there is none (a cgroup v1 host)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


def parse_memory_stat(text: str) -> dict[str, int]:
    """``memory.stat`` of a cgroup (``<key> <bytes>`` per line) as a dict.

    Raises ``ValueError`` naming the first line that is not a key and a count.
    """
    out: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"line {number} is not '<key> <count>': {line[:80]!r}")
        out[parts[0]] = int(parts[1])
    return out


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        raise RatchetError(f"cannot read {what} {path}: no such file") from None
    except (OSError, UnicodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RatchetError(f"cannot read {what} {path}: {detail}") from None


def read_cgroup_memory(root: str, pid: int) -> dict[str, int]:
    """``memory.stat`` of the cgroup (v2) of process ``pid``, both files read under ``root``.

    Raises :class:`RatchetError` naming the file: missing or unreadable, no ``0::`` line
    (cgroup v1), the root cgroup (a hybrid host: the memory controller is on v1), or a
    ``memory.stat`` without ``shmem``.
    """
    cgroup_file = os.path.join(root, "proc", str(pid), "cgroup")
    path = cgroup_v2_path(_read_text(cgroup_file, "the server's cgroup file"))
    if path is None:
        raise RatchetError(
            f"{cgroup_file} has no cgroup v2 line (0::<path>): a cgroup v1 host; "
            "--source cgroup needs cgroup v2 (or use --source fdinfo)"
        )
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts:
        raise RatchetError(f"{cgroup_file} names the cgroup {path!r}: not an absolute path")
    if path == "/":
        raise RatchetError(
            f"{cgroup_file} places the server in the root cgroup (0::/): a hybrid cgroup host "
            "keeps the memory controller on v1; --source cgroup needs cgroup v2"
        )
    stat_file = os.path.join(root, "sys", "fs", "cgroup", path.lstrip("/"), "memory.stat")
    text = _read_text(stat_file, "the server's cgroup memory.stat")
    try:
        stat = parse_memory_stat(text)
    except ValueError as exc:
        raise RatchetError(f"cannot parse {stat_file}: {exc}") from None
    if "shmem" not in stat:
        raise RatchetError(f"{stat_file} has no shmem line")
    return stat


def read_fdinfo_resident(
    root: str, container_id: str, is_drm: IsDrm = is_drm_char_device
) -> tuple[int, int]:
    """``(resident VRAM bytes, DRM clients)`` of the container ``container_id``: the DRM
    clients under ``<root>/proc`` whose naming process is in that container (each client
    counted once, whichever of its descriptors and processes were read)."""
    try:
        scan = scan_proc(root, is_drm, every_holder=True)
    except OSError as exc:
        where = os.path.join(root, "proc")
        raise RatchetError(f"cannot scan {where}: {exc.strerror or exc}") from None
    total = 0
    clients = 0
    for client in scan.clients.values():
        proc = scan.processes.get(naming_pid(client.pids, scan.processes))
        if proc is None:
            continue
        if proc.container is not None and proc.container.id == container_id:
            total += client.fdinfo.vram_bytes
            clients += 1
    return total, clients
