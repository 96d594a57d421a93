"""The scenarios' shared test helper (molecule/_shared/labtest.py): the wait returns the
predicate's first true answer, and past its bound fails naming what it waited for."""

from __future__ import annotations

import time

import pytest
from labtest import wait_for


def test_returns_the_first_true_answer() -> None:
    answers = iter([None, 0, {"state": "done"}])
    assert wait_for("the job", lambda: next(answers), 5, step=0.01) == {"state": "done"}


def test_fails_past_its_bound_naming_what_and_the_state() -> None:
    calls = []
    started = time.monotonic()
    with pytest.raises(AssertionError) as err:
        wait_for("the swap", lambda: calls.append(1), 0.2, step=0.05, explain=lambda: "mode=llm")
    assert time.monotonic() - started >= 0.2
    # asked again once the bound passed
    assert len(calls) >= 4
    assert (
        str(err.value) == "timed out after 0.2 s waiting for the swap (last answer: None); mode=llm"
    )
