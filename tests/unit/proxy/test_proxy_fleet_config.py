"""A fleet's ``boxes`` setting (issue 33): the format, its defaults and its refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cardshare.proxy.__main__ import main
from cardshare.proxy.config import Box, ConfigError, build_config


def box(name: str = "a", host: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "upstream_url": f"http://gpu{host}:8000",
        "arbiter_url": f"http://gpu{host}:8090",
        "models": ["qwen3-8b"],
        **extra,
    }


def test_no_boxes_is_the_single_box_of_the_urls() -> None:
    config = build_config({"upstream_api_key_file": "/etc/k"})
    assert config.boxes == ()
    assert config.fleet() == (
        Box("default", "http://127.0.0.1:8000", "http://127.0.0.1:8090", (), 1, "/etc/k"),
    )


def test_boxes_with_defaults_and_overrides() -> None:
    config = build_config(
        {
            "upstream_api_key_file": "/etc/global-key",
            "boxes": [
                box("a", 1),
                box("b", 2, models=["m1", "m2"], weight=3, api_key_file="/etc/b-key"),
                box("c", 3, api_key_file=""),
            ],
        }
    )
    assert config.fleet() == config.boxes
    assert config.boxes == (
        Box(
            "a", "http://gpu1:8000", "http://gpu1:8090", ("qwen3-8b",), 1,
            "/etc/global-key",
        ),
        Box("b", "http://gpu2:8000", "http://gpu2:8090", ("m1", "m2"), 3, "/etc/b-key"),
        Box("c", "http://gpu3:8000", "http://gpu3:8090", ("qwen3-8b",), 1, ""),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"boxes": [box("a", 1), box("a", 2)]},
            "boxes[1].name 'a' is also boxes[0]'s; give each box its own name",
        ),
        (
            {"boxes": [box("a", 1), box("b", 1)]},
            "boxes[1].upstream_url 'http://gpu1:8000' is also boxes[0]'s; list each vLLM "
            "once (one box per upstream)",
        ),
        (
            {
                "boxes": [
                    box("a", 1),
                    {**box("b", 2), "upstream_url": "http://gpu1:8000/"},
                ]
            },
            "boxes[1].upstream_url 'http://gpu1:8000/' is also boxes[0]'s; list each vLLM "
            "once (one box per upstream)",
        ),
        (
            {"boxes": [box("a", models=[])]},
            "boxes[0].models is empty: box 'a' would never be sent a request; list the models "
            "its vLLM serves (its --served-model-name)",
        ),
        (
            {"boxes": [box("a", upstream_url="gpu5:8000")]},
            "boxes[0].upstream_url must start with http:// or https://, got 'gpu5:8000'; "
            "give the base URL like http://HOST:PORT",
        ),
        (
            {"boxes": [box("a", arbiter_url="http://:8090")]},
            "boxes[0].arbiter_url has no host, got 'http://:8090'; give the base URL like "
            "http://HOST:PORT",
        ),
        (
            {"boxes": [box("a")], "upstream_url": "http://127.0.0.1:8000"},
            "upstream_url given with boxes ('http://127.0.0.1:8000'): with boxes each box names "
            "its own; remove upstream_url or put that box in boxes",
        ),
        (
            {"boxes": [box("a")], "arbiter_url": "http://x:1", "upstream_url": "http://y:2"},
            "upstream_url and arbiter_url given with boxes ('http://y:2', 'http://x:1'): with "
            "boxes each box names its own; remove upstream_url and arbiter_url or put that box "
            "in boxes",
        ),
        (
            {"boxes": [box("a", weight=0)]},
            "boxes[0].weight must be an integer >= 1, got 0",
        ),
        (
            {"boxes": [box("a", weight=True)]},
            "boxes[0].weight must be an integer >= 1, got True",
        ),
        (
            {"boxes": [box("a", models="qwen3-8b")]},
            "boxes[0].models must be a list of model names (the requests' 'model'), got 'qwen3-8b'",
        ),
        (
            {"boxes": [box("a", models=["m", "m"])]},
            "boxes[0].models lists a model twice, got ['m', 'm']",
        ),
        (
            {"boxes": [box("a", url="x")]},
            "boxes[0] has unknown key(s) url; known: name, upstream_url, arbiter_url, models, "
            "weight, api_key_file",
        ),
        (
            {"boxes": [{"name": "a", "models": ["m"]}]},
            'boxes[0] lacks upstream_url, arbiter_url; a box is like {"name": "box-a", '
            '"upstream_url": "http://HOST:8000", "arbiter_url": "http://HOST:8090", '
            '"models": ["MODEL"]}',
        ),
        (
            {"boxes": [box(" a")]},
            "boxes[0].name must be a non-empty name without surrounding spaces, got ' a'",
        ),
        ({"boxes": "a"}, "boxes must be a list of box objects, got 'a'"),
        (
            {"boxes": [box("a", api_key_file=None)]},
            'boxes[0].api_key_file must be a path (or "" for no key), got None',
        ),
    ],
)
def test_boxes_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(settings)
    assert str(err.value) == message


def test_check_refuses_a_box_listed_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"boxes": [box("a", 1), box("a", 2)]}))
    assert main(["--config", str(path), "--check"]) == 2
    assert capsys.readouterr().err == (
        "cardshare.proxy: boxes[1].name 'a' is also boxes[0]'s; give each box its own name\n"
    )
    path.write_text(json.dumps({"boxes": [box("a", 1), box("b", 2)]}))
    assert main(["--config", str(path), "--check"]) == 0


def test_empty_boxes_keeps_the_urls() -> None:
    config = build_config({"boxes": [], "upstream_url": "http://h:1"})
    assert (config.boxes, config.fleet()[0].upstream_url) == ((), "http://h:1")
