"""Settings from the JSON file and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cardshare.proxy.__main__ import main
from cardshare.proxy.config import (
    ConfigError,
    ProxyConfig,
    argument_parser,
    build_config,
    config_from_args,
    parse_config_text,
)


def test_defaults() -> None:
    config = build_config({})
    assert config == ProxyConfig()
    assert (
        config.listen_host,
        config.listen_port,
        config.upstream_url,
        config.arbiter_url,
        config.hold_max_requests,
        config.hold_max_seconds,
        config.connect_retry_seconds,
        config.mode_poll_seconds,
        config.trust_mode_when_arbiter_down,
    ) == (
        "127.0.0.1",
        8080,
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8090",
        64,
        600.0,
        120.0,
        1.0,
        True,
    )


@pytest.mark.parametrize(
    ("settings", "field", "value"),
    [
        ({"hold_max_seconds": 30}, "hold_max_seconds", 30.0),
        ({"hold_max_requests": 0}, "hold_max_requests", 0),
        (
            {"proxied_path_prefixes": ["/v1/", "/tokenize"]},
            "proxied_path_prefixes",
            ("/v1/", "/tokenize"),
        ),
        ({"trust_mode_when_arbiter_down": False}, "trust_mode_when_arbiter_down", False),
        ({"header_timeout_seconds": 2}, "header_timeout_seconds", 2.0),
        ({"body_timeout_seconds": 0.5}, "body_timeout_seconds", 0.5),
        ({"keepalive_timeout_seconds": 300}, "keepalive_timeout_seconds", 300.0),
    ],
)
def test_build_config(settings: dict[str, Any], field: str, value: object) -> None:
    assert getattr(build_config(settings), field) == value


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hold_max": 1}, "unknown setting(s) hold_max; known: "),
        ({"hold_max_requests": "64"}, "hold_max_requests must be an integer, got '64'"),
        ({"hold_max_requests": True}, "hold_max_requests must be an integer, got True"),
        ({"hold_max_requests": -1}, "hold_max_requests must be >= 0, got -1"),
        ({"hold_max_seconds": 0}, "hold_max_seconds must be > 0, got 0"),
        ({"mode_poll_seconds": "1s"}, "mode_poll_seconds must be a number, got '1s'"),
        (
            {"trust_mode_when_arbiter_down": "yes"},
            "trust_mode_when_arbiter_down must be true or false, got 'yes'",
        ),
        ({"listen_port": 70000}, "listen_port must be within 1..65535, got 70000"),
        (
            {"upstream_url": "127.0.0.1:8000"},
            "upstream_url must start with http:// or https://, got '127.0.0.1:8000'",
        ),
        ({"upstream_url": "http://"}, "upstream_url has no host, got 'http://'"),
        (
            {"arbiter_url": "http://127.0.0.1:80900"},
            "arbiter_url is not a URL (Port out of range 0-65535), got 'http://127.0.0.1:80900'",
        ),
        ({"arbiter_url": ""}, "arbiter_url must be a non-empty string, got ''"),
        (
            {"proxied_path_prefixes": "/v1/"},
            "proxied_path_prefixes must be a list of paths starting with '/', got '/v1/'",
        ),
        (
            {"header_timeout_seconds": 0},
            "header_timeout_seconds must be a finite number of seconds > 0, got 0",
        ),
        (
            {"body_timeout_seconds": -30},
            "body_timeout_seconds must be a finite number of seconds > 0, got -30",
        ),
        (
            {"keepalive_timeout_seconds": float("inf")},
            "keepalive_timeout_seconds must be a finite number of seconds > 0, got inf",
        ),
        ({"body_timeout_seconds": "30s"}, "body_timeout_seconds must be a number, got '30s'"),
    ],
)
def test_build_config_refuses(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(settings)
    assert str(err.value).startswith(message)
    if not message.endswith(": "):
        assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "proxy.json: expected a JSON object, got list"),
        (
            "{",
            "proxy.json: not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
    ],
)
def test_parse_config_text_refuses(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, "proxy.json")
    assert str(err.value) == message


def test_read_timeout_defaults() -> None:
    config = build_config({})
    assert (
        config.header_timeout_seconds,
        config.body_timeout_seconds,
        config.keepalive_timeout_seconds,
    ) == (10.0, 30.0, 75.0)


def test_read_timeouts_from_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"header_timeout_seconds": 4, "body_timeout_seconds": 20}))
    config, _ = config_from_args(
        argument_parser().parse_args(
            [
                "--config",
                str(path),
                "--body-timeout-seconds",
                "12.5",
                "--keepalive-timeout-seconds",
                "9",
            ]
        )
    )
    assert (
        config.header_timeout_seconds,
        config.body_timeout_seconds,
        config.keepalive_timeout_seconds,
    ) == (4.0, 12.5, 9.0)


def test_main_reports_a_bad_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "proxy.json"
    path.write_text('{"header_timeout_seconds": Infinity}')
    assert main(["--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        "cardshare.proxy: header_timeout_seconds must be a finite number of seconds > 0, got inf\n"
    )


def test_check_validates_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--check (what the arbiter role runs in the image before it touches the project)."""
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"listen_port": 9000}))
    assert main(["--config", str(path), "--check"]) == 0
    assert capsys.readouterr().out == "cardshare.proxy: the settings are valid\n"
    path.write_text(json.dumps({"listen_port": 9000, "hold_max_request": 8}))
    assert main(["--config", str(path), "--check"]) == 2
    assert capsys.readouterr().err.startswith(
        "cardshare.proxy: unknown setting(s) hold_max_request;"
    )


def test_flags_beat_the_file(tmp_path: Path) -> None:
    path = tmp_path / "proxy.json"
    path.write_text(
        json.dumps({"listen_port": 9000, "hold_max_requests": 8, "hold_max_seconds": 60})
    )
    config, level = config_from_args(
        argument_parser().parse_args(
            [
                "--config",
                str(path),
                "--listen-port",
                "9100",
                "--no-trust-mode-when-arbiter-down",
                "--log-level",
                "debug",
            ]
        )
    )
    assert (config.listen_port, config.hold_max_requests, config.hold_max_seconds) == (
        9100,
        8,
        60.0,
    )
    assert (config.trust_mode_when_arbiter_down, level) == (False, "debug")


def test_main_reports_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "proxy.json"
    path.write_text('{"hold_max_requests": -3}')
    assert main(["--config", str(path)]) == 2
    assert capsys.readouterr().err == "cardshare.proxy: hold_max_requests must be >= 0, got -3\n"
