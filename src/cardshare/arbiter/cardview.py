"""Who is on the card, as the arbiter sees it: a small adapter over the recorder's data.

The recorder writes ``current.json`` atomically into its data directory. This module reads
it into a :class:`CardView` (scan time, clients with name, VRAM bytes and busy engines) and,
when the data is older than allowed, runs a configured command for a fresh scan. The
parser accepts the recorder's snapshot (``timestamp_unix`` and ``cards.<pdev>.clients``)
and a flat ``clients`` list, so a change of the recorder's layout stays in this file.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("cardshare.arbiter")

# A client whose engine busy share is above this counts as working on the card.
BUSY_THRESHOLD = 0.0


@dataclass(frozen=True)
class CardClient:
    name: str
    vram_bytes: int
    busy_engines: tuple[str, ...]
    # the pool card it was seen on (a view over several cards); None: the view's one card
    pdev: str | None = None


@dataclass(frozen=True)
class OtherCard:
    """A card of the host that is not the arbiter's (a transcode card, an iGPU): shown on the
    status page, never weighed in a decision."""

    pdev: str
    vram_total_bytes: int | None
    clients: tuple[CardClient, ...]


@dataclass(frozen=True)
class CardView:
    scanned_at: float  # unix seconds
    clients: tuple[CardClient, ...]
    # the card's device memory as the driver reports it (the first card that has a size)
    vram_total_bytes: int | None = None
    # a view over a pool of cards: each card's PCI address and size, in the pool's order
    # (its clients name their card); empty: one card, or every card of a one-GPU host
    cards: tuple[tuple[str, int | None], ...] = ()
    # the host's other cards, in the card data's order, when the view is over named cards:
    # for the page only, so not part of what makes two views equal
    elsewhere: tuple[OtherCard, ...] = field(default=(), compare=False)

    def age(self, now: float) -> float:
        return now - self.scanned_at

    def per_card(self) -> tuple[tuple[str | None, CardView], ...]:
        """The view card by card: each pool card's clients and size (None: the one card)."""
        if not self.cards:
            return ((None, self),)
        return tuple((pdev, self.on(pdev)) for pdev, _ in self.cards)

    def on(self, pdev: str | None) -> CardView:
        """One pool card's clients and size; the view itself when it is not over a pool (or
        ``pdev`` is None)."""
        if not self.cards or pdev is None:
            return self
        sizes = dict(self.cards)
        if pdev not in sizes:
            raise CardDataError(f"card {pdev} is not in the pool ({', '.join(sizes)})")
        return CardView(
            self.scanned_at,
            tuple(replace(c, pdev=None) for c in self.clients if c.pdev == pdev),
            sizes[pdev],
        )

    def others(self, allowed: Iterable[str]) -> tuple[CardClient, ...]:
        """Clients not in ``allowed`` that hold VRAM or keep an engine busy."""
        names = set(allowed)
        return tuple(
            c for c in self.clients if c.name not in names and (c.vram_bytes > 0 or c.busy_engines)
        )

    def vram_of(self, names: Iterable[str]) -> int:
        wanted = set(names)
        return sum(c.vram_bytes for c in self.clients if c.name in wanted)


class CardDataError(ValueError):
    pass


def _timestamp(doc: dict[str, Any]) -> float:
    for key in ("timestamp_unix", "scanned_at", "time"):
        value = doc.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    value = doc.get("timestamp")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise CardDataError("card data has no scan time (timestamp_unix or timestamp)")


def _client(raw: Any, pdev: str | None = None) -> CardClient:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise CardDataError(f"card data client without a name: {raw!r}"[:200])
    vram = raw.get("vram_bytes", 0)
    if isinstance(vram, bool) or not isinstance(vram, int | float):
        raise CardDataError(f"card data client {raw['name']} has vram_bytes {vram!r}")
    engines = raw.get("engines") or {}
    busy: list[str] = []
    if isinstance(engines, dict):
        busy = [
            str(cls)
            for cls, ratio in sorted(engines.items())
            if isinstance(ratio, int | float) and ratio > BUSY_THRESHOLD
        ]
    elif isinstance(engines, list):
        busy = sorted(str(e) for e in engines)
    return CardClient(name=raw["name"], vram_bytes=int(vram), busy_engines=tuple(busy), pdev=pdev)


def _size(card: dict[str, Any]) -> int | None:
    size = card.get("vram_total_bytes")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    return None


