"""Name a DRM client by its container or its command.

Order: the container's name found from ``/proc/<pid>/cgroup`` (compose ``project/service``
or container name from the engine API; ``k8s/<namespace>/<pod>/<container>`` from the
kubelet's files), else the first matching command rule, else, for a container that could
not be resolved, a name made of its id (never merged with another container, never equal to
a resolved name), else the command name (``comm``).

Recognised cgroup paths (v2 ``0::<path>`` and v1 ``<n>:<controllers>:<path>`` lines); when
several match, the innermost (rightmost) wins, so a pod inside a kind node container is the
pod, not the node:

* Docker, systemd driver: ``.../docker-<64 hex>.scope``;
* Docker, cgroupfs driver: ``.../docker/<64 hex>``;
* Podman: ``.../libpod-<64 hex>.scope`` (systemd manager) and ``.../libpod-<64 hex>``
  (cgroupfs manager, below ``/libpod_parent``), maybe with a ``/container`` child;
* rootless engines: the same names below ``user@<uid>.service`` or ``user-<uid>.slice``
  (the uid is kept; uid 0 is root's engine, asked on the rootful socket);
* Kubernetes CRI (containerd, CRI-O): ``...-pod<uid>.slice/cri-containerd-<64 hex>.scope``
  and ``crio-<64 hex>.scope`` (systemd driver), ``kubepods/<qos>/pod<uid>/<64 hex>`` and
  ``kubepods/<qos>/pod<uid>/crio-<64 hex>`` (cgroupfs driver) and
  ``...-pod<uid>.slice:cri-containerd:<64 hex>`` (containerd's ``slice:prefix:id``
  cgroupsPath taken literally by a cgroupfs runtime).

Command rules are ``(regex, name, field)`` where field is ``comm``, ``cmdline`` or ``any``; a
rules file is a JSON list of ``{"pattern": ..., "name": ..., "match": "any"}`` objects.
The default rule names every ``Plex Transcoder`` process ``plex``.

Names by kind (the arbiter decides by them)::

    llm/vllm                     compose project/service (engine API)
    plex                         container name (engine API), or a command rule
    k8s/<ns>/<pod>/<container>   Kubernetes container (kubelet log files, containerd bundle)
    k8s/<ns>/<pod>:<id12>        pod known, container not (several containers in the pod)
    k8s/pod-<uid8>/<id12>        Kubernetes container, nothing resolvable
    docker:<id12>, podman:<id12> container not resolved (no socket, 404, timeout)
    python3                      comm of a process outside any container

Container and compose names never contain ``:`` and a comm is at most 15 characters, so
an unresolved container's name cannot equal a resolved one or a command's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from cardshare.docker_api import DockerClient, DockerError

__all__ = [
    "BROKER_COMMS",
    "BROKER_UNITS",
    "DEFAULT_RULES",
    "CommandRule",
    "ContainerRef",
    "EngineApiResolver",
    "KubeletFilesResolver",
    "NamingCandidate",
    "NamingError",
    "Resolver",
    "client_name",
    "container_from_cgroup",
    "default_sockets",
    "is_broker",
    "load_rules",
    "name_from_inspect",
    "naming_pid",
    "primary_cgroup",
    "read_rules_file",
    "unresolved_name",
]

Engine = Literal["docker", "podman", "cri"]
MatchField = Literal["comm", "cmdline", "any"]


class NamingError(Exception):
    """A rules file that cannot be used."""


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container found in a cgroup path."""

    engine: Engine
    id: str
    uid: int | None = None  # owner of a user-session engine (0: root's own session)
    pod_uid: str | None = None  # Kubernetes pod UID (dashed form), CRI containers only

    @property
    def short_id(self) -> str:
        return self.id[:12]


Resolver = Callable[[ContainerRef], str | None]

_HEX64 = r"([0-9a-f]{64})"
# A pod UID: dashed (API objects, cgroupfs driver), underscored (systemd slice names escape
# ``-``) or 32 plain hex digits (a static pod's UID is the hash of its manifest).
_POD_UID = r"([0-9a-f]{8}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{4}[-_]?[0-9a-f]{12})"
_END = r"(?=/|$)"
_CRI_PREFIX = r"(?:cri-containerd|crio)"
# (pattern, engine): group 1 is the container id; CRI patterns have the pod UID first.
_PATTERNS: tuple[tuple[re.Pattern[str], Engine], ...] = (
    (re.compile(rf"(?:^|/)docker-{_HEX64}\.scope{_END}"), "docker"),
    (re.compile(rf"(?:^|/)docker/{_HEX64}{_END}"), "docker"),
    (re.compile(rf"(?:^|/)libpod-{_HEX64}\.scope{_END}"), "podman"),
    # podman's cgroupfs manager: <parent, /libpod_parent by default>/libpod-<id>
    (re.compile(rf"(?:^|/)libpod-{_HEX64}{_END}"), "podman"),
    (re.compile(rf"-pod{_POD_UID}\.slice/{_CRI_PREFIX}-{_HEX64}\.scope{_END}"), "cri"),
    (re.compile(rf"-pod{_POD_UID}\.slice:{_CRI_PREFIX}:{_HEX64}{_END}"), "cri"),
    # the kubelet's cgroupfs driver: containerd names the container's cgroup by its id alone,
    # CRI-O as crio-<id> (no .scope)
    (
        re.compile(
            rf"(?:^|/)kubepods(?:/burstable|/besteffort)?/pod{_POD_UID}/(?:crio-)?{_HEX64}{_END}"
        ),
        "cri",
    ),
)
_USER_RE = re.compile(r"/user@([0-9]+)\.service(?:/|$)")
_USER_SLICE_RE = re.compile(r"/user-([0-9]+)\.slice(?:/|$)")


