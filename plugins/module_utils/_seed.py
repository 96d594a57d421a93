# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Seeding an exported OpenVINO Model Server repository into the serving directory.

The logic of the module ``retrieval_seed``; standard library only, so that the same source
also runs as a child process under a memory bound (:func:`main`, see below).

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

What it never does: open a device.  Seeding holds no GPU; it runs on the host, outside the
server's container, and the card's arbiter never sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import inspect
import json
import os
import posixpath
import signal
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_FLUSH_BYTES",
    "DEFAULT_MARKER",
    "JOURNAL_SUFFIX",
    "MEMORY_BOUND_CHOICES",
    "PART_SUFFIX",
    "RUNTIME_ALLOWANCE",
    "SERVER_CONFIG",
    "DestEntry",
    "FileRecord",
    "MarkerState",
    "SeedError",
    "SeedOptions",
    "SeedPlan",
    "apply_overrides",
    "bound_method",
    "check_tree_relation",
    "child_argv",
    "child_program",
    "copy_file",
    "copy_order",
    "diff_of",
    "dirty_bytes_bound",
    "largest_source_file",
    "main",
    "marker_document",
    "memory_bound_bytes",
    "parse_child_output",
    "parse_marker",
    "plan_seed",
    "read_marker",
    "scan_dest",
    "scan_source",
    "scope_argv",
    "seed",
    "validate_options",
]

DEFAULT_MARKER = ".cardshare-seed"
JOURNAL_SUFFIX = ".partial"
"""The journal is ``<marker><JOURNAL_SUFFIX>``: written first, removed after the marker."""
PART_SUFFIX = ".seed-part"
"""Suffix of the temporary files (``.<name>.<random>.seed-part`` beside ``<name>``)."""
SERVER_CONFIG = "config.json"
"""The server's config, at the top of every exported tree; copied after every other file."""
MARKER_FORMAT = 1
GENERATOR = "cardshare.gpuhost.retrieval_seed"

MIB = 1024 * 1024
DEFAULT_CHUNK_SIZE = 4 * MIB
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 256 * MIB
DEFAULT_FLUSH_BYTES = 64 * MIB
RUNTIME_ALLOWANCE = 64 * MIB
"""The interpreter and this code, in the bound (a child seed peaked at 23 MiB of RSS with the
default chunk on Python 3.11; the test measures it stays below this plus one chunk)."""
MAX_REVISION_LENGTH = 200
MAX_MARKER_BYTES = 64 * MIB
MEMORY_BOUND_CHOICES = ("auto", "required", "off")
SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
"""``sd_booted()``'s test: systemd runs the host when this directory exists."""
_FOREIGN_SHOWN = 5


class SeedError(Exception):
    """A refusal or a failure, worded for the user (option, value, fix)."""


@dataclass(frozen=True)
class SeedOptions:
    """The checked options of one seed (:func:`validate_options`)."""

    src: str
    dest: str
    revision: str
    marker: str = DEFAULT_MARKER
    chunk_size: int = DEFAULT_CHUNK_SIZE
    flush_bytes: int = DEFAULT_FLUSH_BYTES
    # relative path -> text written instead of src's file of that path (a graph with guards)
    overrides: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def journal(self) -> str:
        return self.marker + JOURNAL_SUFFIX

    def to_params(self) -> dict[str, Any]:
        params = dataclasses.asdict(self)
        params["overrides"] = dict(self.overrides)
        return params