def parse_card_view(doc: Any, pdev: str | Sequence[str] | None = None) -> CardView:
    """Pure: one decoded ``current.json`` to a :class:`CardView`.

    With ``pdev`` (the card the arbiter trades), only that card's clients and size: on a host
    with another GPU (an iGPU driving the desktop, or a second card) their clients are not on
    this card.  With several (the LLM pool), the clients of each, by card, and each card's
    size: the pool is one owner's, a transcode card or an iGPU beside it is not on it (they
    are kept apart, in ``elsewhere``, for the status page).  Without, the clients of every
    card (a host with one GPU).
    """
    if not isinstance(doc, dict):
        raise CardDataError(f"card data must be a JSON object, got {type(doc).__name__}")
    pool = (pdev,) if isinstance(pdev, str) else tuple(pdev or ())
    raw_clients: list[tuple[Any, str | None]] = []
    total: int | None = None
    sizes: list[tuple[str, int | None]] = []
    others: list[OtherCard] = []
    cards = doc.get("cards")
    if pool and isinstance(cards, dict):
        missing = [p for p in pool if p not in cards]
        if missing:
            key = "card_pdev" if len(pool) == 1 else "pool_pdevs"
            raise CardDataError(
                f"card data has no card {', '.join(missing)} (cards: "
                f"{', '.join(sorted(map(str, cards)))}): set {key} to the "
                + ("card's PCI address" if len(pool) == 1 else "pool cards' PCI addresses")
            )
        for name in pool:
            card = cards[name]
            found = card if isinstance(card, dict) else {}
            tag = name if len(pool) > 1 else None
            raw_clients.extend((c, tag) for c in found.get("clients") or [])
            sizes.append((name, _size(found)))
        total = next((size for _, size in sizes if size is not None), None)
        for name, card in cards.items():
            if name in pool or not isinstance(card, dict):
                continue
            found_clients = tuple(_client(c, None) for c in card.get("clients") or [])
            others.append(OtherCard(str(name), _size(card), found_clients))
    else:
        card_docs = list(cards.values()) if isinstance(cards, dict) else cards
        if isinstance(card_docs, list):
            for card in card_docs:
                if isinstance(card, dict):
                    raw_clients.extend((c, None) for c in card.get("clients") or [])
                    if total is None:
                        total = _size(card)
    if isinstance(doc.get("clients"), list):
        raw_clients.extend((c, None) for c in doc["clients"])
    return CardView(
        scanned_at=_timestamp(doc),
        clients=tuple(_client(c, tag) for c, tag in raw_clients),
        vram_total_bytes=total,
        cards=tuple(sizes) if len(pool) > 1 else (),
        elsewhere=tuple(others),
    )


def _load_view(path: Path, pdev: str | Sequence[str] | None = None) -> CardView:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CardDataError(f"cannot read card data {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise CardDataError(f"card data {path} is not UTF-8: {exc}") from exc
    try:
        return parse_card_view(json.loads(text), pdev)
    except json.JSONDecodeError as exc:
        raise CardDataError(f"card data {path} is not JSON: {exc}") from exc


class CardSource(Protocol):
    async def read(self, newer_than: float | None = None) -> CardView:
        """The card view. With ``newer_than``, data scanned before that time triggers a
        fresh scan first (the result may still be older: callers check)."""
        ...


class RecorderFileSource:
    """Reads the ``current.json`` of the arbiter's scans (``path``; ``scan_argv`` writes it
    on demand) and, when given, the recorder's own (``recorder_path``, its timer's scans):
    the newer of the two is the card, so an idle arbiter shows the recorder's data without a
    scan of its own.  A recorder file that cannot be read is passed over.  ``pdev`` selects
    the card, or the pool's cards (see :func:`parse_card_view`)."""

    def __init__(
        self,
        path: Path,
        scan_argv: Sequence[str],
        scan_timeout: float = 60.0,
        recorder_path: Path | None = None,
        pdev: str | Sequence[str] | None = None,
    ) -> None:
        self.path = path
        self.pdev = pdev
        self.scan_argv = tuple(scan_argv)
        self.scan_timeout = scan_timeout
        self.recorder_path = recorder_path

    def _load(self) -> CardView:
        views: list[CardView] = []
        errors: list[CardDataError] = []
        for path in (self.path, self.recorder_path):
            if path is None:
                continue
            try:
                views.append(_load_view(path, self.pdev))
            except CardDataError as exc:
                errors.append(exc)
        if not views:
            raise errors[-1]  # the recorder's, when the arbiter has not scanned yet
        for error in errors:
            log.debug("card data passed over: %s", error)
        return max(views, key=lambda view: view.scanned_at)  # a tie: the arbiter's own

    async def scan(self) -> None:
        if not self.scan_argv:
            return
        proc = await asyncio.create_subprocess_exec(
            *self.scan_argv,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), self.scan_timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise CardDataError(
                f"fresh scan {self.scan_argv[0]} took longer than {self.scan_timeout:g} s"
            ) from None
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip()[-300:]
            raise CardDataError(f"fresh scan {self.scan_argv[0]} exited {proc.returncode}: {tail}")

    async def read(self, newer_than: float | None = None) -> CardView:
        try:
            view: CardView | None = self._load()
        except CardDataError:
            if newer_than is None or not self.scan_argv:
                raise
            view = None
        if newer_than is not None and (view is None or view.scanned_at < newer_than):
            await self.scan()
            view = self._load()
        assert view is not None
        return view
