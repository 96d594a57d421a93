# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters for the ``vllm`` role: thin shells over ``plugin_utils._vllm_*``.

Each filter is documented in its own ``<filter name>.yml`` beside this file.  The logic and
its validation live in the pure functions; here errors become ``AnsibleFilterError`` with
the same message, which names the role variable, the bad value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._filter_errors import filter_errors
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_context import vllm_context
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import VllmTuningError
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    resolve_model,
    vllm_memory_cap,
    vllm_model_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    compose_command,
    vllm_plan,
    vllm_plan_ladder,
    vllm_serve_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    DEFAULT_UTILIZATION_CEILING,
    gpu_memory_utilization,
)

_filter = filter_errors(VllmTuningError)


@_filter
def vllm_gpu_memory_utilization_filter(
    card_memory: object,
    reservations: object,
    driver_headroom: object,
    ceiling: object = DEFAULT_UTILIZATION_CEILING,
    override: object = None,
) -> float:
    return gpu_memory_utilization(card_memory, reservations, driver_headroom, ceiling, override)


@_filter
def vllm_model_entry_filter(
    name: object, catalog: object, extra: object = None
) -> dict[str, object]:
    return resolve_model(name, catalog, extra).as_dict()


@_filter
def vllm_context_filter(
    model: object,
    target: object,
    image: object = None,
    transformers: object = None,
    model_config: object = None,
) -> dict[str, object]:
    return vllm_context(model, target, image, transformers, model_config)


@_filter
def vllm_memory_cap_filter(model: object, cap: object) -> int:
    return vllm_memory_cap(model, cap)


@_filter
def vllm_model_args_filter(model: object, enable_tool_calls: object = True) -> list[str]:
    return vllm_model_args(model, enable_tool_calls)


@_filter
def vllm_plan_filter(settings: object) -> dict[str, object]:
    return vllm_plan(settings)


@_filter
def vllm_plan_ladder_filter(settings: object) -> list[dict[str, object]]:
    return vllm_plan_ladder(settings)


@_filter
def vllm_serve_args_filter(settings: object) -> list[str]:
    return vllm_serve_args(settings)


@_filter
def vllm_compose_command_filter(
    args: object, image: object, mode: object = "auto"
) -> dict[str, object]:
    return compose_command(args, image, mode)


class FilterModule:
    """The vllm role's tuning filters."""

    def filters(self) -> dict[str, Callable[..., object]]:
        return {
            "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization_filter,
            "vllm_model_entry": vllm_model_entry_filter,
            "vllm_context": vllm_context_filter,
            "vllm_memory_cap": vllm_memory_cap_filter,
            "vllm_model_args": vllm_model_args_filter,
            "vllm_plan": vllm_plan_filter,
            "vllm_plan_ladder": vllm_plan_ladder_filter,
            "vllm_serve_args": vllm_serve_args_filter,
            "vllm_compose_command": vllm_compose_command_filter,
        }
