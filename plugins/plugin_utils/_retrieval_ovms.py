# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What an OpenVINO Model Server repository serves, and what the running server says of it
(pure functions, no I/O; the ``retrieval`` role reads the files and asks the server).

Modelled on ``openvinotoolkit/model_server`` (``src/schema.cpp``, ``src/modelmanager.cpp``,
``src/mediapipe_internal/mediapipegraphconfig.cpp``, ``src/model.cpp``,
``src/config_status_utils.cpp``):

The server's ``config.json``
============================

* ``model_config_list`` is required by the schema (an empty list will do); a file without it
  is refused and the server does not start.
* A servable is listed either under ``model_config_list`` as ``{"config": {"name", "base_path",
  "graph_path", ...}}`` or, the older spelling that ``export_model.py`` wrote up to 2025.x,
  under ``mediapipe_config_list`` as ``{"name", "base_path", "graph_path", "subconfig"}`` with
  no ``config`` wrapper. The server reads both.
* ``base_path`` is relative to the directory of ``config.json``; absent or empty it is the
  servable's name. ``graph_path`` is relative to ``base_path``; absent it is ``graph.pbtxt``.
  An entry of ``model_config_list`` is a MediaPipe graph when that file exists, else a plain
  model (versions in numbered directories).

The servables' states (``GET /v1/config``)
==========================================

Each servable has a ``model_version_status`` list, one entry per version in ascending order
(a MediaPipe graph has one, version 1). A request that names no version is served by the
model's default version: the highest version whose state is ``AVAILABLE``
(``Model::updateDefaultVersion``). So a servable whose version 1 is ``END`` and version 2
``AVAILABLE`` is served, by version 2. Where the config pins versions (``model_version_policy``
``specific``), the server loads only those; the served version is then the highest pinned
one that is ``AVAILABLE``. A graph the server refused reads ``LOADING`` with the error code
``FAILED_PRECONDITION`` and stays so until its files change: waiting longer does not help.

The rerank probe
================

The role sends the server one fixed rerank request, one relevant document among unrelated
ones; :func:`retrieval_rerank_probe` judges the answer: a cross-encoder ranks the relevant one
first with a clear margin.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._retrieval_inputs import (
    RetrievalError,
    RetrievalTypeError,
)

__all__ = [
    "DEFAULT_GRAPH",
    "retrieval_rerank_probe",
    "retrieval_servable_states",
    "retrieval_servables",
    "retrieval_server_errors",
]

DEFAULT_GRAPH = "graph.pbtxt"
MODELS_MOUNT = "/models"
# the keys the schema allows in a mediapipe_config_list entry (additionalProperties: false)
_MEDIAPIPE_KEYS = frozenset({"name", "base_path", "graph_path", "subconfig"})
# states a version does not leave by itself (src/modelversion.hpp's order)
_GONE = frozenset({"UNLOADING", "END"})


def _relative(path: str, where: str, mount: str) -> str:
    """``path`` inside the served tree, relative to its top; an absolute path must lie under
    the tree's mount in the container."""
    if "://" in path:
        raise RetrievalError(
            f"{where} is {path!r}, a remote location: the role serves the export's own tree; "
            "give a path relative to config.json"
        )
    if path.startswith("/"):
        prefix = mount.rstrip("/") + "/"
        if not path.startswith(prefix):
            raise RetrievalError(
                f"{where} is {path!r}, outside {mount} where the server sees the tree: give a "
                "path relative to config.json"
            )
        path = path[len(prefix) :]
    normal = posixpath.normpath(path) if path else "."
    if normal == ".." or normal.startswith("../"):
        raise RetrievalError(
            f"{where} is {path!r}, which leaves the exported tree: give a path inside it"
        )
    return "" if normal == "." else normal


def _entry(raw: Mapping[str, Any], where: str, mount: str) -> dict[str, Any]:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RetrievalError(f"{where}.name is {name!r}: each servable needs a name")
    for key in ("base_path", "graph_path"):
        if key in raw and not isinstance(raw[key], str):
            raise RetrievalError(f"{where}.{key} is {raw[key]!r}: a path (a string)")
    given = raw.get("base_path", "")
    base = _relative(given if given else name, f"{where}.base_path", mount)
    graph_given = raw.get("graph_path", DEFAULT_GRAPH) or DEFAULT_GRAPH
    if graph_given.startswith("/") or "://" in graph_given:
        graph = _relative(graph_given, f"{where}.graph_path", mount)
    else:
        graph = _relative(posixpath.join(base, graph_given), f"{where}.graph_path", mount)
    return {"name": name, "base_path": base, "graph_path": graph}


