# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A host's cards by PCI address, each with its job (``xe_driver_card_jobs``).

The inventory says which cards form the LLM pool (vLLM's tensor-parallel group) and which
card takes transcodes (Plex, the re-encode campaign)::

    xe_driver_card_jobs:
      - {pdev: "0000:03:00.0", device_id: e223, job: llm}        # Arc Pro B70
      - {pdev: "0000:04:00.0", device_id: e223, job: llm}        # Arc Pro B70
      - {pdev: "0000:07:00.0", device_id: 56a5, job: transcode}  # Arc A380

An empty list is the one-card host: its first card does every job, as before.

Three parts, each pure but the last:

* :func:`parse_card_jobs` checks the inventory's shape (an address as sysfs spells it, a
  device id, a job; a card in two jobs; one transcode card; a pool);
* :func:`check_card_jobs` checks it against the cards ``xe_driver_info`` found: a card that is
  not there or has another id, a pool whose cards differ in memory, a transcode card without
  a video engine; :func:`diagnose_cards` runs the driver's diagnosis of each card by its own
  id; :func:`resolve_card_jobs` gives the roles that follow the pool and the transcode card;
* :func:`read_engine_classes` reads a card's engine classes from sysfs
  (``tile<N>/gt<N>/engines/<class>``, the xe driver's ``xe_hw_engine_class_sysfs.c``).

Every refusal names the variable, its value and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_diagnose import (
    Problem,
    diagnose,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._xe_parse import normalise_device_id

__all__ = [
    "JOBS",
    "MEDIA_ENGINE",
    "VARIABLE",
    "CardJob",
    "CardJobsError",
    "check_card_jobs",
    "diagnose_cards",
    "parse_card_jobs",
    "read_engine_classes",
    "render_node_by_path",
    "resolve_card_jobs",
]

VARIABLE = "xe_driver_card_jobs"
LLM = "llm"
TRANSCODE = "transcode"
JOBS = (LLM, TRANSCODE)
# The video box: decode and encode (xe's engine class "vcs"); "vecs" only enhances.
MEDIA_ENGINE = "vcs"
_KEYS = frozenset({"pdev", "device_id", "job"})
_PDEV_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_EXAMPLE = "{pdev: '0000:03:00.0', device_id: e223, job: llm}"


class CardJobsError(ValueError):
    """An inventory of cards the host cannot serve; the message names variable, value, fix."""


@dataclass(frozen=True)
class CardJob:
    """One card of the inventory: its PCI address, its device id (lower-case hex), its job."""

    index: int
    pdev: str
    device_id: str
    job: str

    @property
    def where(self) -> str:
        return f"{VARIABLE}[{self.index}]"


def _gib(size: int) -> str:
    value = size / 1024**3
    return f"{value:g} GiB" if value >= 1 else f"{size} bytes"


def parse_card_jobs(value: object) -> list[CardJob]:
    """The inventory's entries, checked for shape alone (no host is read)."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise CardJobsError(
            f"{VARIABLE} is {value!r}: give a list of cards, one mapping each, such as "
            f"[{_EXAMPLE}], or [] for a host whose one card does every job"
        )
    jobs: list[CardJob] = []
    for index, item in enumerate(value):
        where = f"{VARIABLE}[{index}]"
        if not isinstance(item, Mapping):
            raise CardJobsError(
                f"{where} is {item!r}: give a mapping with pdev, device_id and job, such as "
                f"{_EXAMPLE}"
            )
        unknown = sorted(str(key) for key in item if key not in _KEYS)
        missing = sorted(key for key in _KEYS if key not in item)
        if unknown or missing:
            said = "; ".join(
                part
                for part in (
                    f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                    f"missing {', '.join(missing)}" if missing else "",
                )
                if part
            )
            raise CardJobsError(
                f"{where} is {dict(item)!r}: {said}; a card has pdev, device_id and job, such as "
                f"{_EXAMPLE}"
            )
        pdev = item["pdev"]
        if not isinstance(pdev, str) or not _PDEV_RE.match(pdev):
            raise CardJobsError(
                f"{where}.pdev is {pdev!r}: give the card's PCI address as sysfs spells it, "
                "domain first and lower case, such as '0000:03:00.0' (lspci -D -d 8086: lists "
                "them)"
            )
        try:
            device_id = normalise_device_id(str(item["device_id"]))
        except ValueError:
            raise CardJobsError(
                f"{where}.device_id is {item['device_id']!r}: give the card's PCI device id as 4 "
                f"hex digits, such as e223 (Arc Pro B70) or 56a5 (Arc A380); lspci -nn -s {pdev} "
                "shows it after 8086:"
            ) from None
        job = item["job"]
        if job not in JOBS:
            raise CardJobsError(
                f"{where}.job is {job!r}: give one of {', '.join(JOBS)} (llm: a card of vLLM's "
                "pool; transcode: the card Plex and the re-encode campaign use)"
            )
        jobs.append(CardJob(index=index, pdev=pdev, device_id=device_id, job=str(job)))

    seen: dict[str, CardJob] = {}
    for card in jobs:
        first = seen.get(card.pdev)
        if first is None:
            seen[card.pdev] = card
            continue
        if first.job != card.job:
            raise CardJobsError(
                f"{VARIABLE} gives {card.pdev} two jobs ({first.where} {first.job}, "
                f"{card.where} {card.job}): a card does one job; keep one entry for it (a host "
                f"whose one card does every job needs no {VARIABLE} at all)"
            )
        raise CardJobsError(
            f"{VARIABLE} lists {card.pdev} twice ({first.where} and {card.where}): list each "
            "card once"
        )
    if jobs and not any(card.job == LLM for card in jobs):
        raise CardJobsError(
            f"{VARIABLE} names no llm card ({', '.join(f'{c.pdev} {c.job}' for c in jobs)}): "
            "give vLLM's pool at least one card with job: llm"
        )
    transcode = [card for card in jobs if card.job == TRANSCODE]
    if len(transcode) > 1:
        raise CardJobsError(
            f"{VARIABLE} gives transcodes {len(transcode)} cards "
            f"({', '.join(c.pdev for c in transcode)}): one card takes transcodes; keep one "
            "entry with job: transcode"
        )
    return jobs


def _found_text(devices: Sequence[Mapping[str, Any]]) -> str:
    if not devices:
        return "no Intel display device was found"
    return "found: " + ", ".join(f"{d.get('bdf')} (8086:{d.get('device_id')})" for d in devices)


def check_card_jobs(
    jobs: Sequence[CardJob], devices: Sequence[Mapping[str, Any]], *, strict: bool
) -> list[str]:
    """Why the inventory does not fit the cards found (``xe_driver_info``'s ``xe_devices``).

    Before any change (``strict`` false) a card's memory and engines are known only once xe
    drives it: what is unknown is not judged yet.  After the driver's checks (``strict``
    true) a transcode card on xe whose engines cannot be read is refused too.
    """
    by_bdf = {str(d.get("bdf")): d for d in devices}
    refusals: list[str] = []
    pool: list[tuple[CardJob, Mapping[str, Any]]] = []
    for card in jobs:
        dev = by_bdf.get(card.pdev)
        if dev is None:
            refusals.append(
                f"{card.where}.pdev is '{card.pdev}' ({card.job}): no Intel display device at "
                f"that address ({_found_text(devices)}); give an address lspci -D -d 8086: "
                "lists, or seat and pass through the card"
            )
            continue
        if dev.get("device_id") != card.device_id:
            refusals.append(
                f"{card.where}.device_id is '{card.device_id}' but the card at {card.pdev} is "
                f"8086:{dev.get('device_id')}: correct device_id, or the address if the cards "
                "are in other slots"
            )
            continue
        if card.job == LLM:
            pool.append((card, dev))
        elif card.job == TRANSCODE:
            refusals.extend(_media_refusal(card, dev, strict))

    sizes = [(card, dev.get("vram_bytes")) for card, dev in pool]
    known = [(card, size) for card, size in sizes if isinstance(size, int)]
    if len({size for _card, size in known}) > 1:
        listed = ", ".join(f"{card.pdev} {_gib(size)}" for card, size in known)
        refusals.append(
            f"{VARIABLE}: the llm pool's cards differ in memory ({listed}); vLLM splits the "
            "model evenly over its pool and applies one memory share to every card, so the "
            "smallest card would bound them all: pool cards of one model (two Arc Pro B70s), "
            "and give the other card another job"
        )
    return refusals


def _media_refusal(card: CardJob, dev: Mapping[str, Any], strict: bool) -> list[str]:
    engines = dev.get("engines")
    if engines is None:
        if strict and dev.get("driver") == "xe":
            return [
                f"{card.where} ({card.pdev}) takes transcodes but its engines could not be read "
                "(no tile*/gt*/engines in its sysfs directory): run as root, on a kernel whose "
                "xe publishes them"
            ]
        return []
    if MEDIA_ENGINE in engines:
        return []
    return [
        f"{card.where} ({card.pdev}, 8086:{card.device_id}) takes transcodes but has no video "
        f"engine ({MEDIA_ENGINE}; engines: {', '.join(engines) or 'none'}): give job transcode "
        "to a card with a media engine (an Arc A380 or a B-series card), or drop the entry so "
        "the pool's first card takes transcodes"
    ]


def diagnose_cards(
    jobs: Sequence[CardJob],
    devices: Sequence[Mapping[str, Any]],
    require_firmware: bool,
    running_kernel: str | None,
    id_knowledge: Mapping[str, Mapping[str, Any]],
    require_fdinfo: bool = True,
    firmware_package: str = "linux-firmware",
) -> list[Problem]:
    """The driver's diagnosis of every card of the inventory, each by its own id and address.

    Another card with the same id (a card outside the inventory) is no problem; a card that
    is missing, or has another id at its address, is.
    """
    by_bdf = {str(d.get("bdf")): d for d in devices}
    problems: list[Problem] = []
    for card in jobs:
        dev = by_bdf.get(card.pdev)
        if dev is None:
            knows = id_knowledge.get(card.device_id, {})
            kernels = list(knows.get("kernels_knowing_id") or [])
            note = f"; installed kernels whose xe lists it: {', '.join(kernels)}" if kernels else ""
            problems.append(
                Problem(
                    code="no_device",
                    device=card.pdev,
                    message=(
                        f"no PCI device at {card.pdev} ({card.where}, {card.job}, expected "
                        f"8086:{card.device_id}); {_found_text(devices)}{note}"
                    ),
                    fix=(
                        "check that the card is seated and passed through to this machine "
                        f"(lspci -nn -D -d 8086:{card.device_id}), or correct {card.where}.pdev"
                    ),
                )
            )
            continue
        if dev.get("device_id") != card.device_id:
            problems.append(
                Problem(
                    code="wrong_device",
                    device=card.pdev,
                    message=(
                        f"the card at {card.pdev} is 8086:{dev.get('device_id')}, not "
                        f"8086:{card.device_id} ({card.where})"
                    ),
                    fix=f"correct {card.where}.device_id, or its pdev if the cards moved",
                )
            )
            continue
        problems.extend(
            diagnose(
                [dev],
                [card.device_id],
                require_firmware,
                running_kernel,
                id_knowledge,
                require_fdinfo=require_fdinfo,
                firmware_package=firmware_package,
            )
        )
    return problems


def render_node_by_path(pdev: str) -> str:
    """A card's render node by its PCI path: stable across boots, unlike ``renderD<N>``."""
    if not _PDEV_RE.match(pdev):
        raise CardJobsError(
            f"render_node_by_path: {pdev!r} is not a PCI address such as '0000:03:00.0'"
        )
    return f"/dev/dri/by-path/pci-{pdev}-render"


_CARD_KEYS = (
    "card",
    "render_node",
    "render_node_path",
    "vram_bytes",
    "guc_status",
    "huc_status",
    "fdinfo_status",
    "engines",
)


def resolve_card_jobs(
    jobs: Sequence[CardJob], cards: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The pool and the transcode card the roles that follow use, from the cards on xe.

    ``cards`` are the ``xe_cards`` filter's dicts.  Without an inventory (``declared``
    false) the first card is the pool and takes transcodes, as on a one-card host.  A card of
    the inventory that xe does not drive yet (before a kernel update, in the check play) keeps
    its place with what is unknown null, so the pool's size stays the inventory's.
    """
    by_bdf = {str(c.get("bdf")): c for c in cards}

    def card_of(pdev: str, device_id: str) -> dict[str, Any]:
        found = by_bdf.get(pdev) or {
            "bdf": pdev,
            "device_id": device_id,
            **dict.fromkeys(_CARD_KEYS),
        }
        return {**found, "render_node_by_path": render_node_by_path(pdev)}

    if not jobs:
        first = card_of(str(cards[0].get("bdf")), str(cards[0].get("device_id"))) if cards else None
        return {"declared": False, "llm": [first] if first else [], "transcode": first}
    llm = [card_of(j.pdev, j.device_id) for j in jobs if j.job == LLM]
    transcode = next((card_of(j.pdev, j.device_id) for j in jobs if j.job == TRANSCODE), None)
    return {"declared": True, "llm": llm, "transcode": transcode or llm[0]}


def _gt_engines(gt_dir: str) -> list[str] | None:
    try:
        names = os.listdir(os.path.join(gt_dir, "engines"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return [name for name in names if not name.startswith(".")]


def read_engine_classes(host_root: str, bdf: str) -> list[str] | None:
    """The engine classes (``rcs``, ``bcs``, ``vcs``, ``vecs``, ``ccs``) of a card on xe.

    xe publishes ``engines/<class>`` under each GT (``tile<N>/gt<N>``; the media GT of a
    Battlemage card is ``gt1``).  ``None`` when no GT of the card has an ``engines``
    directory (not on xe, or a kernel that does not publish them); raises
    ``PermissionError`` as ``os`` does.
    """
    dev_dir = os.path.join(host_root or "/", "sys/bus/pci/devices", bdf)
    found: set[str] = set()
    read_any = False
    try:
        tiles = [t for t in os.listdir(dev_dir) if re.fullmatch(r"tile\d+", t)]
    except (FileNotFoundError, NotADirectoryError):
        return None
    for tile in tiles:
        try:
            gts = [g for g in os.listdir(os.path.join(dev_dir, tile)) if re.fullmatch(r"gt\d+", g)]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for gt in gts:
            engines = _gt_engines(os.path.join(dev_dir, tile, gt))
            if engines is not None:
                read_any = True
                found.update(engines)
    return sorted(found) if read_any else None
