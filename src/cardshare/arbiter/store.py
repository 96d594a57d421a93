"""The arbiter's database (SQLite): the machine's phase, every transition, the swaps with
each phase's duration, and the job queue.

Every transition is written (and committed) before the action of the new phase starts, so
an arbiter killed at any moment finds where it was.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from cardshare.arbiter.states import MODE_OF, Mode, Outcome, Phase, swap_direction
from cardshare.atomicfile import write_atomic
from cardshare.sqlitestore import open_store, transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS machine (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    phase TEXT NOT NULL,
    phase_since REAL NOT NULL,
    mode_since REAL NOT NULL,
    swap_id INTEGER,
    image_since REAL
);
CREATE TABLE IF NOT EXISTS hold (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    until REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    from_phase TEXT NOT NULL,
    to_phase TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    swap_id INTEGER
);
-- the status page asks when a move (a start, a stop) was last made
CREATE INDEX IF NOT EXISTS transitions_move ON transitions (from_phase, to_phase, at);
CREATE TABLE IF NOT EXISTS swaps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    direction TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    ok INTEGER
);
CREATE TABLE IF NOT EXISTS swap_phases (
    swap_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    phase TEXT NOT NULL,
    seconds REAL NOT NULL,
    waited_seconds REAL NOT NULL,
    outcome TEXT NOT NULL,
    PRIMARY KEY (swap_id, seq)
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    workflow TEXT NOT NULL,
    inputs TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0,
    prompt_id TEXT,
    outputs INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    started REAL,
    finished REAL,
    errors INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    saved TEXT,
    restarts INTEGER NOT NULL DEFAULT 0
);
-- written by the arbiter's storage probe: the database takes a write
CREATE TABLE IF NOT EXISTS probe (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    at REAL NOT NULL
);
-- ComfyUI's largest VRAM seen while a workflow ran, by its signature (plans.workflow_signature)
CREATE TABLE IF NOT EXISTS workflow_peaks (
    signature TEXT PRIMARY KEY,
    peak_bytes INTEGER NOT NULL,
    runs INTEGER NOT NULL,
    updated REAL NOT NULL
);
"""

# columns added after the first release: (table, name, definition) added to an older database
_COLUMNS_ADDED = (
    ("jobs", "errors", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "cancel_requested", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "saved", "TEXT"),
    ("jobs", "restarts", "INTEGER NOT NULL DEFAULT 0"),
)

# what Store.daily_counts counts per day
DAILY_KEYS = ("swaps", "swaps_failed", "jobs", "jobs_done", "jobs_failed")

# written beside the database once it holds the machine's first state: a database that is
# missing or empty while this exists was lost, and is never silently started afresh
MARKER_NAME = "arbiter.initialized"


class StoreError(RuntimeError):
    """The database cannot be used as it is: damaged, or lost while expected."""


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Job:
    id: str
    state: JobState
    workflow: dict[str, object]
    inputs: tuple[str, ...]
    reason: str
    attempts: int
    prompt_id: str | None
    outputs: int
    created: float
    started: float | None
    finished: float | None
    errors: int = 0  # unexpected errors of the arbiter while running this job
    cancel_requested: bool = False
    # the files ComfyUI's history reported saved, (filename, subfolder, type): the prompt
    # ran; from then on the outputs are fetched, the prompt is never run again
    saved: tuple[tuple[str, str, str], ...] | None = None
    restarts: int = 0  # restarts of ComfyUI this job caused (it died or hung under it)


@dataclass(frozen=True)
class MachineState:
    phase: Phase
    phase_since: float
    mode_since: float
    swap_id: int | None
    image_since: float | None

    @property
    def mode(self) -> Mode:
        return MODE_OF[self.phase]


@dataclass(frozen=True)
class PhaseTiming:
    phase: str
    seconds: float
    waited_seconds: float
    outcome: str


