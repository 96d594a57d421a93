# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""vLLM over a pool of cards (tensor parallelism): pure functions over the one-card plan.

The pool is the cards ``xe_driver_card_jobs`` gives job ``llm`` (the xe_driver role's fact
``xe_driver_jobs``), by PCI address.  On it:

* ``--tensor-parallel-size`` is the pool's size (not passed for a pool of one);
* ``--gpu-memory-utilization`` is computed for every card from that card's own tenants (the
  ``vllm_reservations`` whose ``pdev`` names it; one without ``pdev`` sits on the card that
  takes transcodes) and the tightest card's share is taken, since vLLM applies one share to
  every card of its pool;
* the weights are checked, and the ladder's rungs sized, with each card's shard of the weights
  (``_vllm_plan.weights_per_card``), not the whole model on one card;
* the container gets exactly the pool's render nodes by PCI path
  (``/dev/dri/by-path/pci-<address>-render``), never ``renderD<N>``, whose numbers move
  between boots.  Intel's compute runtime enumerates the cards from that directory.

Without a declared pool (``vllm_pool`` empty: the one-card host) every function gives what
the single-card plan gives, unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    vllm_plan,
    vllm_plan_ladder,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    gpu_memory_utilization,
    parse_reservations,
)

__all__ = [
    "POOL_SETTINGS_KEYS",
    "CardShare",
    "card_shares",
    "pool_ladder",
    "pool_plan",
    "pool_render_nodes",
]

POOL_SETTINGS_KEYS: tuple[str, ...] = ("vllm_pool", "vllm_transcode_pdev")
TP_FLAG = "--tensor-parallel-size"
_PDEV_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_POOL_FIX = "the xe_driver role publishes it from xe_driver_card_jobs (xe_driver_jobs.llm)"


@dataclass(frozen=True)
class CardShare:
    """One pool card: its address, the reservations on it and the share vLLM may claim."""

    pdev: str
    reservations: tuple[Mapping[str, object], ...]
    gpu_memory_utilization: float

    def as_dict(self) -> dict[str, object]:
        return {
            "pdev": self.pdev,
            "reservations": [str(r.get("name")) for r in self.reservations],
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }


def _pdev(value: object, variable: str) -> str:
    if not isinstance(value, str) or not _PDEV_RE.match(value):
        raise VllmTuningError(
            f"{variable} is {value!r}: expected a PCI address such as '0000:03:00.0'; {_POOL_FIX}"
        )
    return value


def _pool(settings: Mapping[str, object]) -> list[str]:
    value = settings.get("vllm_pool")
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise VllmTypeError(
            f"vllm_pool is {value!r}: expected a list of PCI addresses; {_POOL_FIX}"
        )
    pool = [_pdev(item, f"vllm_pool[{index}]") for index, item in enumerate(value)]
    if len(set(pool)) != len(pool):
        raise VllmTuningError(f"vllm_pool is {pool!r}: a card is listed twice; {_POOL_FIX}")
    return pool


def pool_render_nodes(pool: object) -> list[str]:
    """The render node of every pool card by its PCI path, in the pool's order."""
    return [f"/dev/dri/by-path/pci-{pdev}-render" for pdev in _pool({"vllm_pool": pool})]


def _reservations_by_card(
    settings: Mapping[str, object], pool: Sequence[str]
) -> dict[str, list[Mapping[str, object]]]:
    """The reservations on each pool card; those on a card outside the pool are left out."""
    raw = settings.get("vllm_reservations")
    parse_reservations(raw)  # the shape, with its own messages
    items: Sequence[Mapping[str, object]] = raw if isinstance(raw, Sequence) else []
    transcode = settings.get("vllm_transcode_pdev")
    by_card: dict[str, list[Mapping[str, object]]] = {pdev: [] for pdev in pool}
    for index, item in enumerate(items):
        where = f"vllm_reservations[{index}].pdev"
        named = item.get("pdev")
        if named is not None and not pool:
            raise VllmTuningError(
                f"{where} is {named!r}, but xe_driver_card_jobs names no cards: on a one-card "
                "host every reservation is on the card; drop pdev, or list the host's cards in "
                "xe_driver_card_jobs"
            )
        if named is None:
            home = transcode if isinstance(transcode, str) else (pool[0] if pool else None)
        else:
            home = _pdev(named, where)
            if home not in pool and home != transcode:
                known = ", ".join([*pool, *([transcode] if isinstance(transcode, str) else [])])
                raise VllmTuningError(
                    f"{where} is {named!r}, not a card of xe_driver_card_jobs ({known}): name "
                    "the card the tenant uses, or drop pdev to put it on the card that takes "
                    "transcodes"
                )
        if home in by_card:
            by_card[home].append(item)
    return by_card


