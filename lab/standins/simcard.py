"""SIMULATION: register a lab stand-in as a DRM client of the simulated Arc card.

Lab only.  No GPU exists in the lab; the card is a tree of plain files under a root
prefix (``CARDSHARE_SIM_ROOT``, default ``/srv/cardshare-sim``; see ``lab/SIMULATION.md``).
A stand-in (vLLM, ComfyUI, Plex) that "uses" the card creates, for as long as it runs::

    <root>/proc/<pid>/comm                 command name (e.g. ``Plex Transcoder``)
    <root>/proc/<pid>/cmdline              NUL-separated argv
    <root>/proc/<pid>/cgroup               ``0::/system.slice/docker-<64 hex>.scope``
    <root>/proc/<pid>/fdinfo/<n>           DRM fdinfo text as the xe driver prints it
    <root>/proc/<pid>/fd/<n>               symlink to the card's render node (``renderD128``)
    <root>/proc/<pid>/cardshare-sim-owner  JSON: who made the entry (for the reaper)

``<pid>`` is simulated (from 100000 upwards, reserved with an atomic ``mkdir``).  The
fdinfo file is rewritten atomically (temporary file + rename) by a background thread:
``drm-total-cycles-<c>`` follow a simulated GPU timestamp, ``drm-cycles-<c>`` advance only
for the engines the stand-in marks busy.  The entry is removed (renamed away, then
deleted) on :meth:`SimClient.close`; entries left by a killed stand-in are removed by
``simcard_reaper.py``.

When the root has no card (no ``tile0/physical_vram_size_bytes`` under
``sys/bus/pci/devices``), nothing is registered and every method is a no-op.  On a lab host
with several cards (``SIM_CARDS``), ``CARDSHARE_SIM_CARD`` names the card a stand-in uses, by
PCI address (``0000:07:00.0``), render node (``renderD130``) or its path (``/dev/dri/renderD130``,
``/dev/dri/by-path/pci-0000:07:00.0-render``); unset, the first card with VRAM, as before.

Standard library only: the stand-in images carry nothing but Python 3.11.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_ROOT",
    "ENGINE_CAPACITY",
    "ENGINE_CLASSES",
    "OWNER_FILE",
    "PROCESS_INSTANCE",
    "Card",
    "CardChoiceError",
    "FdinfoState",
    "SimClient",
    "card_choice",
    "card_choices",
    "cgroup_line",
    "container_id_from_mountinfo",
    "find_card",
    "format_size",
    "own_container_id",
    "parse_vram_size",
    "read_resident_vram",
    "remove_dead_siblings",
    "render_fdinfo",
    "sim_root",
]

DEFAULT_ROOT = "/srv/cardshare-sim"
ENGINE_CLASSES = ("rcs", "bcs", "vcs", "vecs", "ccs")
# xe prints drm-engine-capacity-<c> only when above 1 (facts.md: vcs 2, ccs 4 on the B70).
ENGINE_CAPACITY: Mapping[str, int] = {"vcs": 2, "ccs": 4}
REGIONS = ("system", "gtt", "vram0")
OWNER_FILE = "cardshare-sim-owner"
FIRST_PID = 100000
DRM_FD = 12
CARD_ENV = "CARDSHARE_SIM_CARD"
# Simulated GPU timestamp frequency for drm-total-cycles (xe reports the GT timestamp).
TIMESTAMP_HZ = 100_000_000
TICK_SECONDS = 0.25

_PDEV_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_RENDER_RE = re.compile(r"renderD\d+")
_CONTAINER_RE = re.compile(r"/containers/([0-9a-f]{64})/")
_CONTAINER_MOUNTS = ("/etc/hostname", "/etc/resolv.conf", "/etc/hosts")
_FDINFO_VRAM_RE = re.compile(
    r"^drm-(resident|memory)-(vram\d+):\s*([0-9]+)(?:\s+(KiB|MiB|GiB))?\s*$"
)
_UNITS = {None: 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
# This process's identity in owner files: a restarted container runs its command again
# under the same pid (1), so the pid alone cannot tell the new process from the killed one.
PROCESS_INSTANCE = uuid.uuid4().hex


def sim_root(env: Mapping[str, str] | None = None) -> Path:
    """The simulated card's root prefix (``CARDSHARE_SIM_ROOT``)."""
    source = os.environ if env is None else env
    return Path(source.get("CARDSHARE_SIM_ROOT", DEFAULT_ROOT))


