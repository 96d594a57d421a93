"""Durable outputs of the recorder: atomic files, whole history lines, textfile, retention.

Every failure raises :class:`OutputError` whose message names the path and the reason, e.g.
``cannot write /var/lib/cardshare/current.json: No space left on device``.  A failed atomic
write leaves the previous file untouched; a failed history append truncates the file back to
its previous length, so the history never holds a partial line.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FileOps",
    "OutputError",
    "append_line",
    "atomic_write",
    "ensure_dir",
    "expired_history",
    "history_path",
    "prometheus_text",
    "prune_history",
]

_HISTORY_RE = re.compile(r"^([0-9]{4})-([0-9]{2})\.jsonl$")


class OutputError(Exception):
    """An output could not be written; the message names the path."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _mkstemp(directory: str, prefix: str) -> tuple[int, str]:
    return tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")


@dataclass(frozen=True, slots=True)
class FileOps:
    """The system calls the writers use; tests replace some to simulate a full disk."""

    write: Callable[[int, bytes], int] = os.write
    mkstemp: Callable[[str, str], tuple[int, str]] = field(default=_mkstemp)
    replace: Callable[[str, str], None] = os.replace


DEFAULT_OPS = FileOps()


def ensure_dir(path: Path) -> None:
    """Create a directory (and parents) or raise ``OutputError`` naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create directory {path}: {_reason(exc)}") from None


def _write_all(fd: int, data: bytes, ops: FileOps) -> None:
    view = memoryview(data)
    while view:
        n = ops.write(fd, view.tobytes())
        if n <= 0:
            raise OSError(0, "short write")
        view = view[n:]


def atomic_write(path: Path, data: bytes, ops: FileOps = DEFAULT_OPS, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename."""
    directory = str(path.parent)
    try:
        fd, tmp = ops.mkstemp(directory, f".{path.name}.")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data, ops)
            os.fsync(fd)
        finally:
            os.close(fd)
        ops.replace(tmp, str(path))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _complete_length(fd: int, size: int) -> int:
    """Length of the file up to and including its last newline (drops a torn last line)."""
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        index = chunk.rfind(b"\n")
        if index >= 0:
            return start + index + 1
        end = start
    return 0


def append_line(path: Path, line: bytes, ops: FileOps = DEFAULT_OPS) -> None:
    """Append one newline-terminated line in one write, or leave the file as it was.

    A torn line left by an earlier crash is cut off first.
    """
    if not line.endswith(b"\n") or b"\n" in line[:-1]:
        raise ValueError("append_line needs exactly one line ending with a newline")
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputError(f"cannot append to {path}: {_reason(exc)}") from None
    try:
        size = os.fstat(fd).st_size
        good = _complete_length(fd, size) if size else 0
        if good != size:
            os.ftruncate(fd, good)
            size = good
        try:
            n = ops.write(fd, line)
            if n != len(line):
                raise OSError(0, f"short write ({n} of {len(line)} bytes)")
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    except OSError as exc:
        raise OutputError(f"cannot append to {path}: {_reason(exc)}") from None
    finally:
        os.close(fd)


def history_path(history_dir: Path, year: int, month: int) -> Path:
    """``history/YYYY-MM.jsonl``."""
    return history_dir / f"{year:04d}-{month:02d}.jsonl"


def expired_history(names: Iterable[str], year: int, month: int, keep_months: int) -> list[str]:
    """History file names older than the ``keep_months`` most recent months (this one included).

    ``keep_months`` 0 keeps everything.
    """
    if keep_months <= 0:
        return []
    current = year * 12 + (month - 1)
    out = []
    for name in names:
        match = _HISTORY_RE.match(name)
        if match is None:
            continue
        index = int(match.group(1)) * 12 + int(match.group(2)) - 1
        if index <= current - keep_months:
            out.append(name)
    return sorted(out)


def prune_history(history_dir: Path, year: int, month: int, keep_months: int) -> list[Path]:
    """Remove expired history files; return the removed paths."""
    try:
        names = os.listdir(history_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OutputError(f"cannot list {history_dir}: {_reason(exc)}") from None
    removed = []
    for name in expired_history(names, year, month, keep_months):
        path = history_dir / name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot remove {path}: {_reason(exc)}") from None
        removed.append(path)
    return removed


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


_METRICS = (
    ("cardshare_scan_timestamp_seconds", "Time of the last recorder scan (Unix seconds)."),
    ("cardshare_scan_processes", "Processes seen by the last scan."),
    ("cardshare_scan_skipped", "Processes, descriptors or files skipped by the last scan."),
    ("cardshare_card_vram_total_bytes", "Device memory of the card (sysfs)."),
    ("cardshare_card_vram_used_bytes", "Resident device memory of all clients of the card."),
    ("cardshare_card_clients", "Named clients on the card."),
    ("cardshare_client_vram_bytes", "Resident device memory of a named client."),
    ("cardshare_client_system_bytes", "Resident system memory of a named client."),
    ("cardshare_client_gtt_bytes", "Resident GTT memory of a named client."),
    ("cardshare_client_drm_clients", "DRM clients (open DRM files) of a named client."),
    ("cardshare_client_engine_busy_ratio", "Busy share of an engine class since the last scan."),
)


def prometheus_text(snapshot: Mapping[str, Any]) -> str:
    """Render a snapshot in the Prometheus text exposition format (node_exporter textfile)."""
    samples: dict[str, list[str]] = {name: [] for name, _ in _METRICS}
    samples["cardshare_scan_timestamp_seconds"].append(f" {snapshot['timestamp_unix']}")
    stats = snapshot.get("stats", {})
    samples["cardshare_scan_processes"].append(f" {stats.get('processes', 0)}")
    for reason in ("vanished", "unreadable", "not_clients"):
        samples["cardshare_scan_skipped"].append(f"{_labels(reason=reason)} {stats.get(reason, 0)}")
    for pdev, card in snapshot["cards"].items():
        card_labels = _labels(card=pdev, driver=card.get("driver") or "")
        if card.get("vram_total_bytes") is not None:
            samples["cardshare_card_vram_total_bytes"].append(
                f"{card_labels} {card['vram_total_bytes']}"
            )
        samples["cardshare_card_vram_used_bytes"].append(f"{card_labels} {card['vram_used_bytes']}")
        samples["cardshare_card_clients"].append(f"{card_labels} {len(card['clients'])}")
        for client in card["clients"]:
            labels = _labels(client=client["name"], card=pdev)
            for key, metric in (
                ("vram_bytes", "cardshare_client_vram_bytes"),
                ("system_bytes", "cardshare_client_system_bytes"),
                ("gtt_bytes", "cardshare_client_gtt_bytes"),
            ):
                samples[metric].append(f"{labels} {client[key]}")
            samples["cardshare_client_drm_clients"].append(
                f"{labels} {len(client['drm_client_ids'])}"
            )
            for engine, ratio in client["engines"].items():
                if ratio is None:
                    continue
                samples["cardshare_client_engine_busy_ratio"].append(
                    f"{_labels(client=client['name'], card=pdev, engine=engine)} {ratio}"
                )
    lines: list[str] = []
    for name, help_text in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{sample}" for sample in samples[name])
    return "\n".join(lines) + "\n"
