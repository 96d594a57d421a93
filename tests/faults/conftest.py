"""Fixtures of the fault-injection suite: the batch (batch.py) that runs the matrix on
several rigs side by side, fresh rigs (fake Docker, fake vLLM and ComfyUI, the real arbiter,
all processes) for the other tests, and the summary table written to
tests/output/faults-summary.md."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch import SUMMARY, Batch, Record, module_order, render
from rig import REPO, Rig


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "faults: fault injection against the arbiter run as a real process"
    )
    config.addinivalue_line(
        "markers", "faults_random: the randomized fault run (1,000 jobs, SIGKILLs, crashes)"
    )


@pytest.fixture(scope="session")
def batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Batch:
    return Batch(request.session, tmp_path_factory)


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(start: bool = True, arbiter: bool = True, **kwargs: Any) -> Rig:
        rig = Rig(tmp_path / f"rig{len(rigs)}", **kwargs)
        rigs.append(rig)
        return rig.start(arbiter=arbiter) if start else rig

    yield make
    for rig in rigs:
        rig.close()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Record:
    def add(**row: Any) -> None:
        row.setdefault("test", request.node.name)
        row["_order"] = (module_order(request.node), 10**6 + len(SUMMARY))
        SUMMARY.append(row)

    return add


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The matrix's rows to tests/output/faults-summary.md (.json), the randomized run's to
    faults-random.md (.json); both printed."""
    rows = sorted(SUMMARY, key=lambda r: r.get("_order", ("", 0)))
    groups = {
        "faults-summary": [r for r in rows if not r["test"].startswith("test_randomized")],
        "faults-random": [r for r in rows if r["test"].startswith("test_randomized")],
    }
    out = REPO / "tests" / "output"
    for name, group in groups.items():
        if not group:
            continue
        out.mkdir(parents=True, exist_ok=True)
        table = render(group)
        (out / f"{name}.md").write_text(
            "# Fault injection against the arbiter\n\n"
            "`s to llm`: seconds from the fault's first hit (or the kill; for the randomized "
            "run: from its start) until the arbiter was back to a consistent llm (serve_llm, "
            "vLLM up and answering, ComfyUI stopped) with every job ended.\n\n" + table + "\n"
        )
        (out / f"{name}.json").write_text(
            json.dumps([{k: v for k, v in r.items() if k != "_order"} for r in group], indent=1)
            + "\n"
        )
        terminalreporter.write_sep("=", f"fault injection summary (tests/output/{name}.md)")
        for line in table.splitlines():
            terminalreporter.write_line(line)
