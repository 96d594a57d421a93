"""Name a DRM client by its container or its command.

Order: the container's compose ``project/service`` (or container name) found from
``/proc/<pid>/cgroup``, else the first matching command rule, else the command name (``comm``).

Recognised cgroup paths (v2 ``0::<path>`` and v1 ``<n>:<controllers>:<path>`` lines):

* Docker, systemd driver: ``.../docker-<64 hex>.scope``;
* Docker, cgroupfs driver: ``.../docker/<64 hex>``;
* Podman: ``.../libpod-<64 hex>.scope`` (maybe with a ``/container`` child);
* rootless engines: the same names below ``user@<uid>.service`` (the uid is kept).

Command rules are ``(regex, name, field)`` where field is ``comm``, ``cmdline`` or ``any``; a
rules file is a JSON list of ``{"pattern": ..., "name": ..., "match": "any"}`` objects.
The default rule names every ``Plex Transcoder`` process ``plex``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cardshare.docker_api import DockerClient, DockerError

__all__ = [
    "DEFAULT_RULES",
    "CommandRule",
    "ContainerRef",
    "EngineApiResolver",
    "NamingError",
    "Resolver",
    "client_name",
    "container_from_cgroup",
    "default_sockets",
    "load_rules",
    "name_from_inspect",
    "read_rules_file",
]

Engine = Literal["docker", "podman"]
MatchField = Literal["comm", "cmdline", "any"]


class NamingError(Exception):
    """A rules file that cannot be used."""


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container found in a cgroup path."""

    engine: Engine
    id: str
    uid: int | None = None  # owner of a rootless engine

    @property
    def short_id(self) -> str:
        return self.id[:12]


Resolver = Callable[[ContainerRef], str | None]

_HEX64 = r"([0-9a-f]{64})"
_PATTERNS: tuple[tuple[re.Pattern[str], Engine], ...] = (
    (re.compile(rf"(?:^|/)docker-{_HEX64}\.scope(?:/|$)"), "docker"),
    (re.compile(rf"(?:^|/)docker/{_HEX64}(?:/|$)"), "docker"),
    (re.compile(rf"(?:^|/)libpod-{_HEX64}\.scope(?:/|$)"), "podman"),
)
_USER_RE = re.compile(r"/user@([0-9]+)\.service(?:/|$)")


def _cgroup_paths(text: str) -> list[str]:
    """The paths of a cgroup file, the v2 (``0::``) line first."""
    v2: list[str] = []
    v1: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        (v2 if hid == "0" and controllers == "" else v1).append(path.strip())
    return v2 + v1


def container_from_cgroup(text: str) -> ContainerRef | None:
    """Find the container of a process from the text of its ``/proc/<pid>/cgroup``."""
    for path in _cgroup_paths(text):
        for pattern, engine in _PATTERNS:
            match = pattern.search(path)
            if match is None:
                continue
            user = _USER_RE.search(path)
            uid = int(user.group(1)) if user else None
            return ContainerRef(engine=engine, id=match.group(1), uid=uid)
    return None


@dataclass(frozen=True, slots=True)
class CommandRule:
    """Name every process whose comm and/or cmdline matches ``pattern``."""

    pattern: re.Pattern[str]
    name: str
    match: MatchField = "any"

    def matches(self, comm: str, cmdline: str) -> bool:
        if self.match in ("comm", "any") and self.pattern.search(comm):
            return True
        return self.match in ("cmdline", "any") and bool(self.pattern.search(cmdline))


DEFAULT_RULES: tuple[CommandRule, ...] = (
    CommandRule(re.compile(r"Plex Transcoder"), "plex", "any"),
)


