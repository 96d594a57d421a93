# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Reading the trees of a seed: ``src`` (regular files only, the server's ``config.json`` at
its top, each file's size and sha256), ``dest`` (every entry, the sha256 of each file that
may be current), the marker and the journal.  Part of the module ``retrieval_seed``'s logic;
the overview is in ``_seed_copy``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_FLUSH_BYTES,
    GENERATOR,
    JOURNAL_SUFFIX,
    MIB,
    SERVER_CONFIG,
    DestEntry,
    FileRecord,
    MarkerState,
    SeedError,
    _inside,
)

__all__ = [
    "marker_document",
    "parse_marker",
    "read_marker",
    "scan_dest",
    "scan_source",
]

MARKER_FORMAT = 1


MAX_MARKER_BYTES = 64 * MIB


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
