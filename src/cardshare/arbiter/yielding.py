"""Yielding tenants: the card's clients that step aside for a swap to image when asked (a
lease they renew or let lapse) and are told when the card is back."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from cardshare.arbiter.cardview import CardView
from cardshare.arbiter.common import CardWatch, Clock, Pace
from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import Rejected, Unavailable, YieldingApi
from cardshare.arbiter.rules import SwapObservations, should_swap_to_image

log = logging.getLogger("cardshare.arbiter")


@dataclass
class YieldingTenants:
    config: Config
    api: YieldingApi | None
    clock: Clock
    pace: Pace
    watch: CardWatch
    # the tenants that acknowledged a pause: name -> the end of the lease (monotonic)
    paused: dict[str, float] = field(default_factory=dict)
    acked_at: float = 0.0  # when a tenant last acknowledged a pause (wall clock)

    def card_floor(self, now: float) -> float:
        """The oldest scan a swap may be weighed on: ``card_data_max_age_seconds`` old, but
        after the last pause a yielding tenant acknowledged, and a poll old while a paused
        tenant still shows memory (its release is awaited, as a stop's is, for at most
        ``llm_release_timeout_seconds`` after the acknowledgement: a tenant that keeps its
        memory longer is looked at again only as the data ages)."""
        floor = now - self.config.card_data_max_age_seconds
        paused = {name for name, until in self.paused.items() if until > self.clock.monotonic()}
        if paused:
            floor = max(floor, self.acked_at)
            view = self.watch.last
            awaited = now - self.acked_at < self.config.llm_release_timeout_seconds
            if (
                awaited
                and view is not None
                and any(c.name in paused and c.vram_bytes > 0 for c in view.clients)
            ):
                floor = max(floor, now - self.config.poll_interval_seconds)
        return floor

    def in_the_way(self, obs: SwapObservations) -> bool:
        """Would the swap go if the yielding tenants stepped aside?"""
        if self.api is None or obs.card is None or not self.config.yielding_tenants:
            return False
        names = {t.name for t in self.config.yielding_tenants}
        if not any(c.name in names for c in obs.card.clients):
            return False
        without = CardView(
            obs.card.scanned_at,
            tuple(c for c in obs.card.clients if c.name not in names),
            obs.card.vram_total_bytes,
        )
        return should_swap_to_image(
            dataclasses.replace(obs, card=without), self.config, self.clock.now()
        ).go

    async def pause(self, reason: str) -> None:
        """Ask every yielding tenant on the card to step aside (renewing a lease past its
        half); an ack within the tenant's bound is a pause, anything else leaves it a blocker."""
        if self.api is None:
            return
        now = self.clock.monotonic()  # the leases' ends
        lease = self.config.yield_lease_seconds
        on_card = {c.name for c in self.watch.last.clients} if self.watch.last else set()
        for tenant in self.config.yielding_tenants:
            until = self.paused.get(tenant.name)
            if until is not None and until - now > lease / 2:
                continue
            if until is None and tenant.name not in on_card:
                continue
            try:
                held = await self.pace.waiting(self.api.pause(tenant.name, lease, reason))
            except (Unavailable, Rejected) as exc:
                log.warning("yielding tenant %s did not ack a pause: %s", tenant.name, exc)
                self.paused.pop(tenant.name, None)
                continue
            if until is None or until <= now:  # a new pause, not a renewal: await its release
                self.acked_at = self.clock.now()
            self.paused[tenant.name] = self.clock.monotonic() + lease
            log.info("yielding tenant %s paused (%d bytes still held)", tenant.name, held)

    async def resume(self) -> None:
        if self.api is None:
            self.paused.clear()
            return
        for name in list(self.paused):
            try:
                await self.pace.waiting(self.api.resume(name))
            except (Unavailable, Rejected) as exc:  # its lease ends by itself
                log.warning("yielding tenant %s: resume failed: %s", name, exc)
            self.paused.pop(name, None)
