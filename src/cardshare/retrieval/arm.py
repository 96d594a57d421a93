"""The arm of ``cardshare bench retrieval`` (:mod:`cardshare.retrieval.bench`).

``--arm gpu|cpu`` is what the operator believes; it is checked where something can
be read, and what could not be checked is said in the record (:func:`check_arm`):

- OpenVINO Model Server reports no device over its API. ``/v1/config`` gives each servable's
  ``model_version_status`` (version, state, error code and message) and nothing else;
  ``/v2/models/<name>/ready`` is a status code; ``/metrics`` labels its series by ``name``,
  ``version``, ``api``, ``interface`` and ``method``. Should the snapshot carry a
  ``target_device`` or ``device`` under a servable (a later release, a stand-in), it is
  compared; otherwise the record says the server was not asked because it cannot answer.
- The device is baked into each servable's ``graph.pbtxt`` at export time
  (``target_device: "GPU"`` in the calculator's options), so with ``--repository`` (the
  exported repository the server serves: its ``config.json`` and the graphs it names) each
  graph's ``target_device`` is compared with the arm. That is evidence about the files, not
  the process: nothing in OVMS's API names the repository it loaded, so the record says that
  the repository and the server at the base URL were not tied together, and names any
  servable the two list differently.

A contradiction stops the run before anything is timed (exit 1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cardshare.retrieval import record

_TARGET_DEVICE_RE = re.compile(r"\btarget_device\s*:\s*\"([^\"]*)\"")
_DEVICE_KEYS = ("target_device", "device")


def strip_pbtxt_comments(text: str) -> str:
    """Protobuf text without its ``#`` comments (a ``#`` inside a quoted string stays)."""
    lines = []
    for line in text.splitlines():
        quote_char: str | None = None
        escaped = False
        cut = len(line)
        for i, ch in enumerate(line):
            if quote_char is not None:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == quote_char:
                    quote_char = None
            elif ch in "\"'":
                quote_char = ch
            elif ch == "#":
                cut = i
                break
        lines.append(line[:cut])
    return "\n".join(lines)


def graph_target_devices(text: str) -> list[str]:
    """Every ``target_device: "..."`` of a graph, comments left out."""
    return _TARGET_DEVICE_RE.findall(strip_pbtxt_comments(text))


def arm_of_device(device: str) -> str | None:
    """``gpu`` for ``GPU``/``GPU.n``, ``cpu`` for ``CPU``, ``npu`` for ``NPU``; None for a
    device string that names no single device (``AUTO``, ``HETERO:...``, ``MULTI:...``)."""
    d = device.strip().upper()
    if d == "CPU":
        return "cpu"
    if re.fullmatch(r"GPU(\.\d+)?", d):
        return "gpu"
    if re.fullmatch(r"NPU(\.\d+)?", d):
        return "npu"
    return None


def _reported_device(entry: Any) -> str | None:
    """A ``target_device``/``device`` string anywhere in a servable's ``/v1/config`` entry."""
    if isinstance(entry, dict):
        for key, value in entry.items():
            if key in _DEVICE_KEYS and isinstance(value, str) and value.strip():
                return value
            found = _reported_device(value)
            if found is not None:
                return found
    elif isinstance(entry, list):
        for item in entry:
            found = _reported_device(item)
            if found is not None:
                return found
    return None


def read_repository(repository: Path) -> tuple[Path, dict[str, Path]]:
    """(config file, servable name -> graph file) of an exported model repository: a directory
    holding ``config.json`` or that file itself. ``model_config_list`` entries
    (``{"config": {"name", "base_path"}}``, as ``export_model.py`` writes them) and legacy
    ``mediapipe_config_list`` entries (``{"name", "base_path", "graph_path"}``) are read; a
    relative ``base_path`` is relative to the config file, the graph is
    ``<base_path>/graph.pbtxt`` unless ``graph_path`` names another."""
    config_path = repository / "config.json" if repository.is_dir() else repository
    try:
        doc = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise record.BenchError(
            f"cannot read the model repository's {config_path}: {exc.strerror or exc}; "
            "--repository takes the exported repository the server serves (its config.json)"
        ) from None
    except (ValueError, UnicodeError) as exc:
        raise record.BenchError(
            f"the model repository's {config_path} is not JSON: {exc}"
        ) from None
    if not isinstance(doc, dict):
        raise record.BenchError(f"the model repository's {config_path} is not a JSON object")
    entries: list[dict[str, Any]] = []
    for item in doc.get("model_config_list") or []:
        if isinstance(item, dict) and isinstance(item.get("config"), dict):
            entries.append(item["config"])
    for item in doc.get("mediapipe_config_list") or []:
        if isinstance(item, dict):
            entries.append(item)
    graphs: dict[str, Path] = {}
    for entry in entries:
        name, base = entry.get("name"), entry.get("base_path")
        if not isinstance(name, str) or not name:
            continue
        base_dir = config_path.parent / base if isinstance(base, str) and base else None
        graph = entry.get("graph_path")
        if isinstance(graph, str) and graph:
            root = base_dir if base_dir is not None else config_path.parent
            graphs[name] = root / graph
        elif base_dir is not None:
            graphs[name] = base_dir / "graph.pbtxt"
    return config_path, graphs


