# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The options of a seed, checked (every refusal names the option, the value and the fix),
and the records the seed's modules share: a file, an entry of ``dest``, the marker, the plan.
Part of the module ``retrieval_seed``'s logic; the overview is in ``_seed_copy``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_FLUSH_BYTES",
    "DEFAULT_MARKER",
    "JOURNAL_SUFFIX",
    "SERVER_CONFIG",
    "DestEntry",
    "FileRecord",
    "MarkerState",
    "SeedError",
    "SeedOptions",
    "SeedPlan",
    "apply_overrides",
    "check_tree_relation",
    "validate_options",
]

DEFAULT_MARKER = ".cardshare-seed"
JOURNAL_SUFFIX = ".partial"
"""The journal is ``<marker><JOURNAL_SUFFIX>``: written first, removed after the marker."""


SERVER_CONFIG = "config.json"
"""The server's config, at the top of every exported tree; copied after every other file."""


GENERATOR = "cardshare.gpuhost.retrieval_seed"


MIB = 1024 * 1024
DEFAULT_CHUNK_SIZE = 4 * MIB
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 256 * MIB
DEFAULT_FLUSH_BYTES = 64 * MIB


MAX_REVISION_LENGTH = 200


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
