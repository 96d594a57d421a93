"""The campaign's loop: scan the libraries, encode one file at a time, verify, replace.

It never loses a file:

* the result is written to a hidden temporary file in the original's directory (the same
  filesystem), whose path is in the queue before the encoder starts;
* a result replaces nothing until it passed every check (:func:`.rules.verify`) and the
  original is unchanged since the encode began (size and mtime);
* the original is first linked into the holding folder (a second name, same filesystem),
  then the result is renamed over it (one atomic step), so at every instant the original
  exists under at least one name; it leaves the holding folder after ``hold_days``;
* killed at any moment, the next start (:meth:`Campaign.recover`) removes the temporary
  file, and either finds the original untouched (the file is queued again) or the result in
  its place (the file is done);
* a full disk stops the campaign before it starts a file that may not fit, or when the
  encoder reports it, and keeps everything.

It yields: while Plex transcodes (the recorder's card data or Plex's sessions API) the
encoder is stopped (SIGSTOP) and continued after; paused longer than ``max_pause_seconds`` it
abandons the file and retries it later. When the arbiter asks for the card (``Control``), the
encoder is ended so its memory leaves the card, and nothing starts until the arbiter resumes
the campaign or its lease runs out. It works only in the allowed hours.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cardshare.campaign.config import CampaignConfig
from cardshare.campaign.encode import Encoder, decode_error, encode_argv
from cardshare.campaign.media import Media, ProbeError, probe
from cardshare.campaign.rules import select, verify
from cardshare.campaign.store import FileRow, FileState, Store

__all__ = ["TEMP_PREFIX", "Campaign", "CardPlex", "Control", "PlexSessions"]

log = logging.getLogger("cardshare.campaign")

TEMP_PREFIX = ".cardshare-encoding."
_VIDEO_CLASSES = {"vcs", "vecs", "video", "video-enhance"}


class Control:
    """What the arbiter asked (a pause with a lease), shared with the HTTP thread."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._cond = threading.Condition()
        self._until = 0.0
        self.reason = ""
        self._running = False

    def pause(self, seconds: float, reason: str) -> None:
        with self._cond:
            self._until = self.clock() + seconds
            self.reason = reason
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._until = 0.0
            self.reason = ""
            self._cond.notify_all()

    def paused(self) -> bool:
        with self._cond:
            return self.clock() < self._until

    def until(self) -> float | None:
        with self._cond:
            return self._until if self.clock() < self._until else None

    def encoder(self, running: bool) -> None:
        with self._cond:
            self._running = running
            self._cond.notify_all()

    def wait_stopped(self, timeout: float) -> bool:
        """True once no encoder runs (within ``timeout`` seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)


class CardPlex:
    """Plex transcoding, from the recorder's card data: a transcode client's video engines busy.
    Data older than ``max_age`` counts as busy: unknown must not slow Plex."""

    def __init__(
        self,
        current_json: Path,
        names: tuple[str, ...],
        max_age: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.current_json = current_json
        self.names = set(names)
        self.max_age = max_age
        self.clock = clock

    def __call__(self) -> str | None:
        try:
            doc = json.loads(self.current_json.read_text(encoding="utf-8"))
            age = self.clock() - float(doc["timestamp_unix"])
            cards = doc["cards"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return (
                f"the card data {self.current_json} cannot be read ({type(exc).__name__}); "
                "without it a transcode cannot be ruled out (is the recorder running?)"
            )
        if age > self.max_age:
            return f"the card data is {age:.0f} s old (more than {self.max_age:.0f} s)"
        for card in cards:
            for client in card.get("clients") or []:
                if not isinstance(client, dict) or client.get("name") not in self.names:
                    continue
                raw = client.get("engines")
                engines: dict[str, Any] = raw if isinstance(raw, dict) else {}
                busy = {
                    c: r
                    for c, r in engines.items()
                    if c in _VIDEO_CLASSES and isinstance(r, int | float) and r > 0
                }
                if busy:
                    shares = ", ".join(f"{c} {r:.0%}" for c, r in sorted(busy.items()))
                    return f"{client['name']} transcodes ({shares})"
        return None


class PlexSessions:
    """Plex transcoding, from ``GET /status/sessions``: a ``TranscodeSession`` in the answer.
    An error is logged and read as no transcode (the card data is the other source)."""

    def __init__(self, url: str, token: str, timeout: float = 5.0) -> None:
        self.url = url
        self.token = token
        self.timeout = timeout

    def __call__(self) -> str | None:
        req = urllib.request.Request(
            f"{self.url}/status/sessions",
            headers={"X-Plex-Token": self.token, "Accept": "application/xml"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                root = ET.fromstring(resp.read())
        except (OSError, ET.ParseError) as exc:
            log.warning("Plex's sessions cannot be read: %s", exc)
            return None
        sessions = [
            t
            for t in root.iter("TranscodeSession")
            if t.get("videoDecision", "transcode") == "transcode"
        ]
        if sessions:
            hw = sum(
                1
                for t in sessions
                if t.get("transcodeHwEncoding") or t.get("transcodeHwRequested") == "1"
            )
            return f"Plex transcodes ({len(sessions)} session(s), {hw} on the card)"
        return None


class Campaign:
    def __init__(
        self,
        config: CampaignConfig,
        store: Store,
        encoder: Encoder,
        plex: Callable[[], str | None] = lambda: None,
        control: Control | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        minute_of_day: Callable[[], int] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.encoder = encoder
        self.plex = plex
        self.control = control or Control(clock)
        self.clock = clock
        self.sleep = sleep
        self.minute_of_day = minute_of_day or self._local_minute
        self._seconds = 0.0  # how long the last encode ran
        self.phase = "idle"
        self.current: str | None = None
        self.paused_reason: str | None = None
        self.alerts: dict[str, str] = {}
        self.last_scan: float | None = None

    def _local_minute(self) -> int:
        now = time.localtime(self.clock())
        return now.tm_hour * 60 + now.tm_min

    # --- start: what a killed campaign left ------------------------------------------------

    def recover(self) -> list[str]:
        notes = []
        for row in self.store.interrupted():
            _drop(row.temp_path)
            target = _target(row.path)
            held = row.held_path
            if held and os.path.exists(held):
                untouched = os.path.exists(row.path) and os.path.samefile(held, row.path)
                if untouched and (target == row.path or not os.path.exists(target)):
                    os.unlink(held)  # a second name of the untouched original
                    self.store.requeue(
                        row.path, "interrupted before the replace; the original is untouched"
                    )
                    notes.append(f"{row.path}: interrupted before the replace; queued again")
                    continue
                if untouched:  # the result took the new name; the old name still to go
                    os.unlink(row.path)
                st = os.stat(target)
                self.store.done(row.path, target, st.st_size, st.st_mtime_ns, held, 0.0)
                notes.append(
                    f"{row.path}: interrupted after the replace; done (original held at {held})"
                )
            else:
                self.store.requeue(row.path, "interrupted mid-encode; the original is untouched")
                notes.append(f"{row.path}: interrupted mid-encode; queued again")
        return notes

    # --- scan ------------------------------------------------------------------------------

    def scan(self) -> int:
        """Examine new and changed files; remove stray temporary files. Returns files examined."""
        examined = 0
        rules = self.config.rules
        for library in self.config.libraries:
            for root, dirs, files in os.walk(library):
                dirs.sort()
                for name in sorted(files):
                    path = os.path.join(root, name)
                    if name.startswith(TEMP_PREFIX):
                        if self.current is None or not self.current_temp_is(path):
                            _drop(path)
                        continue
                    if not name.lower().endswith(rules.extensions):
                        continue
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    row = self.store.get(path)
                    if row is not None and (row.size, row.mtime_ns) == (st.st_size, st.st_mtime_ns):
                        continue
                    done = self.store.by_result(path)
                    if done is not None and (done.new_size, done.new_mtime_ns) == (
                        st.st_size,
                        st.st_mtime_ns,
                    ):
                        continue  # a result of this campaign
                    examined += 1
                    try:
                        media = probe(path, self.config.ffprobe)
                    except ProbeError as exc:
                        self.store.seen(
                            path, FileState.UNREADABLE, str(exc), st.st_size, st.st_mtime_ns
                        )
                        continue
                    chosen, why = select(media, rules)
                    state = FileState.QUEUED if chosen else FileState.SKIPPED
                    self.store.seen(path, state, why, st.st_size, st.st_mtime_ns)
        self.last_scan = self.clock()
        return examined

    def current_temp_is(self, path: str) -> bool:
        row = self.store.get(self.current) if self.current else None
        return row is not None and row.temp_path == path

    # --- one file --------------------------------------------------------------------------

    def blocked(self) -> str | None:
        """Why no file may start now (None: one may)."""
        if "disk_full" in self.alerts:
            return self.alerts["disk_full"]
        if self.control.paused():
            return f"paused by the arbiter: {self.control.reason}"
        if not self.config.hours.allows(self.minute_of_day()):
            return "outside the allowed hours"
        plex = self.plex()
        if plex:
            return f"waiting: {plex}"
        return None

    def step(self, stop: threading.Event) -> str:
        """Start the next file if allowed; returns what happened."""
        why = self.blocked()
        if why:
            self.phase, self.paused_reason = "waiting", why
            return why
        row = self.store.next_queued(self.clock())
        if row is None:
            self.phase, self.paused_reason = "idle", None
            return "nothing queued"
        return self.encode(row, stop)

    def encode(self, row: FileRow, stop: threading.Event) -> str:
        path = row.path
        try:
            st = os.stat(path)
            media = probe(path, self.config.ffprobe)
        except (OSError, ProbeError) as exc:
            self.store.requeue(
                path,
                f"cannot read it now: {exc}",
                self.clock() + self.config.retry_seconds,
                attempt=True,
            )
            return "unreadable"
        if (st.st_size, st.st_mtime_ns) != (row.size, row.mtime_ns):
            self.store.seen(
                path, FileState.QUEUED, "changed since it was examined", st.st_size, st.st_mtime_ns
            )
            return "changed"
        fs = os.statvfs(os.path.dirname(path))
        need = int(row.size * (1 - self.config.checks.min_saving)) + self.config.reserve_bytes
        if fs.f_bavail * fs.f_frsize < need:
            return self._disk_full(path, f"{fs.f_bavail * fs.f_frsize} bytes free, {need} needed")
        temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.path.basename(path)}.mkv")
        self.store.start(path, temp)
        self.current, self.phase, self.paused_reason = path, "encoding", None
        try:
            outcome = self._run_encoder(row, media, temp, stop)
        finally:
            self.current = None
        if outcome != "encoded":
            return outcome
        return self._check_and_replace(row, media, temp, st)

    def _run_encoder(self, row: FileRow, media: Media, temp: str, stop: threading.Event) -> str:
        config = self.config
        log_path = config.state_dir / "encoder.log"
        argv = encode_argv(config.ffmpeg, row.path, temp, media, self.encoder)
        started = self.clock()
        stopped_at: float | None = None
        with open(log_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        self.control.encoder(True)
        try:
            while proc.poll() is None:
                now = self.clock()
                end = None
                if stop.is_set():
                    end = ("the campaign stopped mid-file; the original is untouched", 0.0)
                elif self.control.paused():
                    end = (f"stepped aside for the arbiter ({self.control.reason})", 0.0)
                elif not config.hours.allows(self.minute_of_day()):
                    end = ("the allowed hours ended mid-file", 0.0)
                if end is None:
                    plex = self.plex()
                    if plex and stopped_at is None:
                        _signal(proc, signal.SIGSTOP)
                        stopped_at, self.phase, self.paused_reason = now, "paused", plex
                        log.info("encoder paused: %s", plex)
                    elif not plex and stopped_at is not None:
                        _signal(proc, signal.SIGCONT)
                        stopped_at, self.phase, self.paused_reason = None, "encoding", None
                        log.info("encoder continued")
                    elif stopped_at is not None and now - stopped_at > config.max_pause_seconds:
                        end = (
                            f"paused for Plex more than {config.max_pause_seconds:.0f} s "
                            f"({plex}); retried later",
                            now + config.retry_seconds,
                        )
                if end is not None:
                    _kill(proc)
                    _drop(temp)
                    self.store.requeue(row.path, end[0], end[1])
                    self.phase = "idle"
                    return end[0]
                self.sleep(config.poll_seconds)
        finally:
            if proc.poll() is None:
                _kill(proc)
            self.control.encoder(False)
        self._seconds = self.clock() - started
        if proc.returncode == 0:
            return "encoded"
        _drop(temp)
        tail = _tail(log_path)
        if "No space left on device" in tail:
            return self._disk_full(row.path, tail)
        reason = f"the encoder exited with {proc.returncode}: {tail or 'no message'}"
        if row.attempts + 1 >= config.max_attempts:
            self.store.fail(
                row.path, f"{reason} ({row.attempts + 1} attempts); the original is kept"
            )
        else:
            self.store.requeue(row.path, reason, self.clock() + config.retry_seconds, attempt=True)
        return reason

    def _check_and_replace(
        self, row: FileRow, media: Media, temp: str, before: os.stat_result
    ) -> str:
        path = row.path
        try:
            result = probe(temp, self.config.ffprobe)
            reasons = verify(
                media, result, decode_error(temp, self.config.ffmpeg), self.config.checks
            )
        except ProbeError as exc:
            reasons = [f"the result cannot be read: {exc}"]
        if reasons:
            _drop(temp)
            self.store.fail(path, "; ".join(reasons) + "; the original is kept")
            log.warning("not replaced: %s: %s; the original is kept", path, "; ".join(reasons))
            return "failed: " + "; ".join(reasons)
        try:
            now = os.stat(path)
        except OSError:
            now = None
        if now is None or (now.st_size, now.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            _drop(temp)
            self.store.requeue(
                path,
                "the original changed while it was encoded; not replaced",
                self.clock() + self.config.retry_seconds,
            )
            log.warning("not replaced: %s changed while it was encoded; queued again", path)
            return "changed while encoding"
        target = _target(path)
        if target != path and os.path.exists(target):
            _drop(temp)
            self.store.fail(
                path, f"{target} exists: the result has nowhere to go; the original is kept"
            )
            return "target exists"
        held = self._hold_path(path)
        self.store.set_held(path, held)
        try:
            os.makedirs(os.path.dirname(held), exist_ok=True)
            os.link(path, held)
        except OSError as exc:
            _drop(temp)
            hint = (
                " (the holding folder must be on the library's filesystem)"
                if exc.errno == errno.EXDEV
                else ""
            )
            self.store.fail(
                path,
                f"cannot hold the original at {held}: {exc.strerror}{hint}; the original is kept",
            )
            return "cannot hold"
        os.replace(temp, target)
        _fsync_dir(os.path.dirname(target))
        if target != path:
            os.unlink(path)
            _fsync_dir(os.path.dirname(path))
        st = os.stat(target)
        self.store.done(path, target, st.st_size, st.st_mtime_ns, held, self._seconds)
        log.info("done: %s, %d -> %d bytes (original held at %s)", path, row.size, st.st_size, held)
        return "done"

    def _hold_path(self, path: str) -> str:
        for i, library in enumerate(self.config.libraries):
            if Path(path).is_relative_to(library):
                rel = Path(path).relative_to(library)
                base = self.config.hold_dir / f"{i}-{library.name or 'root'}" / rel
                break
        else:
            base = self.config.hold_dir / "other" / Path(path).name
        held, n = str(base), 1
        while os.path.lexists(held):
            held, n = f"{base}.{n}", n + 1
        return held

    def _disk_full(self, path: str, detail: str) -> str:
        message = (
            f"disk full at {os.path.dirname(path)} ({detail}): the campaign stopped; "
            "nothing was replaced"
        )
        self.alerts["disk_full"] = message
        self.store.requeue(path, "waiting for disk space")
        self.phase, self.paused_reason = "stopped", message
        log.error("%s", message)
        return message

    def clear_disk_full(self) -> bool:
        """Lift the disk-full stop once every library has room again."""
        if "disk_full" not in self.alerts:
            return False
        for library in self.config.libraries:
            fs = os.statvfs(library)
            if fs.f_bavail * fs.f_frsize < self.config.reserve_bytes * 2:
                return False
        del self.alerts["disk_full"]
        return True

    # --- originals held ----------------------------------------------------------------------

    def purge(self, everything: bool = False) -> list[str]:
        """Remove held originals past ``hold_days`` (or all of them); returns their paths."""
        days = self.config.hold_days
        if not everything and days == 0:
            return []
        cutoff = self.clock() - days * 86400
        removed = []
        for row in self.store.rows(FileState.DONE):
            if row.purged or not row.held_path or (not everything and (row.done_at or 0) > cutoff):
                continue
            _drop(row.held_path)
            self.store.purged(row.path)
            removed.append(row.held_path)
        return removed

    # --- the loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        for note in self.recover():
            log.info("%s", note)
        next_scan = 0.0
        while not stop.is_set():
            now = self.clock()
            self.clear_disk_full()
            if now >= next_scan:
                self.scan()
                self.purge()
                next_scan = now + self.config.scan_seconds
            outcome = self.step(stop)
            if outcome in ("nothing queued",) or self.phase in ("waiting", "stopped"):
                stop.wait(min(5.0, self.config.scan_seconds))

    def status(self, store: Store | None = None) -> dict[str, Any]:
        """Counts, bytes won back and held, the ETA at the last week's rate (``store``: a
        connection of the caller's thread)."""
        store = store or self.store
        counts = store.counts()
        totals = store.totals()
        rate = store.recent_rate(self.clock() - 7 * 86400)
        failed = [{"path": r.path, "reason": r.reason} for r in store.rows(FileState.FAILED)]
        return {
            "phase": self.phase,
            "current": self.current,
            "paused_reason": self.paused_reason,
            "arbiter_pause_until": self.control.until(),
            "encoder": {
                "name": self.encoder.name,
                "software": self.encoder.software,
                "device": self.encoder.device,
            },
            "counts": counts,
            "saved_bytes": int(totals["saved_bytes"]),
            "held_bytes": int(totals["held_bytes"]),
            "queued_bytes": int(totals["queued_bytes"]),
            "rate_bytes_per_second": rate,
            "eta_seconds": None if not rate else totals["queued_bytes"] / rate,
            "failed": failed,
            "alerts": [{"name": k, "message": v} for k, v in sorted(self.alerts.items())],
            "last_scan": self.last_scan,
        }


def _target(path: str) -> str:
    root, ext = os.path.splitext(path)
    return path if ext.lower() == ".mkv" else root + ".mkv"


def _drop(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    _signal(proc, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
