"""Helpers shared by the scenarios' testinfra tests (molecule/*/tests).

pyproject.toml puts this directory on pytest's path, so a scenario's test imports it as
``from labtest import wait_for``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    what: str,
    predicate: Callable[[], T],
    timeout: float,
    step: float = 1.0,
    explain: Callable[[], object] | None = None,
) -> T:
    """Call ``predicate`` every ``step`` seconds until it returns a true value, and return it.

    Past ``timeout`` seconds it raises AssertionError naming ``what`` was awaited, with the
    predicate's last answer and, when given, what ``explain()`` returns (the state to read).
    The predicate is called once more after the deadline, so a slow host that got there in the
    last step passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:g} s waiting for {what} (last answer: {value!r})"
            if explain is not None:
                message += f"; {explain()}"
            raise AssertionError(message)
        time.sleep(step)
