"""Run the arbiter with its wall clock stepped: a simulation at the OS edge (the machine's
clock is shared and is not touched). ``time.time`` (and what reads it: logging, datetime's
now) answers the real time plus the offset in seconds that the file ``argv[1]`` holds (0
when it is missing), re-read when it changes; ``time.monotonic`` is left alone, as an NTP
step or a manual change of the clock leaves the kernel's monotonic clock alone.

Usage (the rig's wrapper): ``python wallclock.py OFFSET_FILE PYTHON -m MODULE ARGS...``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

_real_time = time.time
_state = {"mtime": -1, "offset": 0.0}


def _offset(path: str) -> float:
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0.0
    if mtime != _state["mtime"]:
        try:
            with open(path, encoding="utf-8") as fh:
                _state["offset"] = float(fh.read().strip() or 0)
            _state["mtime"] = mtime
        except (OSError, ValueError):
            pass
    return float(_state["offset"])


def main() -> None:
    path = sys.argv[1]
    rest = sys.argv[2:]
    if rest and rest[0] != "-m":  # the interpreter's path: this one runs the module
        rest = rest[1:]
    assert rest[0] == "-m", rest
    module, args = rest[1], rest[2:]

    def stepped() -> float:
        return _real_time() + _offset(path)

    time.time = stepped
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
