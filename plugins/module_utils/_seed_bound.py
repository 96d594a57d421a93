# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Running a seed under a memory bound (the module ``retrieval_seed``; the seed itself and
its overview are in ``_seed_copy``).

The memory bound
================

The dirty pages at any moment are the unflushed part of one file: at most
:func:`dirty_bytes_bound` = ``min(largest file, flush_bytes + chunk_size)`` (the largest
file when ``flush_bytes`` is 0: the seed's "one file" bound).  The process holds one
``chunk_size`` buffer.  :func:`memory_bound_bytes` = ``RUNTIME_ALLOWANCE`` (the interpreter)
+ ``chunk_size`` + twice the dirty bound (the destination's dirty range and the source's clean
range of the same bytes, charged to the cgroup until ``POSIX_FADV_DONTNEED`` drops them),
rounded up to a MiB.  With the default 64 MiB ``flush_bytes`` that is 204 MiB, whatever the
size of the models.

The module runs the copy under that bound in a transient systemd scope
(:func:`scope_argv`: ``systemd-run --scope -p MemoryMax=<bound>``): the child is the
interpreter reading a program on its standard input that defines the seed's modules from
their sources and runs :func:`main` (:func:`child_argv`, :func:`child_program`), its answer
one JSON line on its standard output (:func:`parse_child_output`).  Where systemd does not
run the host, the module says so and seeds without the bound (or fails, with
``memory_bound=required``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils import (
    _seed_copy,
    _seed_options,
    _seed_plan,
    _seed_trees,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (
    SeedError,
    SeedOptions,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_trees import _walk

__all__ = [
    "MEMORY_BOUND_CHOICES",
    "bound_method",
    "child_argv",
    "child_program",
    "largest_source_file",
    "parse_child_output",
    "scope_argv",
]

MEMORY_BOUND_CHOICES = ("auto", "required", "off")
SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
"""``sd_booted()``'s test: systemd runs the host when this directory exists."""


# --- running under a memory bound --------------------------------------------------------


def largest_source_file(src: str) -> int:
    """The size of the largest regular file under ``src`` (no hashing; links not followed)."""
    largest = 0
    with contextlib.suppress(OSError):
        for _rel, entry in _walk(os.path.realpath(src)):
            if entry.is_file(follow_symlinks=False):
                largest = max(largest, entry.stat(follow_symlinks=False).st_size)
    return largest


def bound_method(
    setting: str, systemd_run: str | None, runtime_dir: str | None = None
) -> tuple[bool, str]:
    """(run the seed under ``systemd-run``, why not); raises :class:`SeedError` when
    ``setting`` is ``required`` and the bound cannot be set."""
    if setting not in MEMORY_BOUND_CHOICES:
        raise SeedError(
            f"memory_bound: got {setting!r}; give one of {', '.join(MEMORY_BOUND_CHOICES)}"
        )
    if setting == "off":
        return False, "memory_bound=off: the seed ran without a memory bound"
    runtime_dir = runtime_dir or SYSTEMD_RUNTIME_DIR
    if not os.path.isdir(runtime_dir):
        why = f"systemd does not run this host (no {runtime_dir})"
    elif systemd_run is None:
        why = "systemd-run is not installed"
    else:
        return True, ""
    if setting == "required":
        raise SeedError(
            f"memory_bound: required, but {why}; seed on a host that systemd runs, or give "
            "memory_bound=auto to seed without the bound where it cannot be set"
        )
    return False, f"{why}: the seed ran without a memory bound"


def scope_argv(systemd_run: str, bound: int, dest: str) -> list[str]:
    """The ``systemd-run`` prefix that puts the child in a transient scope under ``bound``."""
    return [
        systemd_run,
        "--scope",
        "--quiet",
        "--collect",
        f"--description=cardshare.gpuhost.retrieval_seed into {dest}",
        "-p",
        f"MemoryMax={bound}",
        "--",
    ]


def child_argv(python: str, options: SeedOptions, diff: bool = False) -> list[str]:
    """The child seed: ``python`` reading :func:`child_program` on standard input,
    ``{"options": ..., "diff": ...}`` as JSON in its only argument."""
    request = {"options": options.to_params(), "diff": diff}
    return [python, "-I", "-", json.dumps(request, sort_keys=True)]


# The child's program: standard library only.  It defines each module of the seed from its
# source, under the module's own name (so that their imports of one another find it), in the
# order given (each after those it imports), then runs the last one's main.
_CHILD_PROGRAM = """\
import json, sys, types
for name, source in json.loads({modules!r}):
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, name, "exec"), module.__dict__)
raise SystemExit(module.main(sys.argv[1:]))
"""


def _child_modules() -> list[Any]:
    """The modules the child runs, each after those it imports; the last holds ``main``."""
    return [_seed_options, _seed_trees, _seed_plan, _seed_copy]


def child_program() -> str | None:
    """The child's program with the source of each of its modules (read from their files or
    from AnsiballZ's zip, where the module imported them from), or None when one cannot be
    read."""
    sources = []
    for module in _child_modules():
        try:
            sources.append((module.__name__, inspect.getsource(module)))
        except (OSError, TypeError):
            return None
    return _CHILD_PROGRAM.format(modules=json.dumps(sources))


def parse_child_output(rc: int, out: str, err: str, bound: int) -> dict[str, Any]:
    """The child's result from its exit code and output; raises :class:`SeedError` with what
    went wrong (its own refusal, or a kill under the bound)."""
    answer: dict[str, Any] | None = None
    for line in reversed(out.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "failed" in doc:
            answer = doc
            break
    if answer is not None and answer.get("failed"):
        raise SeedError(str(answer.get("msg")))
    if answer is not None and rc == 0 and isinstance(answer.get("result"), dict):
        return dict(answer["result"])
    signum = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        raise SeedError(
            f"the seed was killed ({name}) under MemoryMax={bound}: dest is left without a "
            "marker and the next run completes it; a kill at the bound means the bound is "
            "wrong for this host: lower flush_bytes, or give memory_bound=off, and report it"
        )
    tail = err.strip().splitlines()[-3:]
    raise SeedError(
        f"the seed under systemd-run ended with rc {rc} and no answer"
        + (f": {' / '.join(tail)}" if tail else "")
        + "; give memory_bound=off to seed without the bound"
    )