def load_rules(text: str, source: str = "rules") -> tuple[CommandRule, ...]:
    """Parse a JSON rules file; raise ``NamingError`` with the reason and the source."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NamingError(f"{source}: not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, list):
        raise NamingError(f"{source}: expected a list of rules, got {type(data).__name__}")
    rules: list[CommandRule] = []
    for index, item in enumerate(data):
        where = f"{source}: rule {index}"
        if not isinstance(item, dict):
            raise NamingError(f"{where}: expected an object, got {type(item).__name__}")
        pattern, name = item.get("pattern"), item.get("name")
        match = item.get("match", "any")
        if not isinstance(pattern, str) or not pattern:
            raise NamingError(f"{where}: 'pattern' must be a non-empty string")
        if not isinstance(name, str) or not name:
            raise NamingError(f"{where}: 'name' must be a non-empty string")
        if match not in ("comm", "cmdline", "any"):
            raise NamingError(f"{where}: 'match' must be comm, cmdline or any, got {match!r}")
        unknown = sorted(set(item) - {"pattern", "name", "match"})
        if unknown:
            raise NamingError(f"{where}: unknown keys {', '.join(unknown)}")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise NamingError(f"{where}: bad pattern {pattern!r}: {exc}") from None
        rules.append(CommandRule(compiled, name, match))
    return tuple(rules)


def client_name(
    container: ContainerRef | None,
    comm: str,
    cmdline: str,
    rules: Iterable[CommandRule],
    resolver: Resolver | None,
) -> str:
    """Choose the display name of a process (container, rule, comm; never empty)."""
    if container is not None and resolver is not None:
        name = resolver(container)
        if name:
            return name
    for rule in rules:
        if rule.matches(comm, cmdline):
            return rule.name
    if comm:
        return comm
    if container is not None:
        return f"{container.engine}-{container.short_id}"
    return "unknown"


def name_from_inspect(doc: Mapping[str, object]) -> str | None:
    """Name a container from its engine inspect document.

    ``project/service`` from the compose labels, else the container name without its ``/``.
    """
    config = doc.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if isinstance(labels, dict):
        project = labels.get("com.docker.compose.project")
        service = labels.get("com.docker.compose.service")
        if isinstance(project, str) and isinstance(service, str) and project and service:
            return f"{project}/{service}"
    name = doc.get("Name")
    if isinstance(name, str) and name.strip("/"):
        return name.lstrip("/")
    return None


def _inspect_over_socket(socket_path: str, container_id: str, timeout: float) -> object | None:
    return DockerClient(socket_path, timeout).inspect_document(container_id)


class EngineApiResolver:
    """Resolve container ids with the Docker Engine API (Podman's compatible API too).

    ``sockets`` maps an engine (``docker``, ``podman``) to its unix socket, and
    ``<engine>-rootless`` to a template where ``{uid}`` becomes the owner of a rootless
    container.  Answers (including
    failures) are cached for the life of the resolver: make one per scan.  Any error (no
    socket, timeout, bad JSON, 404) gives ``None`` so naming falls back to the command.
    """

    def __init__(
        self,
        sockets: Mapping[str, str],
        timeout: float = 2.0,
        fetch: Callable[[str, str, float], object | None] = _inspect_over_socket,
    ) -> None:
        self._sockets = dict(sockets)
        self._timeout = timeout
        self._fetch = fetch
        self._cache: dict[ContainerRef, str | None] = {}
        self.errors = 0

    def _socket_for(self, ref: ContainerRef) -> str | None:
        if ref.uid is None:
            return self._sockets.get(ref.engine)
        template = self._sockets.get(f"{ref.engine}-rootless")
        return template.replace("{uid}", str(ref.uid)) if template else None

    def __call__(self, ref: ContainerRef) -> str | None:
        if ref in self._cache:
            return self._cache[ref]
        name: str | None = None
        path = self._socket_for(ref)
        if path is not None:
            try:
                doc = self._fetch(path, ref.id, self._timeout)
            except (OSError, ValueError, DockerError):
                doc = None
                self.errors += 1
            if isinstance(doc, dict):
                name = name_from_inspect(doc)
        self._cache[ref] = name
        return name


def default_sockets(docker: str | None, podman: str | None) -> dict[str, str]:
    """The engine socket map for :class:`EngineApiResolver`; ``None``/empty disables one.

    Rootless engines use the per-user sockets ``/run/user/{uid}/docker.sock`` and
    ``/run/user/{uid}/podman/podman.sock``.
    """
    sockets: dict[str, str] = {}
    if docker:
        sockets["docker"] = docker
        sockets["docker-rootless"] = "/run/user/{uid}/docker.sock"
    if podman:
        sockets["podman"] = podman
        sockets["podman-rootless"] = "/run/user/{uid}/podman/podman.sock"
    return sockets


def read_rules_file(path: str | Path) -> tuple[CommandRule, ...]:
    """Load command rules from a JSON file (``NamingError`` names the file on failure)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise NamingError(f"cannot read rules file {path}: {exc.strerror}") from None
    return load_rules(text, str(path))


def rules_or_default(rules: Sequence[CommandRule] | None) -> tuple[CommandRule, ...]:
    """The given rules, or the defaults when none are given."""
    return DEFAULT_RULES if rules is None else tuple(rules)
