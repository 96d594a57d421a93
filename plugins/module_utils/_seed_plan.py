# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a seed changes and why (:func:`plan_seed`, pure), the order of the copy, the memory
it may dirty and need (:func:`dirty_bytes_bound`, :func:`memory_bound_bytes`; see
``_seed_bound``) and its diff.  Part of the module ``retrieval_seed``'s logic; the overview
is in ``_seed_copy``.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (
    DEFAULT_MARKER,
    JOURNAL_SUFFIX,
    MIB,
    SERVER_CONFIG,
    DestEntry,
    FileRecord,
    MarkerState,
    SeedError,
    SeedPlan,
)

__all__ = [
    "RUNTIME_ALLOWANCE",
    "copy_order",
    "diff_of",
    "dirty_bytes_bound",
    "memory_bound_bytes",
    "plan_seed",
]

RUNTIME_ALLOWANCE = 64 * MIB
"""The interpreter and this code, in the bound (a child seed peaked at 23 MiB of RSS with the
default chunk on Python 3.11; the test measures it stays below this plus one chunk)."""


_FOREIGN_SHOWN = 5


# --- the plan ----------------------------------------------------------------------------


def _parents(path: str) -> Iterator[str]:
    parent = posixpath.dirname(path)
    while parent:
        yield parent
        parent = posixpath.dirname(parent)


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def plan_seed(
    source: Sequence[FileRecord],
    dest: Mapping[str, DestEntry],
    marker: MarkerState,
    revision: str,
    *,
    journal_present: bool = False,
    journal_revision: str | None = None,
    dest_path: str = "dest",
    marker_name: str = DEFAULT_MARKER,
) -> SeedPlan:
    """What turns ``dest`` into ``source`` marked at ``revision``; raises :class:`SeedError`
    when it would remove entries from a ``dest`` this module has no record of seeding."""
    wanted = {f.path: f for f in source}
    wanted_dirs = {parent for f in source for parent in _parents(f.path)}
    add: list[str] = []
    replace: list[str] = []
    for record in source:
        entry = dest.get(record.path)
        if entry is None or entry.kind != "file":
            add.append(record.path)
        elif entry.size != record.size or entry.sha256 != record.sha256:
            replace.append(record.path)
    remove = [
        path + "/" if entry.kind == "dir" else path
        for path, entry in dest.items()
        if not (
            (entry.kind == "file" and path in wanted)
            or (entry.kind == "dir" and path in wanted_dirs)
        )
    ]
    remove.sort(key=lambda p: (-p.rstrip("/").count("/"), p))
    if remove and not marker.present and not journal_present:
        shown = ", ".join(remove[:_FOREIGN_SHOWN]) + (
            ", ..." if len(remove) > _FOREIGN_SHOWN else ""
        )
        raise SeedError(
            f"dest: {dest_path} holds {_plural(len(remove), 'entry', 'entries')} that src does "
            f"not ({shown}) and no seed marker ({marker_name}): it was not seeded by this module, "
            "and a seed removes what src does not hold; give a directory of its own as dest, or "
            "empty this one"
        )

    reasons: list[str] = []
    warnings: list[str] = []
    if journal_present:
        what = repr(journal_revision) if journal_revision else "an unknown revision"
        reasons.append(
            f"a seed of {what} was interrupted ({marker_name}{JOURNAL_SUFFIX} is there): every "
            "file is verified and the seed completed"
        )
    if not marker.present:
        if not dest:
            reasons.append("dest is empty: a first seed")
        elif not journal_present:
            reasons.append("no marker: dest has not been marked current")
    elif not marker.valid:
        reasons.append(f"the marker cannot be used: {marker.problem}")
    elif marker.revision != revision:
        reasons.append(f"the marker is at revision {marker.revision!r}, {revision!r} is asked for")
    elif marker.files != tuple(source):
        reasons.append("the marker's file list differs from src")
        warnings.append(
            f"src differs from the tree marked at revision {revision!r}, under the same "
            "revision: dest is brought to src and marked again; give every new export a new "
            "revision, so that the marker tells them apart"
        )
    if add:
        reasons.append(f"{_plural(len(add), 'file is', 'files are')} missing from dest")
    if replace:
        reasons.append(
            f"{_plural(len(replace), 'file differs', 'files differ')} from src (size or sha256)"
        )
    if remove:
        reasons.append(f"{_plural(len(remove), 'entry', 'entries')} in dest not in src")
    return SeedPlan(
        add=tuple(add),
        replace=tuple(replace),
        remove=tuple(remove),
        write_marker=bool(reasons),
        reasons=tuple(reasons),
        warnings=tuple(warnings),
    )


def copy_order(paths: Iterable[str]) -> list[str]:
    """Path order, with the server's top-level ``config.json`` last."""
    return sorted(paths, key=lambda p: (p == SERVER_CONFIG, p))


def dirty_bytes_bound(largest_file: int, chunk_size: int, flush_bytes: int) -> int:
    """The most dirty bytes the copy lets pile up: the unflushed part of one file."""
    if flush_bytes <= 0:
        return largest_file
    return min(largest_file, flush_bytes + chunk_size)


def memory_bound_bytes(largest_file: int, chunk_size: int, flush_bytes: int) -> int:
    """The cgroup bound to run a seed under (see the module's docstring), in whole MiB."""
    need = (
        RUNTIME_ALLOWANCE
        + chunk_size
        + 2 * dirty_bytes_bound(largest_file, chunk_size, flush_bytes)
    )
    return -(-need // MIB) * MIB


def diff_of(
    dest_path: str,
    source: Sequence[FileRecord],
    dest: Mapping[str, DestEntry],
    previous_revision: str | None,
    revision: str,
) -> dict[str, str]:
    """Ansible's diff: ``dest``'s files before and after, one line per file."""

    def line(path: str, size: int, sha256: str | None) -> str:
        return f"{path}  {size} bytes" + (f"  sha256:{sha256}" if sha256 else "") + "\n"

    before = "".join(
        line(p, e.size, e.sha256) if e.kind == "file" else f"{p}  ({e.kind})\n"
        for p, e in sorted(dest.items())
        if e.kind != "dir"
    )
    after = "".join(line(f.path, f.size, f.sha256) for f in source)
    was = f"revision {previous_revision}" if previous_revision else "not marked current"
    return {
        "before_header": f"{dest_path} ({was})",
        "after_header": f"{dest_path} (revision {revision})",
        "before": before,
        "after": after,
    }
