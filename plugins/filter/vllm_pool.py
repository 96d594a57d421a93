# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters for vLLM over a pool of cards: thin shells over ``plugin_utils._vllm_pool``.

Each filter is documented in its own ``<filter name>.yml`` beside this file; errors become
``AnsibleFilterError`` with the message naming the variable, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._filter_errors import filter_errors
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import VllmTuningError
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_pool import (
    pool_ladder,
    pool_plan,
    pool_render_nodes,
)

_filter = filter_errors(VllmTuningError)


@_filter
def vllm_pool_plan_filter(settings: object) -> dict[str, object]:
    return pool_plan(settings)


@_filter
def vllm_pool_ladder_filter(settings: object) -> list[dict[str, object]]:
    return pool_ladder(settings)


@_filter
def vllm_pool_render_nodes_filter(pool: object) -> list[str]:
    return pool_render_nodes(pool)


class FilterModule:
    """The vllm role's filters over a pool of cards."""

    def filters(self) -> dict[str, Callable[..., object]]:
        return {
            "vllm_pool_plan": vllm_pool_plan_filter,
            "vllm_pool_ladder": vllm_pool_ladder_filter,
            "vllm_pool_render_nodes": vllm_pool_render_nodes_filter,
        }
