# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The host's cards by address with their jobs: a thin shell over ``module_utils._cards``.

Documented in ``xe_card_jobs.yml`` beside this file.  The message of a refusal names the
variable (``xe_driver_card_jobs``), the value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.xe import xe_cards
from ansible_collections.cardshare.gpuhost.plugins.module_utils._cards import (
    CardJobsError,
    check_card_jobs,
    parse_card_jobs,
    resolve_card_jobs,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._filter_errors import filter_errors


@filter_errors(CardJobsError)
def xe_card_jobs(
    card_jobs: object, info: object = None, expected_ids: object = None, strict: object = True
) -> Any:
    """Without ``info``: the inventory's entries, checked for shape.  With the registered
    result of ``xe_driver_info``: ``{declared, llm, transcode}`` for the roles that follow,
    or a refusal listing every way the inventory does not fit the cards found."""
    jobs = parse_card_jobs(card_jobs)
    if info is None:
        return [{"pdev": j.pdev, "device_id": j.device_id, "job": j.job} for j in jobs]
    if not isinstance(info, Mapping) or not isinstance(info.get("xe_devices"), list):
        raise AnsibleFilterError(
            "xe_card_jobs expects the registered result of cardshare.gpuhost.xe_driver_info, "
            f"got {type(info).__name__}"
        )
    if not isinstance(strict, bool):
        raise AnsibleFilterError(f"xe_card_jobs: strict must be true or false, got {strict!r}")
    refusals = check_card_jobs(jobs, info["xe_devices"], strict=strict)
    if refusals:
        raise CardJobsError(" ".join(refusals))
    cards = xe_cards(dict(info), expected_ids)
    engines = {d.get("bdf"): d.get("engines") for d in info["xe_devices"]}
    return resolve_card_jobs(jobs, [{**c, "engines": engines.get(c["bdf"])} for c in cards])


class FilterModule:
    """cardshare.gpuhost card inventory filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"xe_card_jobs": xe_card_jobs}