def _pinned(raw: Mapping[str, Any], where: str) -> list[int] | None:
    policy = raw.get("model_version_policy")
    if not isinstance(policy, Mapping) or "specific" not in policy:
        return None
    versions = (
        policy["specific"].get("versions") if isinstance(policy["specific"], Mapping) else None
    )
    if not isinstance(versions, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in versions
    ):
        raise RetrievalError(
            f"{where}.model_version_policy.specific.versions is {versions!r}: a list of "
            "version numbers"
        )
    return sorted(versions)


def retrieval_servables(
    config: object, path: str = "config.json", mount: str = MODELS_MOUNT
) -> dict[str, dict[str, Any]]:
    """The servables an OVMS ``config.json`` lists, by name, as the server resolves them.

    ``config`` is the file's text or its parsed document. Each servable is ``{"name",
    "base_path", "graph_path", "list", "versions"}``: the two paths relative to the directory
    of ``config.json`` (``""`` for that directory itself), ``list`` the list it came from
    (``model_config_list`` or ``mediapipe_config_list``), ``versions`` the versions a
    ``specific`` version policy pins (``None`` otherwise; a MediaPipe graph has one version
    and the server ignores a policy on it). Refused, naming ``path`` and the entry: what the
    server refuses (not JSON, no ``model_config_list``, an entry without a name, a
    ``mediapipe_config_list`` entry with a key the schema does not know), a name given twice,
    and paths the role cannot serve (remote, outside the tree or its mount).
    """
    if isinstance(config, str):
        try:
            document = json.loads(config)
        except ValueError as err:
            raise RetrievalError(f"{path} is not JSON ({err}): the server refuses it") from err
    else:
        document = config
    if not isinstance(document, Mapping):
        kind = "null" if document is None else type(document).__name__
        raise RetrievalTypeError(f"{path}: expected a JSON object, got {kind}")
    models = document.get("model_config_list")
    if not isinstance(models, list):
        raise RetrievalError(
            f"{path} has no model_config_list list ({models!r}): OVMS's schema requires it and "
            'the server refuses the file; add "model_config_list": [] (the servables may stay '
            "under mediapipe_config_list)"
        )
    graphs = document.get("mediapipe_config_list", [])
    if not isinstance(graphs, list):
        raise RetrievalError(f"{path}: mediapipe_config_list is {graphs!r}, not a list")
    found: dict[str, dict[str, Any]] = {}

    def add(entry: dict[str, Any], where: str) -> None:
        if entry["name"] in found:
            raise RetrievalError(
                f"{path} names {entry['name']!r} twice ({found[entry['name']]['where']} and "
                f"{where}): the server loads one of them; keep one entry"
            )
        found[entry["name"]] = {**entry, "where": where}

    # the server parses mediapipe_config_list first (parseMediapipeConfig), then the models
    for index, raw in enumerate(graphs):
        where = f"{path}: mediapipe_config_list[{index}]"
        if not isinstance(raw, Mapping):
            raise RetrievalError(f"{where} is {raw!r}, not an object")
        unknown = sorted(set(raw) - _MEDIAPIPE_KEYS)
        if unknown:
            raise RetrievalError(
                f"{where} has {', '.join(unknown)}, which the schema does not allow there (only "
                f"{', '.join(sorted(_MEDIAPIPE_KEYS))}): the server refuses the file"
            )
        add(
            {**_entry(raw, where, mount), "list": "mediapipe_config_list", "versions": None},
            where,
        )
    for index, raw in enumerate(models):
        where = f"{path}: model_config_list[{index}]"
        inner = raw.get("config") if isinstance(raw, Mapping) else None
        if not isinstance(inner, Mapping):
            raise RetrievalError(f'{where} is {raw!r}: each entry is {{"config": {{"name": ...}}}}')
        entry = _entry(inner, f"{where}.config", mount)
        add({**entry, "list": "model_config_list", "versions": _pinned(inner, where)}, where)
    return {name: {k: v for k, v in item.items() if k != "where"} for name, item in found.items()}


# --------------------------------------------------------------------------- states


def _version(entry: Mapping[str, Any]) -> int | None:
    raw = entry.get("version")
    try:
        return int(str(raw))
    except ValueError:
        return None


