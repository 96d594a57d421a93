# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters for the ``retrieval`` role: thin shells over ``plugin_utils._retrieval_*``.

Each filter is documented in its own ``<filter name>.yml`` beside this file.  The cost model,
the guards and their validation live in the pure functions; here their errors become
``AnsibleFilterError`` with the same message, which names the role variable, the bad value
and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._filter_errors import filter_errors
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_graph import (
    retrieval_graph_guards,
    retrieval_graph_guards_check,
    retrieval_graph_settings_check,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    DEFAULT_HEADROOM,
    DEFAULT_MAX_ALLOWED_CHUNKS,
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    DEFAULT_NUM_STREAMS,
    RetrievalError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_k8s import (
    claim_problems,
    k8s_manifests,
    k8s_pod_verdict,
    k8s_reply_states,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_memory import (
    retrieval_memory_plan,
    retrieval_reservation_check,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_ovms import (
    MODELS_MOUNT,
    retrieval_rerank_probe,
    retrieval_servable_states,
    retrieval_servables,
    retrieval_server_errors,
)

_filter = filter_errors(RetrievalError)


@_filter
def retrieval_memory_plan_filter(
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
    num_streams: object = DEFAULT_NUM_STREAMS,
    headroom: object = DEFAULT_HEADROOM,
    memory_limit: object = None,
    watchdog_bound: object = None,
) -> dict[str, object]:
    return retrieval_memory_plan(
        max_allowed_chunks,
        max_position_embeddings,
        num_streams,
        headroom,
        memory_limit,
        watchdog_bound,
    )


@_filter
def retrieval_graph_guards_filter(
    text: object,
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> str:
    return retrieval_graph_guards(text, max_allowed_chunks, max_position_embeddings)


@_filter
def retrieval_graph_guards_check_filter(
    text: object,
    max_allowed_chunks: object = DEFAULT_MAX_ALLOWED_CHUNKS,
    max_position_embeddings: object = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> list[str]:
    return retrieval_graph_guards_check(text, max_allowed_chunks, max_position_embeddings)


@_filter
def retrieval_graph_settings_check_filter(
    text: object, num_streams: object = DEFAULT_NUM_STREAMS, target_device: object = "GPU"
) -> list[str]:
    return retrieval_graph_settings_check(text, num_streams, target_device)


@_filter
def retrieval_rerank_probe_filter(
    response: object, relevant_index: object = 0, documents: object = None
) -> list[str]:
    return retrieval_rerank_probe(response, relevant_index, documents)


@_filter
def retrieval_reservation_check_filter(reservations: object, plan: object = None) -> list[str]:
    return retrieval_reservation_check(reservations, plan)


@_filter
def retrieval_k8s_manifests_filter(params: object) -> dict[str, list[dict[str, object]]]:
    if not isinstance(params, dict):
        raise RetrievalError(
            f"retrieval_k8s_manifests takes a mapping of parameters, not {params!r}"
        )
    return k8s_manifests(params)


@_filter
def retrieval_k8s_claim_check_filter(
    request: object, variable: object = "retrieval_k8s_claim_request"
) -> list[str]:
    return claim_problems(request, str(variable))


@_filter
def retrieval_servables_filter(
    config: object, path: object = "config.json", mount: object = MODELS_MOUNT
) -> dict[str, dict[str, object]]:
    return retrieval_servables(config, str(path), str(mount))


@_filter
def retrieval_servable_states_filter(
    answer: object, models: object = None, pins: object = None
) -> dict[str, object]:
    return retrieval_servable_states(answer, models, pins)


@_filter
def retrieval_k8s_pod_verdict_filter(pods: object, container: object = "ovms") -> dict[str, object]:
    return k8s_pod_verdict(pods, str(container))


@_filter
def retrieval_k8s_reply_states_filter(reply: object, models: object = None) -> dict[str, object]:
    return k8s_reply_states(reply, models)


@_filter
def retrieval_server_errors_filter(log: object, limit: object = 8) -> list[str]:
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise RetrievalError(f"limit: expected a whole number of lines, got {limit!r}")
    return retrieval_server_errors(log, limit)


class FilterModule:
    """The retrieval role's filters: the memory cap, the graphs' guards and settings, the
    server's config and states, the Kubernetes manifests."""

    def filters(self) -> dict[str, Callable[..., object]]:
        return {
            "retrieval_memory_plan": retrieval_memory_plan_filter,
            "retrieval_graph_guards": retrieval_graph_guards_filter,
            "retrieval_graph_guards_check": retrieval_graph_guards_check_filter,
            "retrieval_graph_settings_check": retrieval_graph_settings_check_filter,
            "retrieval_rerank_probe": retrieval_rerank_probe_filter,
            "retrieval_reservation_check": retrieval_reservation_check_filter,
            "retrieval_k8s_manifests": retrieval_k8s_manifests_filter,
            "retrieval_k8s_claim_check": retrieval_k8s_claim_check_filter,
            "retrieval_servables": retrieval_servables_filter,
            "retrieval_servable_states": retrieval_servable_states_filter,
            "retrieval_server_errors": retrieval_server_errors_filter,
            "retrieval_k8s_pod_verdict": retrieval_k8s_pod_verdict_filter,
            "retrieval_k8s_reply_states": retrieval_k8s_reply_states_filter,
        }