def _dashed_uid(text: str) -> str:
    """A pod UID in the form the kubelet's directories use."""
    return text.replace("_", "-")


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


def _container_in_path(path: str) -> ContainerRef | None:
    """The innermost (rightmost) container named in one cgroup path."""
    best: tuple[int, re.Match[str], Engine] | None = None
    for pattern, engine in _PATTERNS:
        for match in pattern.finditer(path):
            if best is None or match.end() > best[0]:
                best = (match.end(), match, engine)
    if best is None:
        return None
    _, match, engine = best
    if engine == "cri":
        return ContainerRef("cri", match.group(2), pod_uid=_dashed_uid(match.group(1)))
    outer = path[: match.start()]
    user = _USER_RE.search(outer) or _USER_SLICE_RE.search(outer)
    uid = int(user.group(1)) if user else None
    return ContainerRef(engine=engine, id=match.group(1), uid=uid)


def container_from_cgroup(text: str) -> ContainerRef | None:
    """Find the container of a process from the text of its ``/proc/<pid>/cgroup``."""
    for path in _cgroup_paths(text):
        ref = _container_in_path(path)
        if ref is not None:
            return ref
    return None


def primary_cgroup(text: str) -> str:
    """The cgroup path that places a process: the v2 path, else the v1 ``name=systemd`` one.

    On a hybrid host the v2 line is ``0::/`` and says nothing; the systemd hierarchy does.
    Empty when the text has no cgroup line.
    """
    v2 = ""
    systemd = ""
    first_v1 = ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        path = path.strip()
        if hid == "0" and controllers == "":
            v2 = v2 or path
        elif controllers == "name=systemd":
            systemd = systemd or path
        else:
            first_v1 = first_v1 or path
    if v2 and v2 != "/":
        return v2
    return systemd or v2 or first_v1


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


def unresolved_name(ref: ContainerRef) -> str:
    """The name of a container its engine or the kubelet's files could not name.

    ``docker:<id12>`` / ``podman:<id12>``; ``k8s/pod-<uid8>/<id12>`` for a CRI container.
    Unique per container, and unlike any resolved name (see the module docstring).
    """
    if ref.engine == "cri":
        return f"k8s/pod-{(ref.pod_uid or '')[:8]}/{ref.short_id}"
    return f"{ref.engine}:{ref.short_id}"


def client_name(
    container: ContainerRef | None,
    comm: str,
    cmdline: str,
    rules: Iterable[CommandRule],
    resolver: Resolver | None,
) -> str:
    """Choose the display name of a process (never empty).

    The resolved container name, else the first matching rule, else (in a container) the
    container's :func:`unresolved_name`, else the comm.  A process in a container is never
    named by its comm: two unresolved ``python3`` containers stay two clients.
    """
    if container is not None and resolver is not None:
        name = resolver(container)
        if name:
            return name
    for rule in rules:
        if rule.matches(comm, cmdline):
            return rule.name
    if container is not None:
        return unresolved_name(container)
    return comm or "unknown"


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
    container; a container in root's own user session (uid 0) is root's engine, asked on
    the rootful socket.  Kubernetes (CRI) containers are named from the kubelet's files
    under ``root`` (:class:`KubeletFilesResolver`).  Answers (including failures) are
    cached for the life of the resolver: make one per scan.  Any error (no socket,
    timeout, bad JSON, 404) gives ``None`` so naming falls back (:func:`client_name`).
    """

    def __init__(
        self,
        sockets: Mapping[str, str],
        timeout: float = 2.0,
        fetch: Callable[[str, str, float], object | None] = _inspect_over_socket,
        root: str = "/",
    ) -> None:
        self._sockets = dict(sockets)
        self._timeout = timeout
        self._fetch = fetch
        self._cache: dict[ContainerRef, str | None] = {}
        self._kubelet = KubeletFilesResolver(root)
        self.errors = 0

    def socket_for(self, ref: ContainerRef) -> str | None:
        """The API socket asked about ``ref`` (``None``: that engine is disabled)."""
        if ref.uid is None or ref.uid == 0:
            return self._sockets.get(ref.engine)
        template = self._sockets.get(f"{ref.engine}-rootless")
        return template.replace("{uid}", str(ref.uid)) if template else None

    def __call__(self, ref: ContainerRef) -> str | None:
        if ref in self._cache:
            return self._cache[ref]
        if ref.engine == "cri":
            self._cache[ref] = self._kubelet(ref)
            return self._cache[ref]
        name: str | None = None
        path = self.socket_for(ref)
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


def _under(root: str, path: str) -> str:
    """``path`` (absolute) seen from the recorder when the host's ``/`` is at ``root``."""
    return os.path.join(root, path.lstrip("/"))