def format_size(value: int) -> str:
    """A byte count as the kernel prints it in fdinfo (``drm_file.c`` ``print_size``).

    Divide by 1024 while the value is non-zero and 1 KiB-aligned, at most up to MiB:
    ``0``, ``4097``, ``192 KiB``, ``16 MiB``, ``20480 MiB``.
    """
    if value < 0:
        raise ValueError(f"negative size: {value}")
    units = ("", " KiB", " MiB")
    index = 0
    while index < len(units) - 1 and value != 0 and value % 1024 == 0:
        value //= 1024
        index += 1
    return f"{value}{units[index]}"


def parse_vram_size(text: str) -> int:
    """``physical_vram_size_bytes`` as sysfs prints it: hex (``0x800000000``) or decimal."""
    cleaned = text.strip()
    if not cleaned:
        raise ValueError("empty VRAM size")
    return int(cleaned, 16) if cleaned.lower().startswith("0x") else int(cleaned)


@dataclass(frozen=True, slots=True)
class FdinfoState:
    """What one simulated DRM file reports."""

    client_id: int
    pdev: str
    resident: Mapping[str, int]
    cycles: Mapping[str, int]
    total_cycles: int
    ino: int = 1000
    mnt_id: int = 25


def render_fdinfo(state: FdinfoState) -> str:
    """The fdinfo text of one xe DRM file (``xe_drm_client.c`` order and format)."""
    lines = [
        "pos:\t0",
        "flags:\t02100002",
        f"mnt_id:\t{state.mnt_id}",
        f"ino:\t{state.ino}",
        "drm-driver:\txe",
        f"drm-client-id:\t{state.client_id}",
        f"drm-pdev:\t{state.pdev}",
    ]
    for region in REGIONS:
        size = state.resident.get(region, 0)
        lines.append(f"drm-total-{region}:\t{format_size(size)}")
        lines.append(f"drm-shared-{region}:\t{format_size(0)}")
        lines.append(f"drm-active-{region}:\t{format_size(0)}")
        lines.append(f"drm-resident-{region}:\t{format_size(size)}")
        if region == "system":
            lines.append(f"drm-purgeable-{region}:\t{format_size(0)}")
    for engine in ENGINE_CLASSES:
        lines.append(f"drm-cycles-{engine}:\t{state.cycles.get(engine, 0)}")
        lines.append(f"drm-total-cycles-{engine}:\t{state.total_cycles}")
        capacity = ENGINE_CAPACITY.get(engine, 1)
        if capacity > 1:
            lines.append(f"drm-engine-capacity-{engine}:\t{capacity}")
    return "\n".join(lines) + "\n"


def container_id_from_mountinfo(text: str) -> str | None:
    """The Docker container id of the calling process, from ``/proc/self/mountinfo``.

    Docker bind-mounts ``/var/lib/docker/containers/<id>/hostname`` (and ``resolv.conf``,
    ``hosts``) into every container; field 4 of mountinfo is the source path inside its
    file system, field 5 the mount point.
    """
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[4] not in _CONTAINER_MOUNTS:
            continue
        match = _CONTAINER_RE.search(fields[3] + "/")
        if match is not None:
            return match.group(1)
    return None


def own_container_id(env: Mapping[str, str] | None = None) -> str | None:
    """This process's container id: mountinfo first, else ``CONTAINER_ID``."""
    source = os.environ if env is None else env
    with contextlib.suppress(OSError):
        found = container_id_from_mountinfo(Path("/proc/self/mountinfo").read_text())
        if found is not None:
            return found
    fallback = source.get("CONTAINER_ID", "").strip().lower()
    return fallback if re.fullmatch(r"[0-9a-f]{64}", fallback) else None


def cgroup_line(container_id: str | None) -> str:
    """The cgroup v2 line of a process in a Docker container (systemd cgroup driver)."""
    if container_id is None:
        return "0::/user.slice/cardshare-sim.scope\n"
    return f"0::/system.slice/docker-{container_id}.scope\n"


class CardChoiceError(ValueError):
    """``CARDSHARE_SIM_CARD`` names no card of the simulated host."""


