# SIMULATION: the described cluster the fake kubernetes.core modules answer from (see the
# README of tests/unit/roles/fake_kubernetes).
from __future__ import annotations

import json
from typing import Any

# the arguments every kubernetes.core module takes (the role sets kubeconfig and context)
COMMON = {
    "kubeconfig": {"type": "raw"},
    "context": {"type": "str"},
    "namespace": {"type": "str"},
    "name": {"type": "str"},
    "kind": {"type": "str"},
    "api_version": {"type": "str", "default": "v1"},
}


def load(params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    path = str(params["kubeconfig"])
    with open(path, encoding="utf-8") as handle:
        return json.load(handle), path


def record(path: str, module: str, params: dict[str, Any]) -> int:
    """Append this call; return how many calls of ``module`` came before it."""
    calls = path + ".calls"
    try:
        with open(calls, encoding="utf-8") as handle:
            before = sum(1 for line in handle if json.loads(line)["module"] == module)
    except FileNotFoundError:
        before = 0
    shown = {k: v for k, v in params.items() if k not in ("kubeconfig", "context")}
    with open(calls, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"module": module, "params": shown}, default=str) + "\n")
    return before


def nth(items: list[Any], index: int) -> Any:
    return items[min(index, len(items) - 1)]
