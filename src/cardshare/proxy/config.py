"""Settings of the proxy: a JSON file (templated by the ``arbiter`` role) and CLI flags.

The file is one JSON object whose keys are the field names of :class:`ProxyConfig`; a flag
given on the command line beats the file. Unknown keys and bad values are refused with a
message naming the key, the value and what is expected.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cardshare.proxy.keys import is_loopback


@dataclass(frozen=True)
class ProxyConfig:
    """Every setting of the proxy, with its default."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    #: vLLM's base URL (no path: requests keep their own path).
    upstream_url: str = "http://127.0.0.1:8000"
    #: The arbiter's base URL; the proxy polls ``/v1/mode`` (or ``/v1/status``) there.
    arbiter_url: str = "http://127.0.0.1:8090"
    #: How many requests may be held at once; the next one gets a 503 at once.
    hold_max_requests: int = 64
    #: How long a request may wait (held, then retrying a refused connection) before a 503.
    hold_max_seconds: float = 600.0
    #: How long refused connections are retried while vLLM starts.
    connect_retry_seconds: float = 120.0
    #: The ``Retry-After`` of the proxy's own 503 answers.
    retry_after_seconds: int = 30
    #: How often the arbiter's mode is polled.
    mode_poll_seconds: float = 1.0
    #: Keep the last known mode while the arbiter is down (off: assume ``llm``).
    trust_mode_when_arbiter_down: bool = True
    #: Largest request body accepted (413 beyond).
    max_body_bytes: int = 8 * 1024 * 1024
    #: Upstream connection pool size.
    pool_limit: int = 256
    #: Paths forwarded (and held); other paths that are not the proxy's own get a 404.
    proxied_path_prefixes: tuple[str, ...] = ("/v1/",)
    #: A new client connection that has not sent a complete request head by then is closed.
    header_timeout_seconds: float = 10.0
    #: A request body must arrive within this time once the proxy reads it (408 otherwise);
    #: the clock does not run while the request is held.
    body_timeout_seconds: float = 30.0
    #: An idle kept-alive client connection is closed after this time.
    keepalive_timeout_seconds: float = 75.0
    #: The file of hashed API keys (:mod:`cardshare.proxy.keys`); "" lets every request in,
    #: which only a loopback ``listen_host`` allows.
    keys_file: str = ""
    #: How often the key file's stat is polled for a change.
    keys_reload_seconds: float = 1.0
    #: Requests one key may have held and in flight at once (429 beyond); a key's line may
    #: set its own with ``max_requests=N``.
    key_max_requests: int = 16
    #: A file whose first line is the upstream's own key (vLLM's ``--api-key``), sent as
    #: ``Authorization: Bearer``; "" sends none. The agents' keys never go upstream.
    upstream_api_key_file: str = ""


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range."""


_POSITIVE = {
    "hold_max_seconds",
    "mode_poll_seconds",
    "pool_limit",
    "max_body_bytes",
    "keys_reload_seconds",
    "key_max_requests",
}
#: Paths that may be "" (not set).
_OPTIONAL_PATHS = {"keys_file", "upstream_api_key_file"}
_NON_NEGATIVE = {"hold_max_requests", "connect_retry_seconds", "retry_after_seconds"}
#: Read timeouts of the client side (cardshare.serverguard): finite and > 0.
_TIMEOUTS = {"header_timeout_seconds", "body_timeout_seconds", "keepalive_timeout_seconds"}


def _check_type(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, str) and v.startswith("/") for v in value
        ):
            raise ConfigError(f"{key} must be a list of paths starting with '/', got {value!r}")
        return tuple(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def build_config(settings: Mapping[str, Any]) -> ProxyConfig:
    """A validated :class:`ProxyConfig` from ``settings`` (missing keys take their default)."""
    defaults = ProxyConfig()
    known = [f.name for f in fields(ProxyConfig)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
    values: dict[str, Any] = {}
    for key, value in settings.items():
        if key in _OPTIONAL_PATHS and value == "":
            values[key] = value
            continue
        checked = _check_type(key, value, getattr(defaults, key))
        if key in _POSITIVE and checked <= 0:
            raise ConfigError(f"{key} must be > 0, got {value!r}")
        if key in _NON_NEGATIVE and checked < 0:
            raise ConfigError(f"{key} must be >= 0, got {value!r}")
        if key in _TIMEOUTS and not (math.isfinite(checked) and checked > 0):
            raise ConfigError(f"{key} must be a finite number of seconds > 0, got {value!r}")
        values[key] = checked
    config = ProxyConfig(**values)
    if not 0 < config.listen_port < 65536:
        raise ConfigError(f"listen_port must be within 1..65535, got {config.listen_port}")
    for key in ("upstream_url", "arbiter_url"):
        url = getattr(config, key)
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{key} must start with http:// or https://, got {url!r}")
    if not config.keys_file and not is_loopback(config.listen_host):
        raise ConfigError(
            f"listen_host {config.listen_host!r} is reachable beyond this machine and keys_file "
            "is not set: anyone on the network could use the card; set keys_file to a file of "
            "hashed API keys (cardshare proxy key add NAME --file FILE) or listen on 127.0.0.1"
        )
    return config


def parse_config_text(text: str, source: str) -> dict[str, Any]:
    """The settings object of a JSON config file's text."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    return doc