def _describe(version: int | None, entry: Mapping[str, Any]) -> str:
    state = entry.get("state", "?")
    raw = entry.get("status")
    status: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    code = status.get("error_code", "?")
    message = status.get("error_message", "")
    detail = code if message in ("", code, "OK") else f"{code}: {message}"
    return f"version {version} {state} ({detail})"


def _one(name: str, document: Mapping[str, Any], pinned: Sequence[int] | None) -> dict[str, Any]:
    """One servable's verdict: served version, state, whether waiting can still help."""
    if name not in document:
        return {
            "name": name,
            "available": False,
            "served_version": None,
            "settled": True,
            "text": f"{name}: not in /v1/config (the server does not know it: see config.json)",
        }
    raw = document[name]
    listed = raw.get("model_version_status") if isinstance(raw, Mapping) else None
    entries = [e for e in listed if isinstance(e, Mapping)] if isinstance(listed, list) else []
    versions = [(v, e) for v, e in ((_version(e), e) for e in entries) if v is not None]
    candidates = [(v, e) for v, e in versions if pinned is None or v in pinned]
    available = [v for v, e in candidates if e.get("state") == "AVAILABLE"]
    served = max(available) if available else None
    rule = (
        "the highest AVAILABLE"
        if pinned is None
        else f"the highest AVAILABLE of the pinned {list(pinned)}"
    )
    others = "; ".join(_describe(v, e) for v, e in versions if v != served)
    if served is not None:
        text = f"{name}: serves version {served} ({rule})" + (f"; {others}" if others else "")
        return {
            "name": name,
            "available": True,
            "served_version": served,
            "settled": True,
            "text": text,
        }
    # not served: is it still on its way, or settled in a failure?
    refused = [
        (v, e)
        for v, e in candidates
        if e.get("state") == "LOADING"
        and isinstance(e.get("status"), Mapping)
        and e["status"].get("error_code", "OK") != "OK"
    ]
    gone = bool(candidates) and all(e.get("state") in _GONE for _v, e in candidates)
    if not versions:
        why = "no version listed"
    elif not candidates:
        why = f"none of the pinned versions {list(pinned or [])} is listed"
    else:
        why = "no version AVAILABLE"
    text = f"{name}: {why}" + (
        f"; {'; '.join(_describe(v, e) for v, e in versions)}" if versions else ""
    )
    return {
        "name": name,
        "available": False,
        "served_version": None,
        "settled": bool(refused) or gone,
        "text": text,
    }


def retrieval_servable_states(
    answer: object,
    models: object,
    pins: object = None,
) -> dict[str, Any]:
    """What ``GET /v1/config`` says of ``models``: which are served, which failed for good.

    ``answer`` is the body (text or parsed). ``pins`` maps a name to the versions its config
    pins, or to the servable as :func:`retrieval_servables` gives it (its ``versions``), or is
    ``None``. Returns ``available``
    (the names served), ``unavailable`` (the others), ``failed`` (those no wait will serve: a
    version refused with an error code such as ``FAILED_PRECONDITION``, every version gone, or
    a name the server does not know), ``servables`` (each one's ``served_version``, ``available``,
    ``settled`` and ``text``) and ``text`` (one line for a message, such as ``bge-m3: serves
    version 2 (the highest AVAILABLE); version 1 END (OK)``). An answer that is not a JSON
    object of servables is refused, showing what came.
    """
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise RetrievalTypeError(f"models: expected a list of servable names, got {models!r}")
    if pins is not None and not isinstance(pins, Mapping):
        raise RetrievalTypeError(f"pins: expected a mapping of names to versions, got {pins!r}")
    document: object = answer
    if isinstance(answer, str | bytes):
        try:
            document = json.loads(answer)
        except ValueError as err:
            raise RetrievalError(
                f"/v1/config answered what is not JSON ({err}): {str(answer)[:200]!r}"
            ) from err
    if not isinstance(document, Mapping):
        raise RetrievalError(
            f"/v1/config answered {str(document)[:200]!r}, not an object of servables"
        )
    verdicts = []
    for name in models:
        pin = pins.get(name) if pins is not None else None
        if isinstance(pin, Mapping):  # a servable as retrieval_servables gives it
            pin = pin.get("versions")
        if pin is not None and not (
            isinstance(pin, list)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in pin)
        ):
            raise RetrievalTypeError(f"pins[{name!r}]: expected a list of versions, got {pin!r}")
        verdicts.append(_one(name, document, pin))
    return {
        "available": [v["name"] for v in verdicts if v["available"]],
        "unavailable": [v["name"] for v in verdicts if not v["available"]],
        "failed": [v["name"] for v in verdicts if not v["available"] and v["settled"]],
        "servables": {v["name"]: v for v in verdicts},
        "text": "; ".join(v["text"] for v in verdicts),
    }


