"""Durable outputs of the recorder: atomic files, whole history lines, textfile, retention,
the scan lock and the compression of closed history months.

Every failure raises :class:`OutputError` whose message names the path and the reason, e.g.
``cannot write /var/lib/cardshare/current.json: No space left on device``.  A failed atomic
write leaves the previous file untouched; a failed history append truncates the file back to
its previous length, so the history never holds a partial line.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import io
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from cardshare import atomicfile
from cardshare.atomicfile import DEFAULT_OPS, FileOps
from cardshare.promtext import Sample, render

__all__ = [
    "DEFAULT_OPS",
    "FileOps",
    "OutputError",
    "append_line",
    "atomic_write",
    "compress_closed_months",
    "ensure_dir",
    "expired_history",
    "history_path",
    "prometheus_text",
    "prune_history",
    "scan_lock",
]

_HISTORY_RE = re.compile(r"^([0-9]{4})-([0-9]{2})\.jsonl(\.gz)?$")
_COPY_CHUNK = 1 << 20


class OutputError(Exception):
    """An output could not be written; the message names the path."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def ensure_dir(path: Path) -> None:
    """Create a directory (and parents) or raise ``OutputError`` naming it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create directory {path}: {_reason(exc)}") from None


def atomic_write(path: Path, data: bytes, ops: FileOps = DEFAULT_OPS, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename
    (:func:`cardshare.atomicfile.write_atomic`)."""
    try:
        atomicfile.write_atomic(path, data, ops, mode)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None


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


@contextlib.contextmanager
def scan_lock(
    path: Path,
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block.

    A second scan waits up to ``timeout`` seconds for the first, then raises ``OutputError``
    (``another scan holds <path>; gave up after <t> s``).  The lock goes with the descriptor,
    so a scan that dies releases it.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutputError(f"cannot open lock file {path}: {_reason(exc)}") from None
    try:
        deadline = monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if monotonic() >= deadline:
                    raise OutputError(
                        f"another scan holds {path}; gave up after {timeout:g} s"
                    ) from None
                sleep(0.05)
            except OSError as exc:
                raise OutputError(f"cannot lock {path}: {_reason(exc)}") from None
        yield
    finally:
        os.close(fd)


class _FdWriter(io.RawIOBase):
    """A writable file object over a descriptor, writing through :class:`FileOps`."""

    def __init__(self, fd: int, ops: FileOps) -> None:
        super().__init__()
        self._fd = fd
        self._ops = ops

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        payload = bytes(data)
        atomicfile.write_all(self._fd, payload, self._ops)
        return len(payload)


def _month_index(name: str) -> tuple[int, bool] | None:
    match = _HISTORY_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)) * 12 + int(match.group(2)) - 1, match.group(3) is not None


def compress_closed_months(
    history_dir: Path, year: int, month: int, ops: FileOps = DEFAULT_OPS
) -> list[Path]:
    """Gzip every ``YYYY-MM.jsonl`` of a month before ``year-month`` into ``YYYY-MM.jsonl.gz``.

    The archive is written like :func:`atomic_write` (temp file, fsync, rename), then the plain
    file is removed.  Lines already in an archive of the same month (a line appended after the
    month was closed, when the clock stepped back) are kept: the old archive's content comes
    first.  A crash between the rename and the removal leaves lines twice, which readers drop
    (:func:`cardshare.recorder.report.read_month`).  Returns the archives written.
    """
    try:
        names = sorted(os.listdir(history_dir))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OutputError(f"cannot list {history_dir}: {_reason(exc)}") from None
    current = year * 12 + (month - 1)
    written = []
    for name in names:
        parsed = _month_index(name)
        if parsed is None or parsed[1] or parsed[0] >= current:
            continue
        plain = history_dir / name
        archive = history_dir / (name + ".gz")
        _gzip_into(plain, archive, ops)
        try:
            plain.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise OutputError(f"cannot remove {plain}: {_reason(exc)}") from None
        written.append(archive)
    return written