def argument_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m cardshare.proxy``; flags override the config file."""
    parser = argparse.ArgumentParser(
        prog="python -m cardshare.proxy",
        description="The patient proxy in front of vLLM's OpenAI API.",
    )
    parser.add_argument("--config", type=Path, help="JSON settings file")
    parser.add_argument("--listen-host", dest="listen_host")
    parser.add_argument("--listen-port", dest="listen_port", type=int)
    parser.add_argument("--upstream-url", dest="upstream_url", help="vLLM base URL")
    parser.add_argument("--arbiter-url", dest="arbiter_url", help="arbiter base URL")
    parser.add_argument("--hold-max-requests", dest="hold_max_requests", type=int)
    parser.add_argument("--hold-max-seconds", dest="hold_max_seconds", type=float)
    parser.add_argument("--connect-retry-seconds", dest="connect_retry_seconds", type=float)
    parser.add_argument("--retry-after-seconds", dest="retry_after_seconds", type=int)
    parser.add_argument("--mode-poll-seconds", dest="mode_poll_seconds", type=float)
    parser.add_argument(
        "--trust-mode-when-arbiter-down",
        dest="trust_mode_when_arbiter_down",
        action=argparse.BooleanOptionalAction,
        default=None,
    )
    parser.add_argument("--max-body-bytes", dest="max_body_bytes", type=int)
    parser.add_argument("--pool-limit", dest="pool_limit", type=int)
    parser.add_argument(
        "--proxied-path-prefix",
        dest="proxied_path_prefixes",
        action="append",
        help="path prefix to forward (repeatable; replaces the default /v1/)",
    )
    parser.add_argument("--header-timeout-seconds", dest="header_timeout_seconds", type=float)
    parser.add_argument("--body-timeout-seconds", dest="body_timeout_seconds", type=float)
    parser.add_argument("--keepalive-timeout-seconds", dest="keepalive_timeout_seconds", type=float)
    parser.add_argument("--keys-file", dest="keys_file", help="file of hashed API keys")
    parser.add_argument("--keys-reload-seconds", dest="keys_reload_seconds", type=float)
    parser.add_argument("--key-max-requests", dest="key_max_requests", type=int)
    parser.add_argument(
        "--upstream-api-key-file", dest="upstream_api_key_file", help="file of vLLM's own key"
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--check", action="store_true", help="check the config and the flags, then exit"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[ProxyConfig, str]:
    """``(config, log level)`` from the parsed command line (and the file it names)."""
    settings: dict[str, Any] = {}
    if args.config is not None:
        try:
            text = args.config.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{args.config}: cannot read: {exc.strerror}") from exc
        settings.update(parse_config_text(text, str(args.config)))
    for f in fields(ProxyConfig):
        value = getattr(args, f.name)
        if value is not None:
            settings[f.name] = value
    return build_config(settings), str(args.log_level)