# spdlog's lines as OVMS prints them: [time][pid][logger][level] message
_LOG_LINE = re.compile(
    r"^\[[^\]]*\]\[[^\]]*\]\[(?P<logger>[^\]]*)\]\[(?P<level>[a-z]+)\] (?P<message>.*)$"
)


def retrieval_server_errors(log: object, limit: int = 8) -> list[str]:
    """The server's own reasons in its log: the last ``limit`` lines it printed at level
    ``error`` or ``critical``, as ``logger: message`` (a model it refused says why here, such as
    ``modelmanager: Mediapipe: bge-reranker-v2-m3 validation failed: Either
    openvino_tokenizer.xml was not provided or it was not loaded correctly``)."""
    if not isinstance(log, str):
        raise RetrievalTypeError(f"log: expected the server's log text, got {type(log).__name__}")
    found = []
    for line in log.splitlines():
        match = _LOG_LINE.match(line.strip())
        if match and match.group("level") in ("error", "critical"):
            found.append(f"{match.group('logger')}: {match.group('message')[:400]}")
    return found[-limit:] if limit > 0 else []


# --------------------------------------------------------------------------- the probe

NOISE_SCORE = 1e-6  # an LLM-style reranker in a cross-encoder slot scores about 1e-9..1e-12
MIN_SEPARATION = 0.1


def retrieval_rerank_probe(
    response: object, relevant_index: object, documents: object
) -> list[str]:
    """What is wrong with the answer to the role's fixed rerank probe; empty when it ranks.

    The probe sends one relevant document and several unrelated ones.  A reranker that works
    as a cross-encoder puts the relevant one first with a clear margin.  Refused: an answer
    that is not ``{"results": [{"index", "relevance_score"}]}`` for every document; every
    score below ``1e-6`` (an LLM-style reranker pressed into a cross-encoder slot answers
    1e-9..1e-12 for all); the relevant document not first; a margin over the next below 0.1.
    """
    if not isinstance(documents, int) or isinstance(documents, bool) or documents < 2:
        raise RetrievalError(f"documents: got {documents!r}; the probe sends 2 or more")
    if not isinstance(relevant_index, int) or not 0 <= relevant_index < documents:
        raise RetrievalError(f"relevant_index: got {relevant_index!r}; give 0..{documents - 1}")
    results = response.get("results") if isinstance(response, dict) else None
    if not isinstance(results, list):
        return [f"the answer has no results list: {str(response)[:200]}"]
    scores: dict[int, float] = {}
    for item in results:
        index = item.get("index") if isinstance(item, dict) else None
        score = item.get("relevance_score") if isinstance(item, dict) else None
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not isinstance(score, (int, float))
            or isinstance(score, bool)
            or not math.isfinite(score)
        ):
            return [f"a result is not {{index, relevance_score}}: {str(item)[:200]}"]
        scores[index] = float(score)
    if sorted(scores) != list(range(documents)):
        return [f"the results score documents {sorted(scores)}, expected 0..{documents - 1}"]
    ranked = sorted(scores, key=lambda i: -scores[i])
    shown = ", ".join(f"{i}: {scores[i]:.3g}" for i in ranked)
    if max(scores.values()) < NOISE_SCORE:
        return [
            f"every score is below {NOISE_SCORE:g} ({shown}): a ranking made of noise, the "
            "signature of an LLM-style reranker in a cross-encoder slot; serve a cross-encoder "
            "(bge-reranker-v2-m3 exported with export_model.py rerank_ov)"
        ]
    problems: list[str] = []
    if ranked[0] != relevant_index:
        problems.append(
            f"the relevant document {relevant_index} is not first (scores by rank: {shown})"
        )
    else:
        margin = scores[ranked[0]] - scores[ranked[1]]
        if margin < MIN_SEPARATION:
            problems.append(
                f"the relevant document leads by {margin:.3g}, less than {MIN_SEPARATION}: no "
                f"separation (scores by rank: {shown})"
            )
    return problems
