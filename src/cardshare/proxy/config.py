"""Settings of the proxy: a JSON file (templated by the ``arbiter`` role) and CLI flags.

The file is one JSON object whose keys are the field names of :class:`ProxyConfig`; a flag
given on the command line beats the file. Unknown keys and bad values are refused with a
message naming the key, the value and what is expected.

``boxes`` lists the boxes of a fleet (issue 33), each an object::

    {"name": "box-a", "upstream_url": "http://gpu5:8000",
     "arbiter_url": "http://gpu5:8090", "models": ["qwen3-8b"],
     "weight": 1, "api_key_file": "/etc/cardshare/vllm-key-a"}

``weight`` (an integer >= 1, default 1) and ``api_key_file`` (default the global
``upstream_api_key_file``) may be left out. An empty list (the default) is the single box of
``upstream_url`` and ``arbiter_url``, serving any model; with ``boxes`` set those two are refused.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cardshare.proxy.keys import is_loopback


@dataclass(frozen=True)
class Box:
    """One box of a fleet: its vLLM, its arbiter, the models it serves."""

    name: str
    upstream_url: str
    arbiter_url: str
    #: The models the box serves (the ``model`` of a request's JSON body); empty: any model
    #: (only the single box of a configuration without ``boxes``).
    models: tuple[str, ...] = ()
    #: Its share of the requests against the other boxes' (least outstanding, weighted).
    weight: int = 1
    #: The file of its vLLM's own key ("" sends none).
    api_key_file: str = ""


#: The keys of a box object, and whether each must be given.
BOX_KEYS = {
    "name": True,
    "upstream_url": True,
    "arbiter_url": True,
    "models": True,
    "weight": False,
    "api_key_file": False,
}


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
    #: The boxes of a fleet (:class:`Box`); empty: the one box of ``upstream_url`` and
    #: ``arbiter_url``, serving any model.
    boxes: tuple[Box, ...] = ()

    def fleet(self) -> tuple[Box, ...]:
        """The boxes the proxy routes to: ``boxes``, or the single box of the URLs."""
        if self.boxes:
            return self.boxes
        return (
            Box(
                name="default",
                upstream_url=self.upstream_url,
                arbiter_url=self.arbiter_url,
                api_key_file=self.upstream_api_key_file,
            ),
        )


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


def _url_problem(url: str) -> str | None:
    """Why ``url`` is not a usable base URL, None when it is."""
    if not url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if not host:
        return "has no host"
    return None


def _check_box(n: int, doc: Any, global_key_file: str) -> Box:
    where = f"boxes[{n}]"
    example = (
        '{"name": "box-a", "upstream_url": "http://HOST:8000", '
        '"arbiter_url": "http://HOST:8090", "models": ["MODEL"]}'
    )
    if not isinstance(doc, dict):
        raise ConfigError(f"{where} must be an object like {example}, got {doc!r}")
    unknown = sorted(set(doc) - set(BOX_KEYS))
    if unknown:
        raise ConfigError(
            f"{where} has unknown key(s) {', '.join(unknown)}; known: {', '.join(BOX_KEYS)}"
        )
    missing = [k for k, required in BOX_KEYS.items() if required and k not in doc]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; a box is like {example}")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ConfigError(
            f"{where}.name must be a non-empty name without surrounding spaces, got {name!r}"
        )
    for key in ("upstream_url", "arbiter_url"):
        url = doc[key]
        problem = _url_problem(url) if isinstance(url, str) else "must be a string"
        if problem:
            raise ConfigError(
                f"{where}.{key} {problem}, got {url!r}; give the base URL like http://HOST:PORT"
            )
    models = doc["models"]
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(
            f"{where}.models must be a list of model names (the requests' 'model'), got {models!r}"
        )
    if not models:
        raise ConfigError(
            f"{where}.models is empty: box {name!r} would never be sent a request; "
            "list the models its vLLM serves (its --served-model-name)"
        )
    if len(set(models)) != len(models):
        raise ConfigError(f"{where}.models lists a model twice, got {models!r}")
    weight = doc.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ConfigError(f"{where}.weight must be an integer >= 1, got {weight!r}")
    key_file = doc.get("api_key_file", global_key_file)
    if not isinstance(key_file, str):
        raise ConfigError(
            f'{where}.api_key_file must be a path (or "" for no key), got {key_file!r}'
        )
    return Box(name, doc["upstream_url"], doc["arbiter_url"], tuple(models), weight, key_file)


def _check_boxes(value: Any, settings: Mapping[str, Any], global_key_file: str) -> tuple[Box, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"boxes must be a list of box objects, got {value!r}")
    if not value:
        return ()
    given = [k for k in ("upstream_url", "arbiter_url") if k in settings]
    if given:
        raise ConfigError(
            f"{' and '.join(given)} given with boxes ({', '.join(repr(settings[k]) for k in given)}"
            "): with boxes each box names its own; remove "
            f"{' and '.join(given)} or put that box in boxes"
        )
    boxes = [_check_box(n, doc, global_key_file) for n, doc in enumerate(value)]
    for key in ("name", "upstream_url"):
        seen: dict[str, int] = {}
        for n, box in enumerate(boxes):
            v = getattr(box, key)
            norm = v.rstrip("/").lower() if key == "upstream_url" else v
            if norm in seen:
                fix = (
                    "give each box its own name"
                    if key == "name"
                    else "list each vLLM once (one box per upstream)"
                )
                raise ConfigError(f"boxes[{n}].{key} {v!r} is also boxes[{seen[norm]}]'s; {fix}")
            seen[norm] = n
    return tuple(boxes)


def build_config(settings: Mapping[str, Any]) -> ProxyConfig:
    """A validated :class:`ProxyConfig` from ``settings`` (missing keys take their default)."""
    defaults = ProxyConfig()
    known = [f.name for f in fields(ProxyConfig)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
    values: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "boxes":
            continue
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
    if "boxes" in settings:
        values["boxes"] = _check_boxes(
            settings["boxes"], settings, values.get("upstream_api_key_file", "")
        )
    config = ProxyConfig(**values)
    if not 0 < config.listen_port < 65536:
        raise ConfigError(f"listen_port must be within 1..65535, got {config.listen_port}")
    for key in ("upstream_url", "arbiter_url"):
        url = getattr(config, key)
        problem = _url_problem(url)
        if problem is not None:
            raise ConfigError(f"{key} {problem}, got {url!r}")
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
        value = getattr(args, f.name, None)
        if value is not None:
            settings[f.name] = value
    return build_config(settings), str(args.log_level)