@dataclass(frozen=True)
class FileRecord:
    """A file of the tree: its path relative to the tree (``/``-separated), size, sha256."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class DestEntry:
    """An entry of ``dest``: ``kind`` is ``file``, ``dir`` or ``other`` (a link, a FIFO...);
    ``sha256`` is read only for a file whose size is that of its ``src`` file."""

    path: str
    kind: str
    size: int = 0
    sha256: str | None = None


@dataclass(frozen=True)
class MarkerState:
    """What the marker says: ``present`` (a file of that name exists); ``revision`` and
    ``files`` when it is readable; ``problem`` when it exists but cannot be used."""

    present: bool
    revision: str | None = None
    files: tuple[FileRecord, ...] = ()
    problem: str | None = None

    @property
    def valid(self) -> bool:
        return self.present and self.problem is None and self.revision is not None


@dataclass(frozen=True)
class SeedPlan:
    """What a seed changes.  ``remove`` is deepest first; a directory ends with ``/``."""

    add: tuple[str, ...]
    replace: tuple[str, ...]
    remove: tuple[str, ...]
    write_marker: bool
    reasons: tuple[str, ...]
    warnings: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.add or self.replace or self.remove or self.write_marker)

    def to_dict(self) -> dict[str, list[str]]:
        return {"add": list(self.add), "replace": list(self.replace), "remove": list(self.remove)}


# --- options -----------------------------------------------------------------------------


def _int_option(params: Mapping[str, Any], name: str, default: int) -> int:
    value = params.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SeedError(f"{name}: got {value!r}; give a number of bytes")
    return value


def _check_revision(revision: Any) -> str:
    if not isinstance(revision, str):
        raise SeedError(
            f"revision: got {revision!r}; give the revision of the exported repository as a "
            "string (quote it in YAML)"
        )
    fix = (
        "give the revision the repository was exported at (for example the model image tag or "
        "the export's commit): the marker holds it, and a new revision is what re-seeds"
    )
    if not revision.strip():
        raise SeedError(f"revision: got {revision!r} (empty); {fix}")
    if revision != revision.strip():
        raise SeedError(
            f"revision: got {revision!r}, with blanks around it; remove them (the marker "
            "compares the revision exactly, so a stray blank would re-seed)"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in revision):
        raise SeedError(
            f"revision: got {revision!r}, which holds a control character; give a single-line "
            "revision string"
        )
    if len(revision) > MAX_REVISION_LENGTH:
        raise SeedError(
            f"revision: got {len(revision)} characters; at most {MAX_REVISION_LENGTH} (a tag, a "
            "commit or a date, not a description)"
        )
    return revision


def _check_marker(marker: Any) -> str:
    if (
        not isinstance(marker, str)
        or not marker
        or "/" in marker
        or "\0" in marker
        or marker in (".", "..")
    ):
        raise SeedError(
            f"marker: got {marker!r}; give a file name in dest (no '/', not '.' or '..'), for "
            f"example {DEFAULT_MARKER!r}"
        )
    return marker


def validate_options(params: Mapping[str, Any]) -> SeedOptions:
    """:class:`SeedOptions` from the module's (or the child's) parameters; raises
    :class:`SeedError` naming the option, the value and the fix."""
    paths: dict[str, str] = {}
    for name in ("src", "dest"):
        value = params.get(name)
        if not isinstance(value, str) or not value:
            raise SeedError(f"{name}: got {value!r}; give an absolute path on the host")
        if not os.path.isabs(value):
            raise SeedError(
                f"{name}: got {value!r}, a relative path; give an absolute path on the host "
                f"(relative to what? the module's working directory is not yours)"
            )
        paths[name] = os.path.normpath(value)
    revision = _check_revision(params.get("revision"))
    marker = _check_marker(params.get("marker", DEFAULT_MARKER) or DEFAULT_MARKER)
    chunk_size = _int_option(params, "chunk_size", DEFAULT_CHUNK_SIZE)
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise SeedError(
            f"chunk_size: got {chunk_size}; give between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE} "
            f"bytes (default {DEFAULT_CHUNK_SIZE}): the process holds one chunk"
        )
    flush_bytes = _int_option(params, "flush_bytes", DEFAULT_FLUSH_BYTES)
    if flush_bytes != 0 and flush_bytes < chunk_size:
        raise SeedError(
            f"flush_bytes: got {flush_bytes}; give 0 (flush at the end of each file only) or at "
            f"least chunk_size ({chunk_size})"
        )
    return SeedOptions(
        src=paths["src"],
        dest=paths["dest"],
        revision=revision,
        marker=marker,
        chunk_size=chunk_size,
        flush_bytes=flush_bytes,
        overrides=_check_overrides(params.get("overrides"), marker),
    )


def _check_overrides(value: Any, marker: str) -> dict[str, str]:
    """``overrides``: relative ``/``-separated file paths of src to text."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SeedError(
            f"overrides: got {type(value).__name__}; give a mapping of a file's path in src "
            "(relative, such as 'bge-reranker-v2-m3/graph.pbtxt') to the text to write instead"
        )
    checked: dict[str, str] = {}
    for rel, text in value.items():
        parts = rel.split("/") if isinstance(rel, str) else []
        if (
            not parts
            or any(part in ("", ".", "..") for part in parts)
            or (len(parts) == 1 and parts[0] in (marker, marker + JOURNAL_SUFFIX))
        ):
            raise SeedError(
                f"overrides: the path {rel!r} is not a file's relative path in src; give it "
                "'/'-separated, without '.', '..', empty parts or the marker's names"
            )
        if not isinstance(text, str):
            raise SeedError(f"overrides: the value for {rel!r} is {type(text).__name__}; give text")
        checked[rel] = text
    return checked