def _gzip_into(plain: Path, archive: Path, ops: FileOps) -> None:
    try:
        with atomicfile.replacing(archive, ops, 0o644) as fd:
            raw = _FdWriter(fd, ops)
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as gz:
                if archive.exists():
                    try:
                        with gzip.open(archive, "rb") as old:
                            shutil.copyfileobj(old, gz, _COPY_CHUNK)
                    except (EOFError, gzip.BadGzipFile) as exc:
                        raise OutputError(f"cannot read {archive}: {exc}") from None
                with open(plain, "rb") as src:
                    shutil.copyfileobj(src, gz, _COPY_CHUNK)
    except OSError as exc:
        # the plain month it reads names itself; anything else is the archive's
        where = plain if exc.filename == str(plain) else archive
        raise OutputError(f"cannot write {where}: {_reason(exc)}") from None


def expired_history(names: Iterable[str], year: int, month: int, keep_months: int) -> list[str]:
    """History file names (plain or gzipped) older than the ``keep_months`` most recent months
    (this one included).

    ``keep_months`` 0 keeps everything.
    """
    if keep_months <= 0:
        return []
    current = year * 12 + (month - 1)
    out = []
    for name in names:
        parsed = _month_index(name)
        if parsed is not None and parsed[0] <= current - keep_months:
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


# (name, type, help); counters end in ``_total``.
_METRICS = (
    ("cardshare_scan_timestamp_seconds", "gauge", "Time of the last recorder scan (Unix seconds)."),
    ("cardshare_scan_processes", "gauge", "Processes seen by the last scan."),
    (
        "cardshare_scan_fdinfo_reads",
        "gauge",
        "DRM fdinfo files the last scan read (each read wakes an xe card).",
    ),
    (
        "cardshare_scan_fdinfo_reads_saved",
        "gauge",
        "DRM descriptors the last scan did not read: they share an open file already read.",
    ),
    (
        "cardshare_scan_skipped",
        "gauge",
        "Processes, descriptors or files skipped by the last scan.",
    ),
    (
        "cardshare_scan_fdinfo_malformed_lines",
        "gauge",
        "Lines of the DRM fdinfo files the last scan read that were not key: value (ignored).",
    ),
    ("cardshare_card_vram_total_bytes", "gauge", "Device memory of the card (sysfs)."),
    (
        "cardshare_card_vram_used_bytes",
        "gauge",
        "Resident device memory of all clients of the card, shared buffers counted once.",
    ),
    (
        "cardshare_card_vram_shared_bytes",
        "gauge",
        "Part of the card's used device memory in buffers shared between DRM files.",
    ),
    ("cardshare_card_clients", "gauge", "Named clients on the card."),
    ("cardshare_client_vram_bytes", "gauge", "Resident device memory of a named client."),
    (
        "cardshare_client_vram_shared_bytes",
        "gauge",
        "Part of a named client's device memory in buffers shared with another DRM file.",
    ),
    ("cardshare_client_system_bytes", "gauge", "Resident system memory of a named client."),
    ("cardshare_client_gtt_bytes", "gauge", "Resident GTT memory of a named client."),
    (
        "cardshare_client_drm_clients",
        "gauge",
        "DRM clients (open DRM files) of a named client.",
    ),
    (
        "cardshare_client_engine_busy_ratio",
        "gauge",
        "Busy share of an engine class since the last scan.",
    ),
    (
        "cardshare_drm_client_engine_cycles_total",
        "counter",
        "GPU cycles a DRM client's work ran on an engine class (xe drm-cycles).",
    ),
    (
        "cardshare_drm_client_engine_total_cycles_total",
        "counter",
        "GPU cycles elapsed on an engine class, busy or not (xe drm-total-cycles).",
    ),
    (
        "cardshare_drm_client_engine_busy_seconds_total",
        "counter",
        "Time a DRM client's work ran on an engine class (i915, amdgpu drm-engine, ns / 1e9).",
    ),
    (
        "cardshare_drm_client_engine_capacity",
        "gauge",
        "Engines of the class a DRM client may use (drm-engine-capacity, 1 when not printed).",
    ),
)

_COUNTER_METRICS = (
    ("cycles", "cardshare_drm_client_engine_cycles_total"),
    ("total_cycles", "cardshare_drm_client_engine_total_cycles_total"),
    ("busy_ns", "cardshare_drm_client_engine_busy_seconds_total"),
)