def card_shares(settings: object) -> list[CardShare]:
    """The share vLLM may claim on every pool card, from that card's own reservations.

    Every card has the same memory (the xe_driver role refuses a pool whose cards differ),
    ``vllm_card_memory``; each gets the same headroom, ceiling and override, checked against
    its own reservations.  A refusal names the card.
    """
    conf = _settings(settings)
    pool = _pool(conf)
    shares: list[CardShare] = []
    for pdev, reservations in _reservations_by_card(conf, pool).items():
        try:
            share = gpu_memory_utilization(
                conf.get("vllm_card_memory"),
                reservations,
                conf.get("vllm_driver_headroom"),
                ceiling=conf.get("vllm_gpu_memory_utilization_max"),
                override=conf.get("vllm_gpu_memory_utilization"),
            )
        except VllmTuningError as err:
            raise type(err)(f"on pool card {pdev}: {err}") from err
        shares.append(CardShare(pdev, tuple(reservations), share))
    return shares


def _tightest(settings: Mapping[str, object]) -> tuple[dict[str, object], list[CardShare]]:
    """The settings of the tightest pool card (its reservations), and every card's share."""
    shares = card_shares(settings)
    tightest = min(shares, key=lambda card: card.gpu_memory_utilization)
    return {**settings, "vllm_reservations": list(tightest.reservations)}, shares


def _with_tp(args: object, size: int) -> list[str]:
    if not isinstance(args, list):  # _vllm_plan always builds a list
        raise VllmTuningError(f"the plan's args are {type(args).__name__}, not a list")
    argv = [str(arg) for arg in args]
    if size < 2:
        return argv
    at = argv.index("--gpu-memory-utilization") + 2
    return [*argv[:at], TP_FLAG, str(size), *argv[at:]]


def _settings(settings: object) -> Mapping[str, object]:
    if not isinstance(settings, Mapping):
        raise VllmTypeError(
            f"settings: expected a mapping of the vllm role's variables, got "
            f"{type(settings).__name__}"
        )
    return settings


def pool_plan(settings: object) -> dict[str, object]:
    """:func:`vllm_plan` over the pool: the tightest card's share, the pool's TP size.

    Adds ``tensor_parallel_size``, ``pool`` (every card's ``pdev``, ``reservations`` and
    ``gpu_memory_utilization``) and ``tightest_pdev``.  Without a pool: :func:`vllm_plan`.
    """
    conf = _settings(settings)
    if not _pool(conf):
        _reservations_by_card(conf, [])  # refuses a pdev on a one-card host
        return vllm_plan(conf)
    tight, shares = _tightest(conf)
    plan = vllm_plan({**tight, "vllm_tensor_parallel_size": len(shares)})
    return {
        **plan,
        "args": _with_tp(plan["args"], len(shares)),
        "tensor_parallel_size": len(shares),
        "pool": [card.as_dict() for card in shares],
        "tightest_pdev": min(shares, key=lambda card: card.gpu_memory_utilization).pdev,
    }


def pool_ladder(settings: object) -> list[dict[str, object]]:
    """:func:`vllm_plan_ladder` over the pool: each rung's arguments carry the TP size (its
    ``reservation_bytes`` is what it needs free on each pool card).  Without a pool:
    :func:`vllm_plan_ladder`."""
    conf = _settings(settings)
    if not _pool(conf):
        _reservations_by_card(conf, [])
        return vllm_plan_ladder(conf)
    tight, shares = _tightest(conf)
    return [
        {**rung, "args": _with_tp(rung["args"], len(shares)), "tensor_parallel_size": len(shares)}
        for rung in vllm_plan_ladder({**tight, "vllm_tensor_parallel_size": len(shares)})
    ]