def apply_overrides(
    records: Sequence[FileRecord], overrides: Mapping[str, str]
) -> list[FileRecord]:
    """``records`` with each overridden file's size and sha256 those of its text (UTF-8);
    an override of a file src does not hold is refused."""
    missing = sorted(set(overrides) - {r.path for r in records})
    if missing:
        raise SeedError(
            f"overrides: src holds no file {', '.join(missing)}; an override replaces a file "
            "of the exported repository, it does not add one"
        )
    result = []
    for record in records:
        if record.path in overrides:
            data = overrides[record.path].encode()
            record = FileRecord(record.path, len(data), hashlib.sha256(data).hexdigest())
        result.append(record)
    return result


def _inside(path: str, root: str) -> bool:
    return path != root and os.path.commonpath([path, root]) == root


def check_tree_relation(src: str, dest: str) -> None:
    """Refuse a ``dest`` that is ``src``, inside it or around it (resolved paths)."""
    if src == dest:
        raise SeedError(
            f"dest: {dest} is src; the serving directory must be a directory of its own, "
            "outside the exported repository"
        )
    if _inside(dest, src):
        raise SeedError(
            f"dest: {dest} is inside src {src}; the seed would copy into the tree it reads: "
            "choose a dest outside the exported repository"
        )
    if _inside(src, dest):
        raise SeedError(
            f"src: {src} is inside dest {dest}; a seed removes from dest what src does not "
            "hold, src included: keep the exported repository outside the serving directory"
        )


# --- reading the trees -------------------------------------------------------------------


