"""The graph settings check (device and streams) and the rerank probe of the retrieval role.

Graphs are the export_model.py renderings in ``tests/fixtures/ovms`` (see its README); the
noise scores are the shape seed 000 describes for an LLM-style reranker pressed into a
cross-encoder slot (every score about 1e-9..1e-12).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.retrieval import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_graph import (
    retrieval_graph_settings_check,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_memory import (
    retrieval_memory_plan,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_ovms import (
    retrieval_rerank_probe,
)

FIXTURES = Path(__file__).resolve().parents[2] / ".." / "fixtures" / "ovms"
RERANK_GPU = (FIXTURES / "rerank-graph.gpu.pbtxt").read_text()
EMBED_GPU = (FIXTURES / "embeddings-graph.gpu.pbtxt").read_text()
# what `ovms --pull` writes without --target_device since 2026.3: no target_device line
RERANK_PULL = (FIXTURES / "rerank-graph.pull.pbtxt").read_text()
EMBED_PULL = (FIXTURES / "embeddings-graph.pull.pbtxt").read_text()


@pytest.mark.parametrize("graph", [RERANK_GPU, EMBED_GPU])
def test_an_export_for_the_gpu_with_one_stream_passes(graph: str) -> None:
    assert retrieval_graph_settings_check(graph, 1, "GPU") == []
    cpu = graph.replace('"GPU"', '"CPU"')
    assert retrieval_graph_settings_check(cpu, 1, "CPU") == []


@pytest.mark.parametrize("graph", [RERANK_PULL, EMBED_PULL])
def test_a_pulled_graph_without_target_device_passes_for_the_cpu(graph: str) -> None:
    assert "target_device" not in graph
    assert retrieval_graph_settings_check(graph, 1, "CPU") == []


@pytest.mark.parametrize("graph", [RERANK_PULL, EMBED_PULL])
def test_a_graph_without_target_device_is_refused_for_the_gpu(graph: str) -> None:
    (problem,) = retrieval_graph_settings_check(graph, 1, "GPU")
    assert "sets no target_device, expected 'GPU'" in problem
    assert "re-export with --target_device GPU" in problem


def test_a_cpu_tree_given_for_the_gpu_is_named() -> None:
    cpu = RERANK_GPU.replace('"GPU"', '"CPU"')
    problems = retrieval_graph_settings_check(cpu, 1, "GPU")
    assert len(problems) == 1
    assert "target_device is 'CPU', expected 'GPU'" in problems[0]
    assert "give the gpu/ tree" in problems[0]


def test_streams_other_than_the_plan_are_named_with_both_fixes() -> None:
    two = EMBED_GPU.replace('"NUM_STREAMS": "1"', '"NUM_STREAMS": "2"')
    (problem,) = retrieval_graph_settings_check(two, 1, "GPU")
    assert "NUM_STREAMS is '2', but retrieval_num_streams is 1" in problem
    assert "--num_streams 1" in problem and "set retrieval_num_streams to 2" in problem
    assert retrieval_graph_settings_check(two, 2, "GPU") == []


def test_absent_streams_and_bad_plugin_config() -> None:
    absent = RERANK_GPU.replace("""plugin_config: '{"NUM_STREAMS": "1" }',""", "")
    (problem,) = retrieval_graph_settings_check(absent, 1, "GPU")
    assert "sets no NUM_STREAMS" in problem
    garbage = RERANK_GPU.replace("""'{"NUM_STREAMS": "1" }'""", "'{NUM_STREAMS'")
    (problem,) = retrieval_graph_settings_check(garbage, 1, "GPU")
    assert "plugin_config is not JSON" in problem


def test_a_graph_without_options_and_one_that_is_not_protobuf() -> None:
    assert (
        "no calculator options block"
        in retrieval_graph_settings_check('node { calculator: "X" }')[0]
    )
    assert "cannot read it as protobuf text" in retrieval_graph_settings_check("node { ")[0]
    with pytest.raises(RetrievalError, match="give 'GPU' or 'CPU'"):
        retrieval_graph_settings_check(RERANK_GPU, 1, "NPU")


def _answer(scores: list[float]) -> dict[str, object]:
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    return {"results": [{"index": i, "relevance_score": scores[i]} for i in ranked]}


def test_a_cross_encoder_passes() -> None:
    assert retrieval_rerank_probe(_answer([0.97, 0.0004, 0.0002, 0.0001]), 0, 4) == []


def test_noise_is_named_as_an_llm_style_reranker() -> None:
    (problem,) = retrieval_rerank_probe(_answer([3e-10, 7e-12, 1e-9, 4e-11]), 0, 4)
    assert "a ranking made of noise" in problem and "LLM-style reranker" in problem


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ([0.2, 0.9, 0.1, 0.1], "the relevant document 0 is not first"),
        ([0.51, 0.5, 0.1, 0.1], "leads by 0.01, less than 0.1"),
    ],
)
def test_a_ranking_that_does_not_separate(scores: list[float], message: str) -> None:
    (problem,) = retrieval_rerank_probe(_answer(scores), 0, 4)
    assert message in problem


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            {"error": "Mediapipe graph definition with requested name is not found"},
            "no results list",
        ),
        ({"results": [{"index": 0}]}, "is not {index, relevance_score}"),
        ({"results": [{"index": 0, "relevance_score": float("nan")}]}, "is not {index"),
        (_answer([0.9, 0.1]), "expected 0..3"),
        ("garbage", "no results list"),
    ],
)
def test_garbage_answers(answer: object, message: str) -> None:
    (problem,) = retrieval_rerank_probe(answer, 0, 4)
    assert message in problem


def test_the_filters_raise_ansible_errors() -> None:
    filters = FilterModule().filters()
    with pytest.raises(AnsibleFilterError, match="the probe sends 2 or more"):
        filters["retrieval_rerank_probe"](_answer([0.9]), 0, 1)
    assert filters["retrieval_graph_settings_check"](RERANK_GPU, 1, "GPU") == []


def test_the_floor_bound_leaves_room_for_one_more_largest_call() -> None:
    plan = retrieval_memory_plan(64, 640, 1, 0.7)
    assert plan["floor_bound_bytes"] + plan["call_bytes"] <= 0.7 * plan["memory_limit_bytes"]
    # with the computed cap the bound is the single call's peak (within a MiB of rounding)
    assert 0 <= plan["floor_bound_bytes"] - plan["single_call_peak_bytes"] < 1024**2
    given = retrieval_memory_plan(64, 640, 1, 0.7, "20g")
    assert given["floor_bound_bytes"] > plan["floor_bound_bytes"]


def test_a_given_watchdog_bound_and_one_below_the_weights() -> None:
    assert retrieval_memory_plan(64, 640, 1, 0.7, None, "3g")["watchdog_bound_bytes"] == 3 * 1024**3
    with pytest.raises(RetrievalError, match="retrieval_watchdog_bound: 1 GiB is at or below"):
        retrieval_memory_plan(64, 640, 1, 0.7, None, "1g")


def test_the_card_reservation_must_hold_the_worst_sequence() -> None:
    from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_memory import (
        retrieval_reservation_check,
    )

    plan = retrieval_memory_plan(32, 512, 1, 0.7)
    need = plan["worst_sequence_peak_bytes"]
    assert isinstance(need, int)
    plex = {"name": "plex-4k-hdr-transcode", "bytes": "2GiB", "count": 2}
    (missing,) = retrieval_reservation_check([plex], plan)
    assert "no entry named retrieval" in missing and "bytes: 4614MiB" in missing
    (small,) = retrieval_reservation_check([plex, {"name": "retrieval", "bytes": "4GiB"}], plan)
    assert "less than the tier can hold" in small
    assert retrieval_reservation_check([plex, {"name": "retrieval", "bytes": need}], plan) == []
    assert retrieval_reservation_check([{"name": "retrieval", "bytes": "4614MiB"}], plan) == []
