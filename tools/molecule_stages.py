"""Where a scenario's time went: each molecule stage's seconds, read from a scenario's log.

    python tools/molecule_stages.py .cache/molecule-logs/*.log

A stage is timed from the first to the last timestamp the ansible.posix.profile_tasks callback
printed in it (tools/run-tests.sh enables it), so molecule's own start-up between stages and
testinfra's verify are not counted here: verify prints pytest's total and its slowest tests
(``--durations``) instead. One line per log: the scenario, then ``stage=seconds`` in order.
"""

from __future__ import annotations

import re
import sys
from datetime import datetime
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAGE = re.compile(r"➜ (\w+): (Executing|Executed)")
# profile_tasks: "Friday 04 December 2026  04:37:36 +0000 (0:00:00.070)       0:00:00.070"
_STAMP = re.compile(r"(\d\d:\d\d:\d\d) [+-]\d{4} \(\d+:\d\d:\d\d")
_PYTEST = re.compile(r"=+ (\d+ passed.*) in ([\d.]+)s")


def stages(text: str) -> list[tuple[str, float]]:
    """(stage, seconds) in the order molecule ran them; a stage without timestamps is left out."""
    out: list[tuple[str, float]] = []
    stage: str | None = None
    first = last = None
    for line in text.splitlines():
        line = _ANSI.sub("", line)
        found = _STAGE.search(line)
        if found:
            if found.group(2) == "Executing":
                stage, first, last = found.group(1), None, None
            elif stage is not None and first is not None and last is not None:
                seconds = (last - first).total_seconds() % 86400  # a run across midnight
                out.append((stage, seconds))
                stage = None
            continue
        stamp = _STAMP.search(line)
        if stamp and stage is not None:
            last = datetime.strptime(stamp.group(1), "%H:%M:%S")
            first = first or last
        pytest = _PYTEST.search(line)
        if pytest and stage == "verify":
            out.append(("verify", float(pytest.group(2))))
            stage = None
    return out


def main(paths: list[str]) -> int:
    for path in paths:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        parts = " ".join(f"{name}={seconds:.0f}" for name, seconds in stages(text))
        print(f"{Path(path).stem}: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
