"""The OVMS server's config (both servable lists) and states (the served version) as the
retrieval role reads them, on answers in the real server's layout (``tests/fixtures/ovms``,
see its README)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
    RetrievalTypeError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_ovms import (
    retrieval_servable_states,
    retrieval_servables,
    retrieval_server_errors,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "ovms"
MODELS = ["bge-m3", "bge-reranker-v2-m3"]


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- config.json


def test_the_model_config_list_of_export_model_py() -> None:
    found = retrieval_servables(_fixture("config.json"))
    assert found == {
        "bge-m3": {
            "name": "bge-m3",
            "base_path": "bge-m3",
            "graph_path": "bge-m3/graph.pbtxt",
            "list": "model_config_list",
            "versions": None,
        },
        "bge-reranker-v2-m3": {
            "name": "bge-reranker-v2-m3",
            "base_path": "bge-reranker-v2-m3",
            "graph_path": "bge-reranker-v2-m3/graph.pbtxt",
            "list": "model_config_list",
            "versions": None,
        },
    }


def test_a_config_with_only_a_mediapipe_list_serves_both() -> None:
    found = retrieval_servables(_fixture("config.mediapipe.json"))
    assert sorted(found) == MODELS
    assert {f["list"] for f in found.values()} == {"mediapipe_config_list"}
    assert found["bge-reranker-v2-m3"]["graph_path"] == "bge-reranker-v2-m3/graph.pbtxt"


@pytest.mark.parametrize(
    ("entry", "base", "graph"),
    [
        ({"name": "m"}, "m", "m/graph.pbtxt"),
        ({"name": "m", "base_path": ""}, "m", "m/graph.pbtxt"),
        ({"name": "m", "base_path": "models/m/"}, "models/m", "models/m/graph.pbtxt"),
        ({"name": "m", "base_path": "x", "graph_path": "g/rerank.pbtxt"}, "x", "x/g/rerank.pbtxt"),
        ({"name": "m", "base_path": "/models/x"}, "x", "x/graph.pbtxt"),
        ({"name": "m", "base_path": "x", "graph_path": "/models/y.pbtxt"}, "x", "y.pbtxt"),
        ({"name": "m", "base_path": "."}, "", "graph.pbtxt"),
    ],
)
def test_paths_resolve_as_the_server_resolves_them(
    entry: dict[str, str], base: str, graph: str
) -> None:
    for document in (
        {"model_config_list": [], "mediapipe_config_list": [entry]},
        {"model_config_list": [{"config": entry}]},
    ):
        (found,) = retrieval_servables(document).values()
        assert (found["base_path"], found["graph_path"]) == (base, graph)


def test_a_version_policy_that_pins() -> None:
    document = {
        "model_config_list": [
            {"config": {"name": "m", "model_version_policy": {"specific": {"versions": [3, 1]}}}},
            {"config": {"name": "n", "model_version_policy": {"latest": {"num_versions": 2}}}},
        ]
    }
    found = retrieval_servables(document)
    assert found["m"]["versions"] == [1, 3]
    assert found["n"]["versions"] is None


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("{", "config.json is not JSON"),
        (
            {"mediapipe_config_list": [{"name": "m"}]},
            "config.json has no model_config_list list (None): OVMS's schema requires it",
        ),
        (
            {"model_config_list": [], "mediapipe_config_list": [{"name": "m", "nireq": 2}]},
            "mediapipe_config_list[0] has nireq, which the schema does not allow there",
        ),
        ({"model_config_list": [{"name": "m"}]}, "model_config_list[0] is {'name': 'm'}"),
        (
            {"model_config_list": [{"config": {"base_path": "m"}}]},
            "model_config_list[0].config.name is None",
        ),
        (
            {
                "model_config_list": [{"config": {"name": "m"}}],
                "mediapipe_config_list": [{"name": "m"}],
            },
            "config.json names 'm' twice (config.json: mediapipe_config_list[0] and "
            "config.json: model_config_list[0])",
        ),
        (
            {"model_config_list": [{"config": {"name": "m", "base_path": "../m"}}]},
            "base_path is '../m', which leaves the exported tree",
        ),
        (
            {"model_config_list": [{"config": {"name": "m", "base_path": "/srv/m"}}]},
            "base_path is '/srv/m', outside /models",
        ),
        (
            {"model_config_list": [{"config": {"name": "m", "base_path": "s3://b/m"}}]},
            "base_path is 's3://b/m', a remote location",
        ),
    ],
)
def test_what_the_server_or_the_role_refuses_is_named(document: Any, message: str) -> None:
    with pytest.raises(RetrievalError) as caught:
        retrieval_servables(document)
    assert message in str(caught.value)


def test_not_an_object() -> None:
    with pytest.raises(RetrievalTypeError, match="expected a JSON object, got list"):
        retrieval_servables([])


# --------------------------------------------------------------------------- /v1/config


def test_the_two_version_answer_is_served_by_its_highest_available_version() -> None:
    states = retrieval_servable_states(_fixture("v1-config.two-versions.json"), MODELS)
    assert states["available"] == MODELS
    assert states["unavailable"] == [] and states["failed"] == []
    assert states["servables"]["bge-m3"]["served_version"] == 2
    assert states["servables"]["bge-m3"]["text"] == (
        "bge-m3: serves version 2 (the highest AVAILABLE); version 1 END (OK)"
    )


def test_the_loaded_answer() -> None:
    states = retrieval_servable_states(json.loads(_fixture("v1-config.available.json")), MODELS)
    assert states["available"] == MODELS
    assert states["text"] == (
        "bge-m3: serves version 1 (the highest AVAILABLE); "
        "bge-reranker-v2-m3: serves version 1 (the highest AVAILABLE)"
    )


def test_a_refused_graph_is_failed_for_good() -> None:
    states = retrieval_servable_states(_fixture("v1-config.rerank-failed.json"), MODELS)
    assert states["available"] == ["bge-m3"]
    assert states["failed"] == ["bge-reranker-v2-m3"]
    assert states["servables"]["bge-reranker-v2-m3"]["text"] == (
        "bge-reranker-v2-m3: no version AVAILABLE; version 1 LOADING (FAILED_PRECONDITION)"
    )


def _answer(*versions: tuple[int, str, str]) -> dict[str, Any]:
    return {
        "m": {
            "model_version_status": [
                {
                    "version": str(v),
                    "state": state,
                    "status": {"error_code": code, "error_message": code},
                }
                for v, state, code in versions
            ]
        }
    }


@pytest.mark.parametrize(
    ("versions", "pins", "served", "failed"),
    [
        # the default version: the highest AVAILABLE, whatever the list's order
        ([(2, "AVAILABLE", "OK"), (1, "AVAILABLE", "OK")], None, 2, False),
        ([(1, "AVAILABLE", "OK"), (2, "LOADING", "UNKNOWN")], None, 1, False),
        # still loading: waiting can help
        ([(1, "START", "OK")], None, None, False),
        ([(1, "LOADING", "OK")], None, None, False),
        # settled: refused, or every version gone
        ([(1, "LOADING", "FAILED_PRECONDITION")], None, None, True),
        ([(1, "END", "OK"), (2, "UNLOADING", "OK")], None, None, True),
        # the pinned version decides
        ([(1, "AVAILABLE", "OK"), (2, "LOADING", "OK")], [2], None, False),
        ([(1, "AVAILABLE", "OK"), (2, "AVAILABLE", "OK")], [1], 1, False),
        ([(1, "AVAILABLE", "OK")], [3], None, False),
    ],
)
def test_the_served_version_and_whether_waiting_helps(
    versions: list[tuple[int, str, str]], pins: list[int] | None, served: int | None, failed: bool
) -> None:
    states = retrieval_servable_states(_answer(*versions), ["m"], {"m": pins} if pins else None)
    assert states["servables"]["m"]["served_version"] == served
    assert (states["failed"] == ["m"]) is failed
    if pins and served:
        assert f"the highest AVAILABLE of the pinned {pins}" in states["text"]


def test_pins_from_the_servables_of_the_config() -> None:
    servables = retrieval_servables(
        {
            "model_config_list": [
                {"config": {"name": "m", "model_version_policy": {"specific": {"versions": [1]}}}}
            ]
        }
    )
    answer = _answer((1, "AVAILABLE", "OK"), (2, "AVAILABLE", "OK"))
    assert (
        retrieval_servable_states(answer, ["m"], servables)["servables"]["m"]["served_version"] == 1
    )
    assert retrieval_servable_states(answer, ["m"])["servables"]["m"]["served_version"] == 2


def test_a_servable_the_server_does_not_know() -> None:
    states = retrieval_servable_states({"other": {"model_version_status": []}}, ["m"])
    assert states["failed"] == ["m"]
    assert "m: not in /v1/config" in states["text"]


@pytest.mark.parametrize(
    ("answer", "models", "error", "message"),
    [
        ("<html>", ["m"], RetrievalError, "/v1/config answered what is not JSON"),
        ("[1]", ["m"], RetrievalError, "/v1/config answered '[1]', not an object"),
        ({}, "m", RetrievalTypeError, "models: expected a list of servable names"),
    ],
)
def test_garbage(answer: Any, models: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        retrieval_servable_states(answer, models)


# --------------------------------------------------------------------------- the log


def test_the_servers_reasons_in_its_log() -> None:
    """Lines in the shape of OVMS's spdlog output (the stand-in prints the same shape)."""
    log = "\n".join(
        [
            "SIMULATION: cardshare lab stand-in for OpenVINO Model Server (no model runs here)",
            "[2026-12-04 05:01:02.101][1][serving][info] OpenVINO Model Server 2026.2.1",
            "[2026-12-04 05:01:40.310][1][modelmanager][error] Mediapipe: bge-reranker-v2-m3 "
            "validation failed: Either openvino_tokenizer.xml was not provided or it was not "
            "loaded correctly",
            "[2026-12-04 05:01:40.311][1][modelmanager][info] Mediapipe: bge-reranker-v2-m3 "
            "state changed to: LOADING_PRECONDITION_FAILED",
            "[2026-12-04 05:01:41.000][1][serving][critical] Failed to start REST server",
        ]
    )
    assert retrieval_server_errors(log) == [
        "modelmanager: Mediapipe: bge-reranker-v2-m3 validation failed: Either "
        "openvino_tokenizer.xml was not provided or it was not loaded correctly",
        "serving: Failed to start REST server",
    ]
    assert retrieval_server_errors(log, 1) == ["serving: Failed to start REST server"]
    assert retrieval_server_errors("") == []
    with pytest.raises(RetrievalTypeError, match="expected the server's log text"):
        retrieval_server_errors(None)
