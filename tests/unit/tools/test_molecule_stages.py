"""tools/molecule_stages.py: each stage's seconds from a scenario's log, as molecule and the
profile_tasks callback print it (the lines below are of a card_path run's log, shortened)."""

from __future__ import annotations

from molecule_stages import stages

LOG = """\
INFO     card_path \u279c destroy: Executing
  \u2502 Friday 04 December 2026  04:37:36 +0000 (0:00:00.070)       0:00:00.070
  \u2502 Friday 04 December 2026  04:37:52 +0000 (0:00:09.870)       0:00:15.570
INFO     card_path \u279c destroy: Executed: Successful
INFO     card_path \u279c converge: Executing
  \u2502 \x1b[0;33mFriday 04 December 2026  23:59:50 +0000 (0:00:00.160)       0:00:00.160\x1b[0m
  \u2502 Friday 04 December 2026  00:01:00 +0000 (0:00:06.277)       0:01:10.437
INFO     card_path \u279c converge: Executed: Successful
INFO     card_path \u279c verify: Executing
  \u2502 ============================= 17 passed in 29.37s
INFO     card_path \u279c verify: Executed: Successful
INFO     card_path \u279c destroy: Executing
INFO     card_path \u279c destroy: Executed: Successful
"""


def test_each_stage_from_its_first_to_its_last_timestamp() -> None:
    # destroy: 16 s; converge across midnight: 70 s; verify: pytest's own total; the last
    # destroy printed no timestamp and is left out
    assert stages(LOG) == [("destroy", 16.0), ("converge", 70.0), ("verify", 29.37)]