@dataclass(frozen=True, slots=True)
class Card:
    """The simulated card found under a root."""

    root: Path
    pdev: str
    vram_total: int
    render: str = "renderD128"

    @property
    def render_node(self) -> Path:
        return self.root / "dev" / "dri" / self.render


def card_choice(env: Mapping[str, str] | None = None) -> str | None:
    """The card ``CARDSHARE_SIM_CARD`` names: a PCI address or a render node's name; None
    when unset."""
    source = os.environ if env is None else env
    value = source.get(CARD_ENV, "").strip()
    if not value:
        return None
    pdev = _PDEV_RE.search(value.lower())
    if pdev is not None:
        return pdev.group(0)
    render = _RENDER_RE.fullmatch(os.path.basename(value))
    if render is not None:
        return render.group(0)
    raise CardChoiceError(
        f"{CARD_ENV} is {value!r}: give the card's PCI address (0000:07:00.0) or its render "
        "node (renderD130, /dev/dri/renderD130)"
    )


def card_choices(env: Mapping[str, str] | None = None) -> list[str]:
    """Every card ``CARDSHARE_SIM_CARD`` names, in its order (PCI addresses or render nodes
    separated by spaces or commas): the cards of a tensor-parallel stand-in, one per rank;
    [] when unset."""
    source = os.environ if env is None else env
    words = source.get(CARD_ENV, "").replace(",", " ").split()
    return [str(card_choice({CARD_ENV: word})) for word in words]


def _render_of(entry: Path) -> str:
    """The card's render node name from sysfs (``drm/renderD<N>``); renderD128 without one."""
    with contextlib.suppress(OSError):
        for node in sorted((entry / "drm").iterdir()):
            if _RENDER_RE.fullmatch(node.name):
                return node.name
    return "renderD128"


def find_card(root: Path, choice: str | None = None) -> Card | None:
    """The card ``choice`` names (a PCI address or a render node's name), else the first PCI
    device under ``<root>/sys/bus/pci/devices`` that has VRAM; ``None`` without any.

    Raises :class:`CardChoiceError` when the host has cards but none is ``choice``: a
    stand-in must not register on another card than the one it was given.
    """
    devices = root / "sys" / "bus" / "pci" / "devices"
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return None
    cards: list[Card] = []
    for entry in entries:
        try:
            size = parse_vram_size((entry / "tile0" / "physical_vram_size_bytes").read_text())
        except (OSError, ValueError):
            continue
        card = Card(root=root, pdev=entry.name, vram_total=size, render=_render_of(entry))
        if choice is None or choice in (card.pdev, card.render):
            return card
        cards.append(card)
    if choice is not None and cards:
        found = ", ".join(f"{c.pdev} ({c.render})" for c in cards)
        raise CardChoiceError(
            f"{CARD_ENV} is {choice!r}, but the simulated host's cards with VRAM are {found}: "
            "name one of them"
        )
    return None


def _vram_of_fdinfo(text: str) -> tuple[str | None, str | None, int]:
    pdev: str | None = None
    client: str | None = None
    resident: dict[str, int] = {}
    legacy: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("drm-pdev:"):
            pdev = line.partition(":")[2].strip()
        elif line.startswith("drm-client-id:"):
            client = line.partition(":")[2].strip()
        else:
            match = _FDINFO_VRAM_RE.match(line)
            if match is not None:
                target = resident if match.group(1) == "resident" else legacy
                target[match.group(2)] = int(match.group(3)) * _UNITS[match.group(4)]
    total = sum(resident.values()) + sum(v for k, v in legacy.items() if k not in resident)
    return pdev, client, total


def read_resident_vram(root: Path, pdev: str, exclude_pid: int | None = None) -> int:
    """Resident VRAM of all simulated clients of ``pdev``, each DRM client counted once."""
    seen: dict[str, int] = {}
    proc = root / "proc"
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return 0
    for pid_dir in pids:
        if exclude_pid is not None and pid_dir.name == str(exclude_pid):
            continue
        try:
            files = list((pid_dir / "fdinfo").iterdir())
        except OSError:
            continue
        for fdinfo in files:
            try:
                text = fdinfo.read_text()
            except OSError:
                continue
            found_pdev, client, vram = _vram_of_fdinfo(text)
            if found_pdev != pdev or client is None:
                continue
            seen[client] = max(seen.get(client, 0), vram)
    return sum(seen.values())


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _allocate_dir(parent: Path, start: int) -> int:
    """The first number >= start whose directory under parent we could create."""
    parent.mkdir(parents=True, exist_ok=True)
    number = start
    while True:
        try:
            (parent / str(number)).mkdir()
        except FileExistsError:
            number += 1
            continue
        return number


