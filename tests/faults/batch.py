"""The batch that runs the fault matrix's cases on several rigs side by side.

Every selected test that takes the ``batch`` fixture and a ``case`` parameter is run, at the
first such test, by ``FAULTS_WORKERS`` (4) threads, each with its own rigs; each test then
reports its own case's outcome (its traceback included). Most of a case's time is spent
waiting on the arbiter's timers, so four rigs fit on two cores.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rig import Rig

Record = Callable[..., None]
SUMMARY: list[dict[str, Any]] = []
COLUMNS = (
    ("test", "test"),
    ("fault", "fault"),
    ("phase", "phase"),
    ("jobs", "jobs"),
    ("done", "done"),
    ("failed", "failed"),
    ("duplicates", "dup"),
    ("lost", "lost"),
    ("back_to_llm", "s to llm"),
    ("alerts", "alerts raised"),
    ("result", "result"),
)


# -- rigs and cases ---------------------------------------------------------------------


# pytest's TempPathFactory is not thread-safe (its first call creates the base directory;
# numbered directories are found by listing): the batch threads take turns
_MKTEMP_LOCK = threading.Lock()


class Worker:
    """One batch thread's rigs: a shared one reused from case to case (rebuilt when a case
    left it broken) and fresh ones, closed after each case."""

    def __init__(self, factory: pytest.TempPathFactory, name: str) -> None:
        self.factory = factory
        self.name = name
        self.rig: Rig | None = None
        self.fresh_rigs: list[Rig] = []

    def _mktemp(self, kind: str) -> Path:
        with _MKTEMP_LOCK:
            return self.factory.mktemp(f"{kind}-{self.name}-")

    def shared(self) -> Rig:
        if self.rig is not None and not self.rig.reusable():
            self.rig.close()
            self.rig = None
        if self.rig is None:
            self.rig = Rig(self._mktemp("shared")).start()
        return self.rig

    def fresh(self, start: bool = True, arbiter: bool = True, **kwargs: Any) -> Rig:
        rig = Rig(self._mktemp("fresh"), **kwargs)
        self.fresh_rigs.append(rig)
        return rig.start(arbiter=arbiter) if start else rig

    def close_fresh(self) -> None:
        while self.fresh_rigs:
            self.fresh_rigs.pop().close()

    def close(self) -> None:
        self.close_fresh()
        if self.rig is not None:
            self.rig.close()


@dataclass(frozen=True)
class Case:
    """One batch case: ``run(worker, record, test_name)``; ``cost`` orders the batch (the
    longest first)."""

    run: Callable[[Worker, Record, str], None]
    cost: float = 2.0


class Batch:
    def __init__(self, session: pytest.Session, factory: pytest.TempPathFactory) -> None:
        self.session = session
        self.factory = factory
        self.outcomes: dict[str, BaseException | None] = {}
        self.ran = False
        self.lock = threading.Lock()

    def check(self, item: pytest.Item) -> None:
        with self.lock:
            if not self.ran:
                self.ran = True
                self._run_all()
        if item.nodeid not in self.outcomes:
            pytest.fail("this case did not run in the batch")
        exc = self.outcomes[item.nodeid]
        if exc is not None:
            raise exc

    def _run_all(self) -> None:
        items = [
            i
            for i in self.session.items
            if "batch" in getattr(i, "fixturenames", ())
            and "case" in getattr(getattr(i, "callspec", None), "params", {})
            and not _skipped(i)
        ]
        order = {i.nodeid: n for n, i in enumerate(items)}
        todo: queue.Queue[pytest.Item] = queue.Queue()
        for item in sorted(items, key=lambda i: -i.callspec.params["case"].cost):  # type: ignore[attr-defined]
            todo.put(item)
        workers = [
            Worker(self.factory, f"w{n}")
            for n in range(max(1, int(os.environ.get("FAULTS_WORKERS", "4"))))
        ]

        def work(worker: Worker) -> None:
            while True:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    return
                case: Case = item.callspec.params["case"]  # type: ignore[attr-defined]

                def record(_item: pytest.Item = item, **row: Any) -> None:
                    row.setdefault("test", _item.name)
                    row["_order"] = (module_order(_item), order[_item.nodeid])
                    row["worker"] = worker.name
                    SUMMARY.append(row)

                try:
                    case.run(worker, record, item.name)
                    self.outcomes[item.nodeid] = None
                except BaseException as exc:
                    self.outcomes[item.nodeid] = exc
                finally:
                    worker.close_fresh()

        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in workers]
        started = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for w in workers:
            w.close()
        print(f"batch: {len(items)} cases on {len(workers)} rigs in {time.time() - started:.0f} s")


def _skipped(item: pytest.Item) -> bool:
    return any(
        m.name == "skip" or (m.name == "skipif" and m.args and m.args[0])
        for m in item.iter_markers()
    )


def module_order(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


# -- the summary ------------------------------------------------------------------------------


def render(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, rule]
    for row in rows:
        cells = [str(row.get(key, "")).replace("|", "/") for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r['test']}: {r['note']}" for r in rows if r.get("note")]
    extra = [f"- {r['test']}: {r['extra']}" for r in rows if r.get("extra")]
    return "\n".join([*lines, *(["", *notes] if notes else []), *(["", *extra] if extra else [])])
