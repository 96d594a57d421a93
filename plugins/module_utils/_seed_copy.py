# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Seeding an exported OpenVINO Model Server repository into the serving directory.

The logic of the module ``retrieval_seed``, in five modules: the options and the records
they share (``_seed_options``), reading the trees (``_seed_trees``), the plan
(``_seed_plan``), the copy and the child's :func:`main` (this one), running the copy under a
memory bound (``_seed_bound``).  Standard library only, so that the same sources also run as
a child process under a memory bound (see ``_seed_bound``).

Why it is shaped this way (seed ``000``, "Retrieval on the idle iGPUs"):

* ``cp -R`` of a 2.4 GB tree under a 512 MiB limit was killed (137) four times within a
  second: dirty pages, not volume.  Fast reads into slow writes pile up dirty pages, and a
  cgroup cannot reclaim them before they are written back.  So the dirty set is bounded.
* A copy gated on "the directory is missing" never delivers the next export: stale weights,
  served indefinitely.  So the copy is gated on a marker holding the revision.
* A marker written before the files lets a half-copied tree call itself current.  So the
  marker is written last, and removed before the first file of a new seed is touched.

A run
=====

1. Options are checked; every refusal names the option, the value and the fix.
2. ``src`` is read: regular files and directories only (any symbolic link, FIFO, socket or
   device is refused: nothing can point outside ``src``), the server's ``config.json`` at its
   top (with a ``model_config_list``: a ``src`` that holds ``gpu/`` and ``cpu/`` is their
   parent, and a model's directory has a ``config.json`` of its own), and each file's size
   and sha256.
3. ``dest`` is read: every entry, the sha256 of each file whose size is that of its ``src``
   file, the marker and the journal (below).
4. :func:`plan_seed` (pure) decides what to add, replace and remove, and why.  ``dest`` is
   current only when the marker is readable, holds the revision asked for and ``src``'s file
   list, every file of ``dest`` has the size and sha256 of its ``src`` file, ``dest`` holds
   nothing else and there is no journal.  A file that fails this under a current marker
   (tampered, or cut short by something else) is replaced; so the manifest in the marker is
   checked against the files, not trusted.
5. Unless nothing is to change (or in check mode), under an exclusive ``flock`` of ``dest``:

   a. the journal ``<marker>.partial`` is written (atomically), holding the revision being
      seeded: from here ``dest`` is this module's even without a marker;
   b. the marker is removed and ``dest`` fsynced: from here nothing says "current";
   c. what ``src`` does not hold is removed (deepest first);
   d. each missing or different file is copied (:func:`copy_file`), in path order with the
      top-level ``config.json`` last: a server polling its config sees the new one only when
      the files it names are in place;
   e. the marker is written (atomically, fsynced), *last*;
   f. the journal is removed.

   An interrupted seed (killed, out of space, rebooted) leaves the journal and no marker; the
   next run verifies every file and copies what is missing or different.  It never marks a
   tree it has not verified in full.

Per file (:func:`copy_file`): a temporary ``.<name>.<random>.seed-part`` in the file's
destination directory; the copy in ``chunk_size`` pieces through one buffer, hashed on the
way (a ``src`` that changed since it was read is refused); every ``flush_bytes``
``fdatasync`` and ``POSIX_FADV_DONTNEED`` on both files' copied range; at the end ``fsync``,
``POSIX_FADV_DONTNEED`` on the destination and the source, rename into place, fsync of the
directory.  The next file starts only after that.

Whose ``dest`` it is.  A seed removes from ``dest`` what ``src`` does not hold.  A ``dest``
with neither marker nor journal that holds anything ``src`` does not was not seeded by this
module (a mistyped path, a shared directory): it is refused, not emptied.  A ``dest`` that
holds a subset of ``src`` (an earlier ``cp``) is verified and completed.

What it never does: open a device.  Seeding holds no GPU; it runs on the host, outside the
server's container, and the card's arbiter never sees it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import posixpath
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (
    GENERATOR,
    DestEntry,
    FileRecord,
    MarkerState,
    SeedError,
    SeedOptions,
    SeedPlan,
    apply_overrides,
    check_tree_relation,
    validate_options,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_plan import (
    copy_order,
    diff_of,
    dirty_bytes_bound,
    memory_bound_bytes,
    plan_seed,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_trees import (
    _fadvise_dontneed,
    _read_journal,
    marker_document,
    read_marker,
    scan_dest,
    scan_source,
)

__all__ = [
    "PART_SUFFIX",
    "copy_file",
    "main",
    "seed",
]

PART_SUFFIX = ".seed-part"
"""Suffix of the temporary files (``.<name>.<random>.seed-part`` beside ``<name>``)."""


# --- writing -----------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename, an unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


def _temporary(directory: str, name: str) -> tuple[int, str]:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=PART_SUFFIX)
    os.fchmod(fd, 0o644)
    return fd, tmp


def _discard(fd: int, tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _write_small_atomic(directory: str, name: str, data: bytes) -> None:
    """``directory/name`` replaced by ``data``: temporary file, fsync, rename, fsync."""
    fd, tmp = _temporary(directory, name)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
        _fadvise_dontneed(fd)
    except BaseException:
        _discard(fd, tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        _discard(-1, tmp)
        raise
    _fsync_dir(directory)


def copy_file(
    src_path: str,
    dest_dir: str,
    name: str,
    record: FileRecord,
    buffer: bytearray,
    flush_bytes: int,
) -> None:
    """Copy one file (see the module's docstring); on any failure the temporary file is
    removed and the target is left as it was."""
    fd_in = os.open(src_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd_in).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", src_path)
        fd_out, tmp = _temporary(dest_dir, name)
        try:
            view = memoryview(buffer)
            digest = hashlib.sha256()
            done = flushed = 0
            while True:
                n = os.readv(fd_in, [buffer])
                if n == 0:
                    break
                digest.update(view[:n])
                _write_all(fd_out, view[:n])
                done += n
                if flush_bytes and done - flushed >= flush_bytes:
                    os.fdatasync(fd_out)
                    _fadvise_dontneed(fd_out, flushed, done - flushed)
                    _fadvise_dontneed(fd_in, flushed, done - flushed)
                    flushed = done
            if done != record.size or digest.hexdigest() != record.sha256:
                raise SeedError(
                    f"src: {src_path} changed while the seed ran (now {done} bytes, sha256 "
                    f"{digest.hexdigest()}; read as {record.size} bytes, {record.sha256}): dest "
                    "is left without a marker; run the seed again once the export is complete"
                )
            os.fsync(fd_out)
            _fadvise_dontneed(fd_out)
            _fadvise_dontneed(fd_in)
        except BaseException:
            _discard(fd_out, tmp)
            raise
        os.close(fd_out)
        try:
            os.replace(tmp, os.path.join(dest_dir, name))
        except BaseException:
            _discard(-1, tmp)
            raise
        _fsync_dir(dest_dir)
    finally:
        os.close(fd_in)


def _ensure_dir(dest: str, rel_dir: str) -> str:
    """``dest/rel_dir``, each missing level made (0755) and its parent fsynced."""
    path = dest
    for part in rel_dir.split("/") if rel_dir else []:
        parent, path = path, os.path.join(path, part)
        if not os.path.isdir(path):
            os.mkdir(path, 0o755)
            _fsync_dir(parent)
    return path


@contextlib.contextmanager
def _locked(dest: str) -> Iterator[None]:
    """An exclusive ``flock`` of ``dest`` for the seed (best effort where locks fail)."""
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SeedError(
                    f"dest: another seed is writing into {dest} (it holds the directory's lock); "
                    "wait for it to finish, then run again"
                ) from None
        yield
    finally:
        os.close(fd)


def _make_dest(dest: str) -> None:
    missing = []
    path = dest
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        os.mkdir(path, 0o755)
        _fsync_dir(os.path.dirname(path))


def _execute(
    options: SeedOptions, src: str, dest: str, source: Sequence[FileRecord], plan: SeedPlan
) -> tuple[int, int, int]:
    """Carry out ``plan``; (files copied, bytes copied, entries removed)."""
    journal = json.dumps({"revision": options.revision, "generator": GENERATOR}) + "\n"
    _write_small_atomic(dest, options.journal, journal.encode())
    marker_path = os.path.join(dest, options.marker)
    if os.path.lexists(marker_path):
        os.unlink(marker_path)
        _fsync_dir(dest)

    touched: set[str] = set()
    for item in plan.remove:
        path = os.path.join(dest, item.rstrip("/"))
        if item.endswith("/"):
            os.rmdir(path)
        else:
            os.unlink(path)
        touched.add(os.path.dirname(path))
    for directory in sorted(touched, key=lambda d: -d.count("/")):
        if os.path.isdir(directory):
            _fsync_dir(directory)

    by_path = {f.path: f for f in source}
    buffer = bytearray(options.chunk_size)
    copied = copied_bytes = 0
    for rel in copy_order(plan.add + plan.replace):
        record = by_path[rel]
        target_dir = _ensure_dir(dest, posixpath.dirname(rel))
        if rel in options.overrides:
            _write_small_atomic(
                target_dir, posixpath.basename(rel), options.overrides[rel].encode()
            )
            copied += 1
            copied_bytes += record.size
            continue
        copy_file(
            os.path.join(src, rel),
            target_dir,
            posixpath.basename(rel),
            record,
            buffer,
            options.flush_bytes,
        )
        copied += 1
        copied_bytes += record.size

    _write_small_atomic(dest, options.marker, marker_document(options.revision, source))
    os.unlink(os.path.join(dest, options.journal))
    _fsync_dir(dest)
    return copied, copied_bytes, len(plan.remove)


def seed(options: SeedOptions, check_mode: bool = False, diff: bool = False) -> dict[str, Any]:
    """Make ``options.dest`` the tree ``options.src`` marked at ``options.revision``; the
    module's result (without the memory-bound keys, which the caller adds)."""
    src = os.path.realpath(options.src)
    dest = os.path.realpath(options.dest)
    check_tree_relation(src, dest)
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise SeedError(f"dest: {dest} exists and is not a directory; give a directory")
    source = apply_overrides(
        scan_source(src, options.marker, options.chunk_size), options.overrides
    )
    wanted = {f.path: f for f in source}
    reserved = (options.marker, options.journal)

    def plan_now() -> tuple[dict[str, DestEntry], MarkerState, tuple[bool, str | None], SeedPlan]:
        if os.path.isdir(dest):
            entries = scan_dest(dest, wanted, reserved, options.chunk_size)
            marker = read_marker(os.path.join(dest, options.marker))
            journal = _read_journal(os.path.join(dest, options.journal))
        else:
            entries, marker, journal = {}, MarkerState(present=False), (False, None)
        plan = plan_seed(
            source,
            entries,
            marker,
            options.revision,
            journal_present=journal[0],
            journal_revision=journal[1],
            dest_path=dest,
            marker_name=options.marker,
        )
        return entries, marker, journal, plan

    copied = copied_bytes = removed = 0
    try:
        if check_mode:
            entries, marker, journal, plan = plan_now()
        else:
            _make_dest(dest)
            with _locked(dest):
                entries, marker, journal, plan = plan_now()
                if plan.changed:
                    copied, copied_bytes, removed = _execute(options, src, dest, source, plan)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise SeedError(
            f"dest: cannot seed {dest}: {exc.strerror or exc}{where}; dest is left without a "
            "marker and the next run verifies it and completes the seed"
        ) from None

    largest = max(source, key=lambda f: (f.size, f.path))
    previous = marker.revision if marker.valid else None
    result: dict[str, Any] = {
        "changed": plan.changed,
        "src": src,
        "dest": dest,
        "revision": options.revision,
        "previous_revision": previous,
        "interrupted_revision": journal[1] if journal[0] else None,
        "marker": os.path.join(dest, options.marker),
        "plan": plan.to_dict(),
        "reasons": list(plan.reasons),
        "warnings": list(plan.warnings),
        "files_total": len(source),
        "bytes_total": sum(f.size for f in source),
        "files_copied": copied,
        "bytes_copied": copied_bytes,
        "files_removed": removed,
        "largest_file": largest.path,
        "largest_file_bytes": largest.size,
        "dirty_bytes_bound": dirty_bytes_bound(
            largest.size, options.chunk_size, options.flush_bytes
        ),
        "memory_bound_bytes": memory_bound_bytes(
            largest.size, options.chunk_size, options.flush_bytes
        ),
    }
    if diff:
        result["diff"] = diff_of(dest, source, entries, previous, options.revision)
    return result


def _answer(doc: dict[str, Any]) -> None:
    # The child is not an Ansible module (no AnsibleModule, no exit_json): its answer is one
    # JSON line on standard output, which the module reads (parse_child_output).
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str]) -> int:
    """The child (:func:`child_argv`): one JSON line out; 0, or 1 on a refusal."""
    try:
        request = json.loads(argv[0]) if len(argv) == 1 else None
        if not isinstance(request, dict) or not isinstance(request.get("options"), dict):
            raise SeedError('the child seed takes one JSON argument: {"options": {...}}')
        result = seed(validate_options(request["options"]), diff=bool(request.get("diff")))
    except (SeedError, ValueError) as exc:
        _answer({"failed": True, "msg": str(exc)})
        return 1
    _answer({"failed": False, "result": result})
    return 0