def _next_client_id(root: Path) -> int:
    """A DRM client id never handed out before on this simulated card (monotonic)."""
    ids = root / "run" / "cardshare-sim" / "drm-client-ids"
    ids.mkdir(parents=True, exist_ok=True)
    used = [int(p.name) for p in ids.iterdir() if p.name.isdigit()]
    return _allocate_dir(ids, max(used, default=0) + 1)


def remove_dead_siblings(root: Path, container_id: str | None, instance: str) -> list[str]:
    """Remove entries of ``container_id`` made by another process instance; their names.

    A container runs one stand-in process. When a new one registers, every earlier process
    of that container is dead (the container was restarted, which kills them all), and the
    kernel would have closed their DRM files with them: their entries go before the new
    process looks at the card's free memory, so it never counts a dead process's VRAM.
    """
    removed: list[str] = []
    if container_id is None:
        return removed
    try:
        entries = [p for p in (root / "proc").iterdir() if p.name.isdigit()]
    except OSError:
        return removed
    for entry in entries:
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or owner.get("container_id") != container_id:
            continue
        if owner.get("instance") != instance:
            remove_entry(entry)
            removed.append(entry.name)
    return removed


def remove_entry(pid_dir: Path) -> None:
    """Remove a ``<root>/proc/<pid>`` entry atomically (rename away, then delete)."""
    gone = pid_dir.parent / f".gone-{pid_dir.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(pid_dir, gone)
    except FileNotFoundError:
        return
    shutil.rmtree(gone, ignore_errors=True)