def _counter_samples(
    samples: dict[str, list[Sample]], counters: Any, labels: dict[str, str]
) -> None:
    """Samples of one DRM client's raw engine counters (as kept in ``state.json``)."""
    if not isinstance(counters, Mapping):
        return
    capacity = counters.get("capacity")
    capacity = capacity if isinstance(capacity, Mapping) else {}
    engines: set[str] = set()
    for kind, metric in _COUNTER_METRICS:
        values = counters.get(kind)
        if not isinstance(values, Mapping):
            continue
        for engine, value in sorted(values.items()):
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            engines.add(engine)
            samples[metric].append(
                ({**labels, "engine": engine}, value / 1e9 if kind == "busy_ns" else value)
            )
    for engine in sorted(engines):
        cap = capacity.get(engine, 1)
        samples["cardshare_drm_client_engine_capacity"].append(
            ({**labels, "engine": engine}, cap if isinstance(cap, int) else 1)
        )


def prometheus_text(snapshot: Mapping[str, Any], state: Mapping[str, Any] | None = None) -> str:
    """Render a snapshot in the Prometheus text exposition format (node_exporter textfile).

    With the scan's ``state``, the raw engine counters of every DRM client are exported as
    counters too (``cardshare_drm_client_engine_*_total{card,client,drm_client_id,engine}``),
    so Prometheus can ``rate()`` them over any window: busy share on xe is
    ``rate(cycles_total) / (rate(total_cycles_total) * capacity)``, on i915 and amdgpu
    ``rate(busy_seconds_total) / capacity``.  Each DRM client is its own series (a client's
    counters only grow within a boot; a sum over the clients of a name would drop when one
    closes and look like a counter reset).
    """
    samples: dict[str, list[Sample]] = {name: [] for name, _, _ in _METRICS}
    state_clients = state.get("clients") if state is not None else None
    if not isinstance(state_clients, Mapping):
        state_clients = {}
    samples["cardshare_scan_timestamp_seconds"].append(({}, snapshot["timestamp_unix"]))
    stats = snapshot.get("stats", {})
    for key in ("processes", "fdinfo_reads", "fdinfo_reads_saved"):
        samples[f"cardshare_scan_{key}"].append(({}, stats.get(key, 0)))
    for reason in ("vanished", "unreadable", "not_clients", "unreadable_processes", "reused"):
        samples["cardshare_scan_skipped"].append(({"reason": reason}, stats.get(reason, 0)))
    samples["cardshare_scan_fdinfo_malformed_lines"].append(({}, stats.get("malformed_lines", 0)))
    for pdev, card in snapshot["cards"].items():
        card_labels = {"card": pdev, "driver": card.get("driver") or ""}
        if card.get("vram_total_bytes") is not None:
            samples["cardshare_card_vram_total_bytes"].append(
                (card_labels, card["vram_total_bytes"])
            )
        samples["cardshare_card_vram_used_bytes"].append((card_labels, card["vram_used_bytes"]))
        samples["cardshare_card_vram_shared_bytes"].append(
            (card_labels, card.get("vram_shared_bytes", 0))
        )
        samples["cardshare_card_clients"].append((card_labels, len(card["clients"])))
        for client in card["clients"]:
            # a container and a host process of one name are two series (kind)
            kind = str(client.get("kind", "process"))
            labels = {"client": client["name"], "kind": kind, "card": pdev}
            for key in ("vram_bytes", "vram_shared_bytes", "system_bytes", "gtt_bytes"):
                samples[f"cardshare_client_{key}"].append((labels, client.get(key, 0)))
            samples["cardshare_client_drm_clients"].append((labels, len(client["drm_client_ids"])))
            for engine, ratio in client["engines"].items():
                if ratio is None:
                    continue
                samples["cardshare_client_engine_busy_ratio"].append(
                    ({**labels, "engine": engine}, ratio)
                )
            for client_id in client["drm_client_ids"]:
                _counter_samples(
                    samples,
                    state_clients.get(f"{pdev}/{client_id}"),
                    {"card": pdev, "client": client["name"], "drm_client_id": str(client_id)},
                )
    return render(_METRICS, samples, {"cardshare_drm_client_engine_busy_seconds_total": 9})
