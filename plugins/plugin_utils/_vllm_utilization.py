# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``--gpu-memory-utilization`` for the ``vllm`` role (pure functions, no I/O): the share of
the card vLLM may claim at start, from the card's memory, the reservations of the card's
other tenants and a driver headroom (:func:`gpu_memory_utilization`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
    _type_name,
    human_size,
    parse_number,
    parse_size,
)

__all__ = [
    "DEFAULT_UTILIZATION_CEILING",
    "Reservation",
    "gpu_memory_utilization",
    "parse_reservations",
]

DEFAULT_UTILIZATION_CEILING = 0.95


# --------------------------------------------------------------------------- utilisation


@dataclass(frozen=True)
class Reservation:
    """Card memory another tenant needs: ``count`` uses of ``size`` bytes each."""

    name: str
    size: int
    count: int

    @property
    def total(self) -> int:
        return self.size * self.count


def parse_reservations(value: object, variable: str = "vllm_reservations") -> list[Reservation]:
    """Validate a list of ``{name, bytes, count}`` mappings (``count`` defaults to 1).

    A ``pdev`` key (the card the tenant is on, ``_vllm_pool``) is allowed and not read here.
    """
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise VllmTypeError(
            f"{variable}: expected a list of {{name, bytes, count}} mappings, "
            f"got {_type_name(value)}"
        )
    result: list[Reservation] = []
    for index, item in enumerate(value):
        where = f"{variable}[{index}]"
        if not isinstance(item, Mapping):
            raise VllmTypeError(
                f"{where}: expected a mapping with name, bytes and count, got {_type_name(item)}"
            )
        unknown = sorted(str(key) for key in item if key not in {"name", "bytes", "count", "pdev"})
        if unknown:
            raise VllmTuningError(
                f"{where}: unknown key(s) {', '.join(unknown)}; a reservation has name, bytes "
                "and count"
            )
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise VllmTuningError(f"{where}.name: give the tenant a name, got {name!r}")
        if "bytes" not in item:
            raise VllmTuningError(f"{where}.bytes: missing; give the size of one use, e.g. 2GiB")
        size = parse_size(item["bytes"], f"{where}.bytes", allow_zero=True)
        expected = "a whole number of uses (0 or more)"
        count = parse_number(item.get("count", 1), f"{where}.count", expected, "2", whole=True)
        if count < 0:
            raise VllmTuningError(f"{where}.count: expected {expected}, got {count!r}")
        result.append(Reservation(name=name, size=size, count=count))
    return result


def _check_ceiling(value: object) -> Fraction:
    ceiling = parse_number(value, "vllm_gpu_memory_utilization_max", "a number in (0, 1]", "0.95")
    if not 0 < ceiling <= 1:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization_max: {ceiling!r} is outside (0, 1]; "
            f"the default {DEFAULT_UTILIZATION_CEILING} leaves the driver some room"
        )
    return Fraction(str(ceiling))


def _check_override(value: object, ceiling: Fraction, ceiling_text: str) -> float:
    override = parse_number(
        value,
        "vllm_gpu_memory_utilization",
        f"null (computed) or a number in (0, {ceiling_text}]",
        "0.85",
    )
    if not 0 < Fraction(str(override)) <= ceiling:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: {override!r} is outside (0, {ceiling_text}]; set it "
            "to null to compute it from the card and its reservations, or to a share in range"
        )
    return float(override)


def gpu_memory_utilization(
    card_memory_bytes: object,
    reservations: object,
    driver_headroom_bytes: object,
    ceiling: object = DEFAULT_UTILIZATION_CEILING,
    override: object = None,
) -> float:
    """Share of the card vLLM may claim at start, rounded down to two decimals.

    ``(card - sum(reservations) - headroom) / card``; 32 GiB with two 2 GiB transcodes and
    0.8 GiB of headroom gives 0.85.  An ``override`` replaces the computation but is
    validated against the same range ``(0, ceiling]``.
    """
    ceiling_q = _check_ceiling(ceiling)
    ceiling_text = f"{float(ceiling_q):g}"
    card = parse_size(card_memory_bytes, "vllm_card_memory")
    tenants = parse_reservations(reservations)
    headroom = parse_size(driver_headroom_bytes, "vllm_driver_headroom", allow_zero=True)
    reserved = sum(item.total for item in tenants)
    if reserved > card:
        parts = ", ".join(f"{t.name} {t.count} x {human_size(t.size)}" for t in tenants)
        raise VllmTuningError(
            f"vllm_reservations: the reservations add up to {human_size(reserved)} ({parts}), "
            f"more than the card's {human_size(card)} (vllm_card_memory); lower the "
            "reservations or correct vllm_card_memory"
        )
    if override is not None:
        forced = _check_override(override, ceiling_q, ceiling_text)
        left = card - int(card * Fraction(str(forced)))
        if left < reserved:
            raise VllmTuningError(
                f"vllm_gpu_memory_utilization: {forced:g} of the card's {human_size(card)} "
                f"leaves {human_size(left)}, less than the {human_size(reserved)} of "
                "vllm_reservations; lower it, or set it to null to compute it"
            )
        return forced
    free = card - reserved - headroom
    hundredths = (100 * free) // card if free > 0 else 0
    share = Fraction(hundredths, 100)
    if share <= 0:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: the computed share {float(share):.2f} is outside "
            f"(0, {ceiling_text}]: the reservations ({human_size(reserved)}) and "
            f"vllm_driver_headroom ({human_size(headroom)}) leave "
            f"{human_size(max(free, 0))} of the card's {human_size(card)} for vLLM; lower "
            "vllm_reservations or vllm_driver_headroom"
        )
    if share > ceiling_q:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: the computed share {float(share):.2f} is outside "
            f"(0, {ceiling_text}]: only {human_size(reserved + headroom)} of the card's "
            f"{human_size(card)} is kept for other tenants and the driver; raise "
            "vllm_driver_headroom or vllm_reservations, or raise "
            "vllm_gpu_memory_utilization_max if the card really has no other tenant"
        )
    return float(share)