class SimClient:
    """One simulated DRM client of the card, kept up to date by a background thread.

    ``vram`` is resident VRAM in bytes; ``busy`` maps engine classes to a load (number of
    engines of the class kept busy, e.g. ``{"ccs": 1.0}``).  Thread-safe.
    """

    def __init__(
        self,
        comm: str,
        cmdline: Iterable[str],
        root: Path | None = None,
        container_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_seconds: float = TICK_SECONDS,
        choice: str | None = None,
    ) -> None:
        self.root = sim_root() if root is None else root
        self.comm = comm[:15]
        self.cmdline = list(cmdline)
        self.container_id = own_container_id() if container_id is None else container_id
        # the card given (one rank's of a tensor-parallel stand-in), else CARDSHARE_SIM_CARD's
        self.card = find_card(self.root, choice if choice is not None else card_choice())
        self.pid: int | None = None
        self.client_id: int | None = None
        self._clock = clock
        self._tick = tick_seconds
        self._lock = threading.Lock()
        self._vram = 0
        self._system = 0
        self._busy: dict[str, float] = {}
        self._cycles: dict[str, float] = dict.fromkeys(ENGINE_CLASSES, 0.0)
        self._start = clock()
        self._last = self._start
        self._total_base = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def registered(self) -> bool:
        return self.pid is not None

    @property
    def pid_dir(self) -> Path | None:
        return None if self.pid is None else self.root / "proc" / str(self.pid)

    def free_vram(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the card as seen now (0, 0 without a card)."""
        if self.card is None:
            return 0, 0
        used = read_resident_vram(self.root, self.card.pdev, exclude_pid=self.pid)
        used += self._vram if self.registered else 0
        return max(self.card.vram_total - used, 0), self.card.vram_total

    def register(self, vram: int = 0, system: int = 4 * 1024 * 1024) -> bool:
        """Create the ``proc/<pid>`` entry; ``False`` when the root has no card."""
        if self.card is None:
            return False
        with self._lock:
            if self.pid is not None:
                self._vram = vram
                self._write_locked()
                return True
            self._vram = vram
            self._system = system
            # xe's total-cycles is the GT timestamp since boot: start from a plausible value.
            self._total_base = int(time.time() * TIMESTAMP_HZ) % (1 << 40)
            remove_dead_siblings(self.root, self.container_id, PROCESS_INSTANCE)
            self.client_id = _next_client_id(self.root)
            self.pid = _allocate_dir(self.root / "proc", FIRST_PID)
            pid_dir = self.root / "proc" / str(self.pid)
            owner = {
                "owner_pid": os.getpid(),
                "instance": PROCESS_INSTANCE,
                "container_id": self.container_id,
                "note": "SIMULATION: lab stand-in entry, not a real process",
            }
            (pid_dir / OWNER_FILE).write_text(json.dumps(owner) + "\n")
            (pid_dir / "comm").write_text(self.comm + "\n")
            (pid_dir / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in self.cmdline))
            (pid_dir / "cgroup").write_text(cgroup_line(self.container_id))
            (pid_dir / "fdinfo").mkdir()
            (pid_dir / "fd").mkdir()
            self._write_locked()
            # The descriptor appears last, so a reader never finds it without its fdinfo.
            os.symlink(self.card.render_node, pid_dir / "fd" / str(DRM_FD))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="simcard", daemon=True)
            self._thread.start()
        return True

    def set_vram(self, vram: int) -> None:
        with self._lock:
            self._advance_locked()
            self._vram = vram
            self._write_locked()

    def set_busy(self, busy: Mapping[str, float]) -> None:
        """Mark engines busy (``{"ccs": 1.0, "rcs": 0.5}``); an empty mapping means idle."""
        unknown = sorted(set(busy) - set(ENGINE_CLASSES))
        if unknown:
            raise ValueError(f"unknown engine classes: {unknown}")
        with self._lock:
            self._advance_locked()
            self._busy = {k: max(0.0, min(v, ENGINE_CAPACITY.get(k, 1))) for k, v in busy.items()}
            self._write_locked()

    def refresh(self) -> None:
        """Advance the counters to now and rewrite the fdinfo file."""
        with self._lock:
            self._advance_locked()
            self._write_locked()

    def close(self, release_seconds: float = 0.0) -> None:
        """Unregister: wait ``release_seconds`` (memory lingers), then remove the entry."""
        if self.pid is None:
            return
        if release_seconds > 0:
            time.sleep(release_seconds)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        with self._lock:
            pid_dir = self.pid_dir
            self.pid = None
            self._thread = None
            self._stop = threading.Event()
        if pid_dir is not None:
            remove_entry(pid_dir)

    def leave(self, linger_seconds: float) -> None:
        """Exit without closing: the entry stays with its memory, and the reaper removes it
        ``linger_seconds`` after now, once its container is gone (``release_after`` in the
        owner file): a process whose memory the driver frees late."""
        if self.pid is None:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        with self._lock:
            pid_dir = self.pid_dir
            self.pid = None
            self._thread = None
            self._stop = threading.Event()
        if pid_dir is not None:
            owner_path = pid_dir / OWNER_FILE
            with contextlib.suppress(OSError, ValueError):
                owner = json.loads(owner_path.read_text())
                owner["release_after"] = time.time() + linger_seconds
                _write_atomic(owner_path, (json.dumps(owner) + "\n").encode())

    def snapshot(self) -> FdinfoState | None:
        with self._lock:
            return self._state_locked()

    def _elapsed_ticks(self, now: float) -> int:
        return int((now - self._start) * TIMESTAMP_HZ)

    def _advance_locked(self) -> None:
        now = self._clock()
        delta = (now - self._last) * TIMESTAMP_HZ
        self._last = now
        for engine, load in self._busy.items():
            self._cycles[engine] += delta * load

    def _state_locked(self) -> FdinfoState | None:
        if self.card is None or self.client_id is None:
            return None
        return FdinfoState(
            client_id=self.client_id,
            pdev=self.card.pdev,
            resident={"system": self._system, "gtt": 192 * 1024, "vram0": self._vram},
            cycles={k: int(v) for k, v in self._cycles.items()},
            total_cycles=self._total_base + self._elapsed_ticks(self._last),
            ino=1000 + self.client_id,
        )

    def _write_locked(self) -> None:
        pid_dir = self.pid_dir
        state = self._state_locked()
        if pid_dir is None or state is None:
            return
        with contextlib.suppress(FileNotFoundError):
            _write_atomic(pid_dir / "fdinfo" / str(DRM_FD), render_fdinfo(state).encode())

    def _run(self) -> None:
        stop = self._stop
        while not stop.wait(self._tick):
            with self._lock:
                if self.pid is None:
                    return
                self._advance_locked()
                self._write_locked()