def _repository_device(graph: Path) -> tuple[str | None, str]:
    """(device, '') when the graph names one device, else (None, why not)."""
    try:
        text = graph.read_text(encoding="utf-8")
    except OSError as exc:
        return None, f"cannot read {graph}: {exc.strerror or exc}"
    except UnicodeError:
        return None, f"{graph} is not UTF-8 text"
    devices = sorted(set(graph_target_devices(text)))
    if not devices:
        return None, f"{graph} names no target_device"
    if len(devices) > 1:
        return None, f"{graph} names several target devices: {', '.join(devices)}"
    return devices[0], ""


def check_arm(
    arm: str,
    models: Sequence[str],
    server_config: Mapping[str, Any],
    repository: Path | None,
    base_url: str,
) -> record.ArmCheck:
    """Compare ``arm`` with every device the server reports for ``models`` and, with a
    ``repository``, with each model's ``graph.pbtxt``; say what could not be compared."""
    if arm not in record.ARMS:
        raise ValueError(f"arm must be one of {', '.join(record.ARMS)}, got {arm!r}")
    checked: list[str] = []
    not_checked: list[str] = []
    contradicted = False
    agreed: set[str] = set()

    def judge(model: str, device: str, source: str) -> None:
        nonlocal contradicted
        found = arm_of_device(device)
        if found is None:
            not_checked.append(
                f"{model}: {source} says target_device {device!r}, which names no single device "
                "(OpenVINO chooses or splits at load time)"
            )
        elif found == arm:
            checked.append(f"{model}: {source} says {device}: agrees with --arm {arm}")
            agreed.add(model)
        else:
            checked.append(f"{model}: {source} says {device}: CONTRADICTS --arm {arm}")
            contradicted = True

    silent = []
    for model in models:
        device = _reported_device(server_config.get(model))
        if device is None:
            silent.append(model)
        else:
            judge(model, device, f"the server's /v1/config at {base_url}")
    if silent:
        not_checked.append(
            f"arm not checked against the server for {', '.join(silent)}: OpenVINO Model Server "
            "reports no device (/v1/config gives each servable's state only; "
            "/v2/models/<name>/ready and /metrics name none)"
        )

    if repository is None:
        not_checked.append(
            "arm not checked against a model repository: no --repository given (the device is "
            "baked into each servable's graph.pbtxt as target_device at export time)"
        )
    else:
        config_path, graphs = read_repository(repository)
        for model in models:
            graph = graphs.get(model)
            if graph is None:
                not_checked.append(f"{model}: {config_path} lists no servable of that name")
                continue
            device, why = _repository_device(graph)
            if device is None:
                not_checked.append(f"{model}: {why}")
            else:
                judge(model, device, str(graph))
        served = set(server_config)
        listed = set(graphs)
        if served != listed:
            not_checked.append(
                f"{config_path} lists {', '.join(sorted(listed)) or 'nothing'} but the server's "
                f"/v1/config lists {', '.join(sorted(served)) or 'nothing'}: this repository may "
                "not be what the server loaded"
            )
        not_checked.append(
            f"that the server at {base_url} loaded {config_path} is not checked: OpenVINO Model "
            "Server's API does not name the repository it serves"
        )

    if contradicted:
        verdict = record.CONTRADICTED
    elif models and agreed == set(models):
        verdict = record.AGREES
    elif agreed:
        verdict = record.PARTLY
    else:
        verdict = record.NOT_CHECKED
    return record.ArmCheck(
        arm=arm, verdict=verdict, checked=tuple(checked), not_checked=tuple(not_checked)
    )