def _fadvise_dontneed(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop a file's range from the page cache (clean pages; call after a sync)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _hash_file(path: str, buffer: bytearray) -> tuple[int, str]:
    """(size, sha256) of a regular file, read through ``buffer``; it is not followed if it
    is a link, and its pages are dropped from the cache as it is read (every
    ``DEFAULT_FLUSH_BYTES``), so that verifying a tree does not push the host's cache out."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        digest = hashlib.sha256()
        view = memoryview(buffer)
        size = dropped = 0
        while True:
            n = os.readv(fd, [buffer])
            if n == 0:
                break
            digest.update(view[:n])
            size += n
            if size - dropped >= DEFAULT_FLUSH_BYTES:
                _fadvise_dontneed(fd, dropped, size - dropped)
                dropped = size
        _fadvise_dontneed(fd)
        return size, digest.hexdigest()
    finally:
        os.close(fd)


def _kind_word(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file"


def _symlink_refusal(src: str, path: str) -> SeedError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    resolved = os.path.realpath(path)
    where = "inside src" if resolved == src or _inside(resolved, src) else "outside src"
    return SeedError(
        f"src: {path} is a symbolic link (to {target}, {where} {src}); the seed copies regular "
        "files only, so that nothing it serves can come from outside the exported repository: "
        "replace the link with the file it names (cp --dereference) or export again"
    )


def _walk(root: str) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """(relative path, entry) of every entry under ``root``, sorted, links not followed."""
    stack = [("", root)]
    while stack:
        prefix, directory = stack.pop()
        with os.scandir(directory) as scan:
            entries = sorted(scan, key=lambda e: e.name)
        subdirs = []
        for entry in entries:
            rel = prefix + entry.name
            yield rel, entry
            if entry.is_dir(follow_symlinks=False):
                subdirs.append((rel + "/", entry.path))
        stack.extend(reversed(subdirs))


def _server_config_problem(path: str) -> str | None:
    """Why ``path`` is not an OpenVINO Model Server config (None when it is one): a model's
    directory holds a ``config.json`` too, the model's own."""
    try:
        with open(path, "rb") as handle:
            doc = json.loads(handle.read(MAX_MARKER_BYTES).decode("utf-8"))
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    except (ValueError, UnicodeError):
        return "is not JSON"
    if not isinstance(doc, dict) or not (
        isinstance(doc.get("model_config_list"), list)
        or isinstance(doc.get("mediapipe_config_list"), list)
    ):
        return "is not the server's config (no model_config_list)"
    return None


def _config_hint(src: str) -> str:
    below = []
    with contextlib.suppress(OSError), os.scandir(src) as scan:
        for entry in sorted(scan, key=lambda e: e.name):
            candidate = os.path.join(entry.path, SERVER_CONFIG)
            if (
                entry.is_dir(follow_symlinks=False)
                and os.path.isfile(candidate)
                and _server_config_problem(candidate) is None
            ):
                below.append(f"{entry.name}/{SERVER_CONFIG}")
    if below:
        return (
            f"; it holds {', '.join(below)}: point src at one device's tree (for example "
            f"{os.path.join(src, below[0].split('/')[0])})"
        )
    return "; point src at one device's exported tree (export_model.py's model repository)"


def scan_source(src: str, marker: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[FileRecord]:
    """Every file of the exported tree ``src`` (a resolved directory) with size and sha256,
    sorted by path; refuses links, special files, the module's own names at the top and a
    tree without the server's ``config.json``."""
    if not os.path.isdir(src):
        raise SeedError(
            f"src: {src} is not a directory; give the exported repository for one device "
            "(the tree holding config.json and one directory per model)"
        )
    reserved = {marker, marker + JOURNAL_SUFFIX}
    buffer = bytearray(chunk_size)
    records: list[FileRecord] = []
    try:
        for rel, entry in _walk(src):
            if rel in reserved:
                raise SeedError(
                    f"marker: src holds {entry.path}, a name the seed keeps for itself in dest; "
                    "give marker another name"
                )
            if entry.is_symlink():
                raise _symlink_refusal(src, entry.path)
            if entry.is_dir(follow_symlinks=False):
                continue
            if not entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode
                raise SeedError(
                    f"src: {entry.path} is {_kind_word(mode)}; an exported repository holds "
                    "regular files only: remove it from src"
                )
            size, sha256 = _hash_file(entry.path, buffer)
            records.append(FileRecord(rel, size, sha256))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _symlink_refusal(src, str(exc.filename)) from None
        raise SeedError(
            f"src: cannot read {exc.filename or src}: {exc.strerror or exc}; the seed must read "
            "every file of the exported repository"
        ) from None
    records.sort(key=lambda r: r.path)
    if not any(r.path == SERVER_CONFIG for r in records):
        raise SeedError(f"src: {src} has no {SERVER_CONFIG} at its top{_config_hint(src)}")
    problem = _server_config_problem(os.path.join(src, SERVER_CONFIG))
    if problem is not None:
        raise SeedError(
            f"src: {os.path.join(src, SERVER_CONFIG)} {problem}; src must be one device's "
            "exported tree, whose config.json lists the models (a model's own directory holds "
            "a config.json too: point src at the directory above it)"
        )
    return records


def scan_dest(
    dest: str,
    wanted: Mapping[str, FileRecord],
    reserved: Iterable[str],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> dict[str, DestEntry]:
    """Every entry of ``dest`` but the ``reserved`` names at its top; the sha256 of a file
    only when ``wanted`` has a file of that path and size."""
    skip = set(reserved)
    buffer = bytearray(chunk_size)
    entries: dict[str, DestEntry] = {}
    try:
        for rel, entry in _walk(dest):
            if rel in skip:
                continue
            if entry.is_dir(follow_symlinks=False):
                entries[rel] = DestEntry(rel, "dir")
            elif entry.is_file(follow_symlinks=False):
                size = entry.stat(follow_symlinks=False).st_size
                record = wanted.get(rel)
                sha256 = None
                if record is not None and record.size == size:
                    size, sha256 = _hash_file(entry.path, buffer)
                entries[rel] = DestEntry(rel, "file", size, sha256)
            else:
                entries[rel] = DestEntry(rel, "other")
    except OSError as exc:
        raise SeedError(
            f"dest: cannot read {exc.filename or dest}: {exc.strerror or exc}; the seed must "
            "read every entry of the serving directory to verify it"
        ) from None
    return entries


def parse_marker(text: str) -> tuple[str, tuple[FileRecord, ...]]:
    """(revision, files) of a marker's text; raises ``ValueError`` saying what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError("it is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("it is not a JSON object")
    if doc.get("format") != MARKER_FORMAT:
        raise ValueError(f"its format is {doc.get('format')!r}, not {MARKER_FORMAT}")
    revision = doc.get("revision")
    if not isinstance(revision, str) or not revision:
        raise ValueError("it holds no revision")
    files = doc.get("files")
    if not isinstance(files, list):
        raise ValueError("it holds no file list")
    records = []
    for item in files:
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("path"), str)
            or not isinstance(item.get("size"), int)
            or isinstance(item.get("size"), bool)
            or not isinstance(item.get("sha256"), str)
        ):
            raise ValueError(f"a file entry is not {{path, size, sha256}}: {item!r}")
        records.append(FileRecord(item["path"], item["size"], item["sha256"]))
    return revision, tuple(sorted(records, key=lambda r: r.path))


def marker_document(revision: str, files: Sequence[FileRecord]) -> bytes:
    """The marker's bytes: the revision and the manifest of the tree it vouches for."""
    doc = {
        "format": MARKER_FORMAT,
        "generator": GENERATOR,
        "revision": revision,
        "files": [f.to_dict() for f in sorted(files, key=lambda r: r.path)],
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def read_marker(path: str) -> MarkerState:
    """The marker at ``path`` (not followed if it is a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return MarkerState(present=False)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return MarkerState(present=True, problem="it is a symbolic link")
        return MarkerState(present=True, problem=f"it cannot be read ({exc.strerror})")
    try:
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_MARKER_BYTES + 1)
    except OSError as exc:
        return MarkerState(present=True, problem=f"it cannot be read ({exc.strerror})")
    if len(data) > MAX_MARKER_BYTES:
        return MarkerState(present=True, problem=f"it is larger than {MAX_MARKER_BYTES} bytes")
    try:
        revision, files = parse_marker(data.decode("utf-8"))
    except (ValueError, UnicodeError) as exc:
        return MarkerState(present=True, problem=str(exc))
    return MarkerState(present=True, revision=revision, files=files)


def _read_journal(path: str) -> tuple[bool, str | None]:
    """(the journal exists, the revision it names or None)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(64 * 1024)
    except FileNotFoundError:
        return False, None
    except OSError:
        return True, None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeError):
        return True, None
    revision = doc.get("revision") if isinstance(doc, dict) else None
    return True, revision if isinstance(revision, str) else None


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
    """The modules the child runs, each after those it imports; the last holds :func:`main`."""
    return [sys.modules[__name__]]


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
