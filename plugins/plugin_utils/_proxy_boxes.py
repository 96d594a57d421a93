# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The patient proxy's boxes as the arbiter role renders them (the proxy's ``boxes`` key).

Two sources, one at a time: ``arbiter_proxy_boxes`` (a list written out) or
``arbiter_proxy_fleet_group`` (an inventory group: each of its hosts published its box, the
fact ``arbiter_box``, when the arbiter role ran on it in the play). Neither: no boxes, the
proxy's single box as before. Every refusal names the variable, the value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = ["BoxError", "proxy_boxes"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BOX_KEYS = {"name", "upstream_url", "arbiter_url", "models"}
_BOX_OPTIONAL = {"weight", "api_key_file"}
_EXAMPLE = (
    "give each box as {name: box2, upstream_url: 'http://box2.lan:8000', arbiter_url: "
    "'http://box2.lan:8090', models: [Qwen2.5-7B-Instruct]} (weight and api_key_file optional)"
)


class BoxError(ValueError):
    """The boxes cannot be rendered; the message names the variable, the value and the fix."""


def _is_loopback(host: str) -> bool:
    return (
        host in ("localhost", "::1", "[::1]")
        or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None
    )


def _address(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL, the scheme's port when it names none."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return host, parts.port or (443 if parts.scheme == "https" else 80)


def _url(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or urlsplit(value).scheme not in ("http", "https"):
        raise BoxError(f"{where}.{key} is {value!r}: set it to the box's http:// base URL")
    if not urlsplit(value).hostname:
        raise BoxError(f"{where}.{key} is {value!r}: the URL names no host")
    return value.rstrip("/")


def _check(box: Any, where: str) -> dict[str, Any]:
    """One box, checked and normalised (weight 1 and api_key_file "" when not given)."""
    if not isinstance(box, Mapping) or not _BOX_KEYS <= set(box) <= _BOX_KEYS | _BOX_OPTIONAL:
        raise BoxError(f"{where} is {box!r}: {_EXAMPLE}")
    name = box["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BoxError(
            f"{where}.name is {name!r}: name the box with letters, digits and ._- (such as its "
            "inventory hostname)"
        )
    models = box["models"]
    if (
        not isinstance(models, list)
        or not all(isinstance(m, str) and m for m in models)
        or len(set(models)) != len(models)
    ):
        raise BoxError(
            f"{where}.models is {models!r}: list the model names the box's vLLM serves (its "
            "--served-model-name), each once"
        )
    if not models:
        raise BoxError(
            f"{where} ({name!r}) serves no model (models is []): list the names its vLLM serves, "
            "or leave the box out"
        )
    weight = box.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise BoxError(f"{where}.weight is {weight!r}: set it to a whole number, 1 or more")
    key_file = box.get("api_key_file", "")
    if not isinstance(key_file, str) or (
        key_file and (not key_file.startswith("/") or key_file.endswith("/") or " " in key_file)
    ):
        raise BoxError(
            f"{where}.api_key_file is {key_file!r}: give the absolute path, on the proxy's host, "
            "of a file whose first line is the box's vLLM key, or '' when its vLLM takes none"
        )
    return {
        "name": name,
        "upstream_url": _url(box["upstream_url"], where, "upstream_url"),
        "arbiter_url": _url(box["arbiter_url"], where, "arbiter_url"),
        "models": list(models),
        "weight": weight,
        "api_key_file": key_file,
    }


def _published(group: str, host: str, fact: Any, local: str, keys_dir: str) -> dict[str, Any]:
    """The box of ``host`` of the fleet group, from the fact it published (``arbiter_box``),
    as the proxy on ``local`` reaches it: its own box by the local URLs and key file, another
    by its address, with its key copied into ``keys_dir`` (``key_source``)."""
    where = f"arbiter_proxy_fleet_group {group!r}: the host {host!r}"
    if not isinstance(fact, Mapping):
        raise BoxError(
            f"{where} published no box (no arbiter role ran on it in this play): run the play on "
            "every host of the group (a --limit that leaves one out cannot render the fleet), or "
            "list the boxes in arbiter_proxy_boxes instead"
        )
    try:
        weight, vllm_port, arbiter_port = (
            int(fact["weight"]),
            int(fact["vllm_port"]),
            int(fact["arbiter_port"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BoxError(
            f"{where} published the box {dict(fact)!r}: its arbiter_box_weight, vLLM port or "
            f"arbiter_port is not a whole number ({exc}); fix them on {host!r}"
        ) from exc
    if host == local:
        box = {
            "name": host,
            "upstream_url": fact["local_upstream_url"],
            "arbiter_url": fact["local_arbiter_url"],
            "models": fact["models"],
            "weight": weight,
            "api_key_file": fact["api_key_file"],
        }
        return {**_check(box, where), "key_source": None}
    for what, listen, var in (
        ("vLLM", fact["vllm_listen_address"], "vllm_listen_address"),
        ("arbiter", fact["arbiter_listen_address"], "arbiter_listen_address"),
    ):
        if _is_loopback(listen):
            raise BoxError(
                f"{where} has its {what} listening on {listen!r} ({var} on {host!r}), which the "
                f"proxy on {local!r} cannot reach: set {var} on {host!r} to its address or "
                "0.0.0.0 (vLLM then with vllm_api_key_file)"
            )
    address = fact["address"]
    netloc = f"[{address}]" if ":" in address else address
    box = {
        "name": host,
        "upstream_url": f"http://{netloc}:{vllm_port}",
        "arbiter_url": f"http://{netloc}:{arbiter_port}",
        "models": fact["models"],
        "weight": weight,
        "api_key_file": f"{keys_dir}/{host}" if fact["api_key_file"] else "",
    }
    source = {"host": host, "path": fact["api_key_file"]} if fact["api_key_file"] else None
    return {**_check(box, where), "key_source": source}


def proxy_boxes(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The proxy's boxes from the role's settings: ``arbiter_proxy_boxes``,
    ``arbiter_proxy_fleet_group``, ``fleet`` (``{host: its arbiter_box or None}`` for the
    group's hosts, None when the inventory has no such group), ``local_host`` and
    ``fleet_keys_dir``. Each box has the proxy's keys and ``key_source`` (``{host, path}``
    of a key to copy from another box, or None). [] is the single box of old."""
    explicit = settings.get("arbiter_proxy_boxes") or []
    group = settings.get("arbiter_proxy_fleet_group") or ""
    if not isinstance(explicit, list):
        raise BoxError(f"arbiter_proxy_boxes is {explicit!r}: {_EXAMPLE}, in a list")
    if not isinstance(group, str):
        raise BoxError(f"arbiter_proxy_fleet_group is {group!r}: name an inventory group, or ''")
    if explicit and group:
        raise BoxError(
            f"arbiter_proxy_boxes lists {len(explicit)} boxes and arbiter_proxy_fleet_group is "
            f"{group!r}: give the boxes one way, the list or the group"
        )
    boxes: list[dict[str, Any]]
    if group:
        fleet = settings.get("fleet")
        if not isinstance(fleet, Mapping) or not fleet:
            raise BoxError(
                f"arbiter_proxy_fleet_group is {group!r}, which is no group of the inventory or "
                "has no hosts: name the group whose hosts are the boxes"
            )
        local = str(settings["local_host"])
        keys_dir = str(settings["fleet_keys_dir"]).rstrip("/")
        boxes = [_published(group, str(h), fleet[h], local, keys_dir) for h in fleet]
        name = "arbiter_proxy_fleet_group " + repr(group)
    else:
        boxes = [
            {**_check(box, f"arbiter_proxy_boxes[{i}]"), "key_source": None}
            for i, box in enumerate(explicit)
        ]
        name = "arbiter_proxy_boxes"
    seen: dict[str, int] = {}
    addresses: dict[tuple[str, tuple[str, int]], int] = {}
    for i, box in enumerate(boxes):
        if box["name"] in seen:
            raise BoxError(
                f"{name} lists the box {box['name']!r} twice (boxes {seen[box['name']]} and {i}): "
                "give each box once"
            )
        seen[box["name"]] = i
        for key in ("upstream_url", "arbiter_url"):
            where = (key, _address(box[key]))
            if where in addresses:
                other = boxes[addresses[where]]
                raise BoxError(
                    f"{name}: the boxes {other['name']!r} and {box['name']!r} have one address, "
                    f"{key} {box[key]!r}: two boxes cannot be one server; give each box its own "
                    "address (a box is listed once)"
                )
            addresses[where] = i
    return boxes