def default_sockets(docker: str | None, podman: str | None, root: str = "/") -> dict[str, str]:
    """The engine socket map for :class:`EngineApiResolver`; ``None``/empty disables one.

    ``docker`` and ``podman`` are used as given (the CLI's ``--docker-socket`` and
    ``--podman-socket`` are paths as the recorder sees them).  Rootless engines use the
    per-user sockets ``/run/user/{uid}/docker.sock`` and
    ``/run/user/{uid}/podman/podman.sock`` under the host root prefix ``root``.  Root's
    own engine is the rootful socket, never ``/run/user/0/...``.
    """
    sockets: dict[str, str] = {}
    if docker:
        sockets["docker"] = docker
        sockets["docker-rootless"] = _under(root, "/run/user/{uid}/docker.sock")
    if podman:
        sockets["podman"] = podman
        sockets["podman-rootless"] = _under(root, "/run/user/{uid}/podman/podman.sock")
    return sockets


def read_rules_file(path: str | Path) -> tuple[CommandRule, ...]:
    """Load command rules from a JSON file (``NamingError`` names the file on failure)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise NamingError(f"cannot read rules file {path}: {exc.strerror}") from None
    return load_rules(text, str(path))


# --- Kubernetes: names from the kubelet's and the runtime's files -----------------------

# DNS-1123 names: namespaces and container names are labels, pod names subdomains.  None
# contains ``_`` (the separator of the kubelet's file names), ``/`` or ``:``.
_K8S_NAME = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
_K8S_NAME_RE = re.compile(rf"^{_K8S_NAME}$")
# /var/log/containers/<pod>_<namespace>_<container>-<container id>.log (symlinks)
_LOG_LINK_RE = re.compile(rf"^({_K8S_NAME})_({_K8S_NAME})_({_K8S_NAME})-([0-9a-f]{{64}})\.log$")
# /var/log/pods/<namespace>_<pod>_<pod uid>/<container>/<restart>.log
_POD_DIR_RE = re.compile(rf"^({_K8S_NAME})_({_K8S_NAME})_([0-9a-f-]{{32,36}})$")
# containerd's task bundles (the OCI config.json of each container), k3s's as well
_CONTAINERD_BUNDLES = (
    "/run/containerd/io.containerd.runtime.v2.task/k8s.io",
    "/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io",
)
_BUNDLE_MAX_BYTES = 4 * 1024 * 1024
_CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
_CRI_POD = "io.kubernetes.cri.sandbox-name"
_CRI_CONTAINER = "io.kubernetes.cri.container-name"


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


class KubeletFilesResolver:
    """Name CRI containers ``k8s/<namespace>/<pod>/<container>`` without a Kubernetes API.

    In order, under the host root prefix ``root``:

    1. ``/var/log/containers/<pod>_<namespace>_<container>-<id>.log``, the symlink the
       kubelet makes for every container (any runtime): exact, by container id;
    2. containerd's bundle ``/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/
       config.json`` (or k3s's under ``/run/k3s``), annotations
       ``io.kubernetes.cri.sandbox-namespace``, ``-sandbox-name``, ``-container-name``;
    3. ``/var/log/pods/<namespace>_<pod>_<pod uid>/``: the pod by its UID; the container
       when the pod has exactly one container directory, else ``k8s/<ns>/<pod>:<id12>``.

    ``None`` when nothing matches (:func:`unresolved_name` then gives
    ``k8s/pod-<uid8>/<id12>``).  Directory listings are read once: make one per scan.
    """

    def __init__(self, root: str = "/") -> None:
        self._root = root
        self._links: dict[str, str] | None = None
        self._pods: dict[str, tuple[str, str, str]] | None = None

    def _path(self, path: str) -> str:
        return _under(self._root, path)

    def _from_log_links(self, cid: str) -> str | None:
        if self._links is None:
            self._links = {}
            for entry in _listdir(self._path("/var/log/containers")):
                match = _LOG_LINK_RE.match(entry)
                if match is not None:
                    pod, namespace, container, found = match.groups()
                    self._links[found] = f"k8s/{namespace}/{pod}/{container}"
        return self._links.get(cid)

    def _from_bundle(self, cid: str) -> str | None:
        for bundles in _CONTAINERD_BUNDLES:
            path = os.path.join(self._path(bundles), cid, "config.json")
            try:
                with open(path, "rb") as handle:
                    doc = json.loads(handle.read(_BUNDLE_MAX_BYTES))
            except (OSError, ValueError):
                continue
            notes = doc.get("annotations") if isinstance(doc, dict) else None
            if not isinstance(notes, dict):
                continue
            parts = [notes.get(k) for k in (_CRI_NAMESPACE, _CRI_POD, _CRI_CONTAINER)]
            if all(isinstance(p, str) and _K8S_NAME_RE.match(p) for p in parts):
                return "k8s/" + "/".join(str(p) for p in parts)
        return None

    def _from_pod_dir(self, ref: ContainerRef) -> str | None:
        if self._pods is None:
            self._pods = {}
            logs = self._path("/var/log/pods")
            for entry in _listdir(logs):
                match = _POD_DIR_RE.match(entry)
                if match is not None:
                    namespace, pod, uid = match.groups()
                    self._pods[uid] = (namespace, pod, os.path.join(logs, entry))
        found = self._pods.get(ref.pod_uid or "")
        if found is None:
            return None
        namespace, pod, directory = found
        containers = [
            c
            for c in _listdir(directory)
            if _K8S_NAME_RE.match(c) and os.path.isdir(os.path.join(directory, c))
        ]
        if len(containers) == 1:
            return f"k8s/{namespace}/{pod}/{containers[0]}"
        return f"k8s/{namespace}/{pod}:{ref.short_id}"

    def __call__(self, ref: ContainerRef) -> str | None:
        if ref.engine != "cri":
            return None
        return self._from_log_links(ref.id) or self._from_bundle(ref.id) or self._from_pod_dir(ref)


# --- Which process names a shared client --------------------------------------------------

# Processes that hold other processes' DRM descriptors: the seat managers (systemd-logind
# opens session devices for TakeDevice() and keeps a copy; elogind, seatd likewise), the
# service managers (pid 1 and ``systemd --user`` keep fds in their fd stores) and display
# managers.  A comm is at most 15 characters: ``gdm-session-worker`` reads ``gdm-session-wor``.
BROKER_COMMS: frozenset[str] = frozenset(
    {
        "systemd",
        "systemd-logind",
        "elogind-daemon",
        "seatd",
        "gdm",
        "gdm3",
        "gdm-session-wor",
        "sddm",
        "sddm-helper",
        "lightdm",
        "greetd",
    }
)
# Units that hold nothing but brokers (the last component of the cgroup path).  Display
# managers' units are not listed: an X server started by lightdm runs in lightdm.service
# and is a real client; display managers are known by their comm.
BROKER_UNITS: frozenset[str] = frozenset(
    {
        "init.scope",
        "systemd-logind.service",
        "elogind.service",
        "seatd.service",
    }
)


class NamingCandidate(Protocol):
    """What :func:`naming_pid` needs of a process."""

    @property
    def comm(self) -> str: ...

    @property
    def cgroup(self) -> str:
        """:func:`primary_cgroup` of the process's cgroup file."""
        ...


def is_broker(comm: str, cgroup: str) -> bool:
    """True for a process known to hold DRM descriptors on behalf of others."""
    return comm in BROKER_COMMS or cgroup.rstrip("/").rsplit("/", 1)[-1] in BROKER_UNITS


def naming_pid(pids: Iterable[int], processes: Mapping[int, NamingCandidate]) -> int:
    """The pid whose process names a DRM client held by ``pids`` (not empty).

    Preference, lowest pid first within each: a process that is not a broker
    (:func:`is_broker`) and not in a broker's cgroup; else any non-broker; else the lowest
    pid.  Pids missing from ``processes`` (vanished, unreadable) are never chosen unless no
    pid is known.  Raises ``ValueError`` when ``pids`` is empty.
    """
    ordered = sorted(pids)
    if not ordered:
        raise ValueError("a DRM client without a pid")
    known = [(pid, processes[pid]) for pid in ordered if pid in processes]
    brokers = {pid for pid, proc in known if is_broker(proc.comm, proc.cgroup)}
    broker_groups = {proc.cgroup for pid, proc in known if pid in brokers and proc.cgroup}
    others = [(pid, proc) for pid, proc in known if pid not in brokers]
    for pid, proc in others:
        if proc.cgroup not in broker_groups:
            return pid
    if others:
        return others[0][0]
    return known[0][0] if known else ordered[0]