@dataclass(frozen=True)
class SwapRecord:
    id: int
    direction: str
    started: float
    finished: float | None
    ok: bool | None
    phases: tuple[PhaseTiming, ...]

    @property
    def total_seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.started

    @property
    def waited_seconds(self) -> float:
        return sum(p.waited_seconds for p in self.phases)

    @property
    def own_seconds(self) -> float | None:
        """The arbiter's own share: total minus time spent waiting on containers."""
        total = self.total_seconds
        return None if total is None else total - self.waited_seconds


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = path.with_name(MARKER_NAME)
        _check_expected(path, marker)
        try:
            self.conn = open_store(path, SCHEMA, _COLUMNS_ADDED)
        except sqlite3.DatabaseError as exc:
            raise StoreError(
                f"the arbiter's database {path} is damaged ({exc}): it is kept as it is for "
                f"inspection; restore it from a backup, or move it and {marker.name} away to "
                "start with an empty queue"
            ) from exc
        if not marker.exists():
            write_atomic(marker, f"{path.name}\n".encode(), make_parents=True)
        self.identity = _identity(path)

    def identity_problem(self) -> str | None:
        """None while the path still names the file opened; else what happened to it (deleted,
        or replaced by another file: the arbiter would write into a file no one can open
        again, and lose it all at its next start)."""
        try:
            now = _identity(self.path)
        except FileNotFoundError:
            return f"the database {self.path} was deleted while the arbiter ran"
        except OSError as exc:
            return f"the database {self.path} cannot be checked: {exc.strerror or exc}"
        if now != self.identity:
            return f"the database {self.path} was replaced by another file while the arbiter ran"
        return None

    def close(self) -> None:
        self.conn.close()

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return transaction(self.conn)

    # -- the machine ---------------------------------------------------------------------

    def machine(self, now: float) -> MachineState:
        """The persisted state; a new database starts serving the LLM."""
        row = self.conn.execute(
            "SELECT phase, phase_since, mode_since, swap_id, image_since FROM machine"
        ).fetchone()
        if row is None:
            with self._tx() as c:
                c.execute(
                    "INSERT INTO machine VALUES (1, ?, ?, ?, NULL, NULL)",
                    (Phase.SERVE_LLM.value, now, now),
                )
            return MachineState(Phase.SERVE_LLM, now, now, None, None)
        return MachineState(Phase(row[0]), row[1], row[2], row[3], row[4])

    def transition(
        self,
        to: Phase,
        outcome: Outcome,
        reason: str,
        now: float,
        waited_seconds: float = 0.0,
    ) -> MachineState:
        """Persist a move to ``to``: the transition, the finished phase's timing, swap rows."""
        cur = self.machine(now)
        swap_id = cur.swap_id
        image_since = cur.image_since
        with self._tx() as c:
            if swap_id is not None and swap_direction(cur.phase) is not None:
                seq = c.execute(
                    "SELECT COUNT(*) FROM swap_phases WHERE swap_id = ?", (swap_id,)
                ).fetchone()[0]
                c.execute(
                    "INSERT INTO swap_phases VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        swap_id,
                        seq,
                        cur.phase.value,
                        max(0.0, now - cur.phase_since),
                        waited_seconds,
                        outcome.value,
                    ),
                )
            new_dir = swap_direction(to)
            old_dir = swap_direction(cur.phase)
            if swap_id is not None and new_dir != old_dir:
                # the swap in progress ends: ok when it reached its destination
                ok = (old_dir == "to_image" and to is Phase.RUN_JOBS) or (
                    old_dir == "to_llm" and to is Phase.SERVE_LLM
                )
                c.execute(
                    "UPDATE swaps SET finished = ?, ok = ? WHERE id = ?", (now, int(ok), swap_id)
                )
                swap_id = None
            if new_dir is not None and swap_id is None:
                swap_id = c.execute(
                    "INSERT INTO swaps (direction, started) VALUES (?, ?)", (new_dir, now)
                ).lastrowid
            # image mode's clock runs from the first entry into run_jobs until handback
            # (a ComfyUI restart in between does not reset it)
            if to is Phase.RUN_JOBS and image_since is None:
                image_since = now
            elif MODE_OF[to] is Mode.LLM or new_dir == "to_llm":
                image_since = None
            mode_since = cur.mode_since if MODE_OF[to] is cur.mode else now
            phase_since = now
            c.execute(
                "INSERT INTO transitions (at, from_phase, to_phase, outcome, reason, swap_id)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (now, cur.phase.value, to.value, outcome.value, reason, swap_id),
            )
            c.execute(
                "UPDATE machine SET phase = ?, phase_since = ?, mode_since = ?, swap_id = ?,"
                " image_since = ? WHERE id = 1",
                (to.value, phase_since, mode_since, swap_id, image_since),
            )
        return MachineState(to, phase_since, mode_since, swap_id, image_since)

    def probe_write(self, now: float) -> None:
        """Write one row: raises when the database cannot take a write (full, read-only)."""
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO probe VALUES (1, ?)", (now,))

    def swaps(self, limit: int) -> list[SwapRecord]:
        rows = self.conn.execute(
            "SELECT id, direction, started, finished, ok FROM swaps ORDER BY id DESC LIMIT ?",
            (limit,),
        ).fetchall()
        out = []
        for sid, direction, started, finished, ok in rows:
            phases = tuple(
                PhaseTiming(*p)
                for p in self.conn.execute(
                    "SELECT phase, seconds, waited_seconds, outcome FROM swap_phases"
                    " WHERE swap_id = ? ORDER BY seq",
                    (sid,),
                )
            )
            out.append(
                SwapRecord(
                    sid, direction, started, finished, None if ok is None else bool(ok), phases
                )
            )
        return out

    def last_move(self, moves: Iterable[tuple[Phase, Phase]]) -> float | None:
        """When the latest of these transitions (from, to) was made; None: never."""
        times = [
            row[0]
            for frm, to in moves
            for row in self.conn.execute(
                "SELECT MAX(at) FROM transitions WHERE from_phase = ? AND to_phase = ?",
                (frm.value, to.value),
            )
            if row[0] is not None
        ]
        return max(times, default=None)

    def swap_times(self, since: float) -> list[float]:
        """How long each swap started at or after ``since`` and finished took, in seconds."""
        return [
            float(row[0])
            for row in self.conn.execute(
                "SELECT finished - started FROM swaps WHERE started >= ? AND finished IS NOT NULL"
                " ORDER BY id",
                (since,),
            )
        ]

    def swap_counts(self) -> dict[str, int]:
        rows = self.conn.execute(
            "SELECT direction, COUNT(*) FROM swaps WHERE ok = 1 GROUP BY direction"
        ).fetchall()
        return {str(d): int(n) for d, n in rows}

    def daily_counts(self, since: float) -> dict[str, dict[str, int]]:
        """Per UTC day from ``since``: swaps started (and of them failed), jobs submitted
        (and of them done, failed)."""
        days: dict[str, dict[str, int]] = {}

        def add(rows: Iterable[tuple[Any, ...]], keys: tuple[str, ...]) -> None:
            for day, *counts in rows:
                entry = days.setdefault(str(day), dict.fromkeys(DAILY_KEYS, 0))
                for key, n in zip(keys, counts, strict=True):
                    entry[key] = int(n or 0)

        add(
            self.conn.execute(
                "SELECT date(started, 'unixepoch'), COUNT(*), SUM(ok = 0) FROM swaps"
                " WHERE started >= ? GROUP BY 1",
                (since,),
            ),
            ("swaps", "swaps_failed"),
        )
        add(
            self.conn.execute(
                "SELECT date(created, 'unixepoch'), COUNT(*), SUM(state = ?), SUM(state = ?)"
                " FROM jobs WHERE created >= ? GROUP BY 1",
                (JobState.DONE.value, JobState.FAILED.value, since),
            ),
            ("jobs", "jobs_done", "jobs_failed"),
        )
        return dict(sorted(days.items()))

    # -- the hold on swaps (kept across a restart of the arbiter) -------------------------

    def hold(self) -> tuple[str, float] | None:
        row = self.conn.execute("SELECT holder, until FROM hold").fetchone()
        return None if row is None else (str(row[0]), float(row[1]))

    def set_hold(self, holder: str, until: float) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO hold VALUES (1, ?, ?)", (holder, until))

    def clear_hold(self) -> bool:
        with self._tx() as c:
            return c.execute("DELETE FROM hold").rowcount == 1

    # -- jobs ----------------------------------------------------------------------------

    _JOB_COLS = (
        "id, state, workflow, inputs, reason, attempts, prompt_id, outputs, created, started,"
        " finished, errors, cancel_requested, saved, restarts"
    )

    @staticmethod
    def _job(row: tuple[object, ...]) -> Job:
        return Job(
            id=str(row[0]),
            state=JobState(str(row[1])),
            workflow=json.loads(str(row[2])),
            inputs=tuple(json.loads(str(row[3]))),
            reason=str(row[4]),
            attempts=int(row[5]),  # type: ignore[call-overload]
            prompt_id=None if row[6] is None else str(row[6]),
            outputs=int(row[7]),  # type: ignore[call-overload]
            created=float(row[8]),  # type: ignore[arg-type]
            started=None if row[9] is None else float(row[9]),  # type: ignore[arg-type]
            finished=None if row[10] is None else float(row[10]),  # type: ignore[arg-type]
            errors=int(row[11]),  # type: ignore[call-overload]
            cancel_requested=bool(row[12]),
            saved=None
            if row[13] is None
            else tuple((str(f), str(d), str(k)) for f, d, k in json.loads(str(row[13]))),
            restarts=int(row[14]),  # type: ignore[call-overload]
        )

    def add_job(
        self, job_id: str, workflow: dict[str, object], inputs: tuple[str, ...], now: float
    ) -> Job:
        with self._tx() as c:
            c.execute(
                "INSERT INTO jobs (id, state, workflow, inputs, created) VALUES (?, ?, ?, ?, ?)",
                (job_id, JobState.QUEUED.value, json.dumps(workflow), json.dumps(inputs), now),
            )
        job = self.job(job_id)
        assert job is not None
        return job

    def job(self, job_id: str) -> Job | None:
        row = self.conn.execute(
            f"SELECT {self._JOB_COLS} FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        return None if row is None else self._job(row)

    def job_with_prompt(self, prompt_id: str) -> Job | None:
        """The job whose recorded prompt id this is (the latest), None when no job's."""
        row = self.conn.execute(
            f"SELECT {self._JOB_COLS} FROM jobs WHERE prompt_id = ? ORDER BY seq DESC LIMIT 1",
            (prompt_id,),
        ).fetchone()
        return None if row is None else self._job(row)

    def jobs_in(self, state: JobState) -> list[Job]:
        return [
            self._job(r)
            for r in self.conn.execute(
                f"SELECT {self._JOB_COLS} FROM jobs WHERE state = ? ORDER BY seq", (state.value,)
            )
        ]

    def queue_length(self) -> int:
        """Jobs not finished yet: queued and running."""
        row = self.conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE state IN (?, ?)",
            (JobState.QUEUED.value, JobState.RUNNING.value),
        ).fetchone()
        return int(row[0])

    def job_counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in JobState}
        for state, n in self.conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            counts[str(state)] = int(n)
        return counts

    def next_job(self) -> Job | None:
        """The running job (resumed first), else the oldest queued one."""
        running = self.jobs_in(JobState.RUNNING)
        if running:
            return running[0]
        queued = self.jobs_in(JobState.QUEUED)
        return queued[0] if queued else None

    def _update(self, job_id: str, sql: str, args: tuple[object, ...]) -> Job:
        with self._tx() as c:
            c.execute(f"UPDATE jobs SET {sql} WHERE id = ?", (*args, job_id))
        job = self.job(job_id)
        assert job is not None
        return job

    def start_attempt(self, job_id: str, prompt_id: str, now: float) -> Job:
        """A new attempt: its prompt id is recorded before the prompt is submitted."""
        return self._update(
            job_id,
            "state = ?, prompt_id = ?, attempts = attempts + 1, started = COALESCE(started, ?)",
            (JobState.RUNNING.value, prompt_id, now),
        )

    def set_prompt_id(self, job_id: str, prompt_id: str | None) -> Job:
        return self._update(job_id, "prompt_id = ?", (prompt_id,))

    def note(self, job_id: str, reason: str) -> Job:
        return self._update(job_id, "reason = ?", (reason,))

    def finish(self, job_id: str, state: JobState, reason: str, outputs: int, now: float) -> Job:
        return self._update(
            job_id,
            "state = ?, reason = ?, outputs = ?, finished = ?",
            (state.value, reason, outputs, now),
        )

    def set_saved(self, job_id: str, saved: list[tuple[str, str, str]]) -> Job:
        """Record the files a finished prompt saved (before they are fetched)."""
        return self._update(job_id, "saved = ?", (json.dumps(saved),))

    def engine_error(self, job_id: str, reason: str) -> Job:
        """Count an unexpected error of the arbiter while it ran this job."""
        return self._update(job_id, "errors = errors + 1, reason = ?", (reason,))

    def count_restart(self, job_id: str, reason: str) -> Job:
        """Count a restart of ComfyUI caused by this job (it died or hung under it)."""
        return self._update(job_id, "restarts = restarts + 1, reason = ?", (reason,))

    def workflow_peak(self, signature: str) -> int | None:
        """ComfyUI's largest VRAM seen under the workflow signature, None when never run."""
        row = self.conn.execute(
            "SELECT peak_bytes FROM workflow_peaks WHERE signature = ?", (signature,)
        ).fetchone()
        return None if row is None else int(row[0])

    def record_workflow_peak(self, signature: str, peak_bytes: int, now: float) -> int:
        """Keep the larger of the known peak and this run's; the peak now known."""
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO workflow_peaks (signature, peak_bytes, runs, updated) "
                "VALUES (?, ?, 1, ?) ON CONFLICT(signature) DO UPDATE SET "
                "peak_bytes = max(peak_bytes, excluded.peak_bytes), runs = runs + 1, "
                "updated = excluded.updated",
                (signature, peak_bytes, now),
            )
        peak = self.workflow_peak(signature)
        return peak if peak is not None else peak_bytes

    def cancel(self, job_id: str, now: float) -> JobState | None:
        """Cancel a job: a queued one at once (CANCELLED), a running one by request (RUNNING:
        the engine interrupts its prompt and ends it); None when it has ended already."""
        with self._tx() as c:
            cur = c.execute(
                "UPDATE jobs SET state = ?, reason = ?, finished = ? WHERE id = ? AND state = ?",
                (
                    JobState.CANCELLED.value,
                    "cancelled by request",
                    now,
                    job_id,
                    JobState.QUEUED.value,
                ),
            )
            if cur.rowcount == 1:
                return JobState.CANCELLED
            cur = c.execute(
                "UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND state = ?",
                (job_id, JobState.RUNNING.value),
            )
            return JobState.RUNNING if cur.rowcount == 1 else None


def _identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def job_dir(data_dir: Path, job_id: str) -> Path:
    return data_dir / "jobs" / job_id


def _check_expected(path: Path, marker: Path) -> None:
    """Refuse a database that is missing or empty where one was expected."""
    size = path.stat().st_size if path.exists() else None
    if size == 0:
        raise StoreError(
            f"the arbiter's database {path} is empty (0 bytes): it is kept for inspection; "
            "restore it from a backup, or move it away to start with an empty queue"
        )
    if size is None and marker.exists():
        raise StoreError(
            f"the arbiter's database {path} is missing while {marker} says one was created: "
            f"restore it from a backup, or remove {marker.name} to start with an empty queue"
        )
