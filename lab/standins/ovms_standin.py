"""SIMULATION: a stand-in for OpenVINO Model Server (``openvino/model_server``) in the lab.

This is not OVMS and runs no model.  It exists because the lab has no Intel GPU and cannot
run the real server's inference.  It takes the real ``/ovms/bin/ovms`` command line, reads
an exported model repository (``config.json`` plus one ``graph.pbtxt`` per servable, as
``export_model.py`` writes it; servables under ``model_config_list`` and the legacy
``mediapipe_config_list``, ``base_path`` and ``graph_path`` resolved as the server does, the
schema's required ``model_config_list`` enforced), loads or fails each servable as OVMS
would, and serves OVMS's REST API with the real shapes and error texts (``facts.md`` "OpenVINO Model
Server", ``tests/fixtures/ovms/README.md``; sources: ``openvinotoolkit/model_server`` at
``7e4df0c7``):

* ``--config_path`` and ``--rest_port`` (both required here), ``--port`` (gRPC, accepted and
  not served), ``--rest_bind_address``, ``--metrics_enable``, ``--metrics_list``,
  ``--log_level``, ``--file_system_poll_wait_seconds``, ``--rest_workers``; unknown flags
  exit 2.
* a servable whose ``openvino_tokenizer.xml`` or ``openvino_model.xml`` is missing, whose
  graph does not parse, or whose ``target_device`` is neither CPU nor GPU (absent: CPU, the
  options' default up to 2026.2) stays LOADING with
  FAILED_PRECONDITION (the internal ``LOADING_PRECONDITION_FAILED``); the server still
  starts and ``/v2/health/ready`` still answers 200 (the real trap).
* ``/v2/health/{ready,live}``, ``/v2/models/<name>/ready``, ``/v1/config``,
  ``/v3/embeddings``, ``/v3/rerank`` (``/v3/v1/...`` too), ``/metrics`` (``--metrics_enable``).
* rerank chunking and ``max_allowed_chunks`` exactly as ``RerankCalculatorOV``; tokens are
  whitespace-separated words (the stand-in's tokenizer, not XLM-RoBERTa's).
* ``NUM_STREAMS`` from the graph's ``plugin_config``: one stream serialises inference.
* GPU memory that ratchets (the seed's September update): weights plus a pool that grows to
  the largest call served and never shrinks; registered on the simulated card
  (``simcard.py``, comm ``ovms``) and shown at ``GET /standin/memory`` (stand-in only).

Environment: ``STANDIN_LOAD_SECONDS`` (1), ``STANDIN_INFER_SECONDS`` (0.02),
``STANDIN_INFER_SECONDS_PER_ITEM`` (0.002), ``STANDIN_RERANK_STYLE`` (``cross-encoder`` or
``llm``), ``STANDIN_PINNED_SHMEM_SCALE`` (0 = off), ``STANDIN_PINNED_SHMEM_DIR``
(``/dev/shm``), ``STANDIN_RELEASE_SECONDS`` (1), ``CARDSHARE_SIM_ROOT``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import SimClient
from standin_http import BadChunkedBody, Handler, StandinServer, read_chunked, serve_in_thread

__all__ = [
    "COMM",
    "DIMENSION",
    "GraphError",
    "GraphOptions",
    "Servable",
    "Settings",
    "StartupError",
    "build_parser",
    "chunk_plan",
    "config_status_text",
    "embed",
    "load_servable",
    "main",
    "parse_graph",
    "parse_textproto",
    "prepare",
    "rerank_cost_bytes",
]

VERSION = "2026.2.1+standin (SIMULATION)"
COMM = "ovms"
GIB = 1024**3
DIMENSION = 1024  # bge-m3's embedding width
SPECIAL_TOKENS = 4  # RerankCalculatorOV::NUMBER_OF_SPECIAL_TOKENS
DEFAULT_MAX_ALLOWED_CHUNKS = 10000  # rerank_calculator_ov.proto default
DEFAULT_MAX_POSITION_EMBEDDINGS = 8192  # bge-reranker-v2-m3's own window (stand-in figure)
EMBED_SPECIAL_TOKENS = 2  # <s> ... </s> around each embeddings input

# The seed's measurements (September update): weights pinned after load, and per-row cost of
# a rerank batch ~ 0.0202 GiB x (T/332)^1.78 where T is the batch's padded width.  The
# seed's 1.71 GiB baseline is the server's, both models loaded: split here between them
# (bge-m3 ~0.6 GiB), so that the two servables together pin what the seed measured.
RERANK_BASELINE_GIB = 1.11
RERANK_ROW_GIB = 0.0202
EMBED_BASELINE_GIB = 0.6
EMBED_ROW_GIB = 0.004
REFERENCE_WIDTH = 332
WIDTH_EXPONENT = 1.78

CALCULATORS = {"EmbeddingsCalculatorOV": "embeddings", "RerankCalculatorOV": "rerank"}
GRAPH_FILE = "graph.pbtxt"  # mediapipegraphconfig.cpp DEFAULT_GRAPH_FILENAME
MEDIAPIPE_KEYS = frozenset({"name", "base_path", "graph_path", "subconfig"})  # schema.cpp
# An absent target_device: the options' default up to 2026.2 (rerank_calculator_ov.proto,
# embeddings_calculator_ov.proto); the stand-in is that release.
DEFAULT_TARGET_DEVICE = "CPU"
OPTION_FIELDS = {
    "embeddings": {
        "models_path",
        "normalize_embeddings",
        "target_device",
        "plugin_config",
        "pooling",
        "truncate",
    },
    "rerank": {
        "models_path",
        "max_allowed_chunks",
        "max_position_embeddings",
        "target_device",
        "plugin_config",
    },
}
OPTION_TYPES = {
    "embeddings": "mediapipe.EmbeddingsCalculatorOVOptions",
    "rerank": "mediapipe.RerankCalculatorOVOptions",
}

# Texts of the real server (src/status.cpp; the tokenizer's from openvino.genai via the seed).
TOKENIZER_MISSING = "Either openvino_tokenizer.xml was not provided or it was not loaded correctly"
MODEL_NAME_MISSING = "Model with requested name is not found"
MODEL_VERSION_NOT_LOADED_YET = "Model with requested version is not loaded yet"
MEDIAPIPE_NAME_MISSING = "Mediapipe graph definition with requested name is not found"
MEDIAPIPE_NOT_LOADED_YET = "Mediapipe is not loaded yet"
MEDIAPIPE_EXECUTION_FAILED = "Mediapipe execution failed. MP status - "
INVALID_URL = "Invalid request URL"
JSON_INVALID = "The file is not valid json - "  # + the detail (Status::appendDetails)
_STOPWORDS = "a an and are as at be by can do does for from how i in is it me my of on or "
STOPWORDS = frozenset(
    (_STOPWORDS + "that the this to was we what when where which who why with you").split()
)


class StartupError(Exception):
    """OVMS would not start at all; ``str()`` is the message it prints."""


class GraphError(Exception):
    """A servable fails to load; ``str()`` is the line the server logs."""


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The ``ovms`` command line, for the flags a model-repository deployment uses."""
    parser = argparse.ArgumentParser(prog="ovms", description="SIMULATION of OpenVINO Model Server")
    parser.add_argument("--config_path", required=True)
    parser.add_argument("--rest_port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0, help="gRPC port: accepted, not served")
    parser.add_argument("--rest_bind_address", default="0.0.0.0")
    parser.add_argument("--grpc_bind_address", default="0.0.0.0")
    parser.add_argument("--metrics_enable", action="store_true")
    parser.add_argument("--metrics_list", default=None)
    parser.add_argument(
        "--log_level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR"), default="INFO"
    )
    parser.add_argument("--file_system_poll_wait_seconds", type=int, default=1)
    parser.add_argument("--rest_workers", type=int, default=None)
    return parser


@dataclass(frozen=True, slots=True)
class Settings:
    config_path: Path
    rest_port: int
    bind: str
    metrics: bool
    log_level: str
    load_seconds: float
    infer_seconds: float
    infer_seconds_per_item: float
    rerank_style: str
    shmem_scale: float
    shmem_dir: Path
    release_seconds: float
    argv: tuple[str, ...] = field(default=())


def prepare(argv: Sequence[str], env: Mapping[str, str]) -> Settings:
    """Parse argv (argparse exits 2 on an unknown flag) and the stand-in's knobs."""
    args = build_parser().parse_args(list(argv))
    style = env.get("STANDIN_RERANK_STYLE", "cross-encoder") or "cross-encoder"
    if style not in ("cross-encoder", "llm"):
        raise StartupError(f"STANDIN_RERANK_STYLE must be cross-encoder or llm, got {style!r}")
    return Settings(
        config_path=Path(args.config_path),
        rest_port=args.rest_port,
        bind=args.rest_bind_address,
        metrics=args.metrics_enable,
        log_level=args.log_level,
        load_seconds=float(env.get("STANDIN_LOAD_SECONDS", "1")),
        infer_seconds=float(env.get("STANDIN_INFER_SECONDS", "0.02")),
        infer_seconds_per_item=float(env.get("STANDIN_INFER_SECONDS_PER_ITEM", "0.002")),
        rerank_style=style,
        shmem_scale=float(env.get("STANDIN_PINNED_SHMEM_SCALE", "0") or 0),
        shmem_dir=Path(env.get("STANDIN_PINNED_SHMEM_DIR", "/dev/shm")),
        release_seconds=float(env.get("STANDIN_RELEASE_SECONDS", "1")),
        argv=tuple(argv),
    )


# --------------------------------------------------------------------------- logging


def log(level: str, logger: str, message: str) -> None:
    """One line to stdout in the shape of OVMS's spdlog lines."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"[{stamp}][{os.getpid()}][{logger}][{level}] {message}", flush=True)


# --------------------------------------------------------------------------- graph.pbtxt

_TOKEN = re.compile(
    r"""\s+|\#[^\n]*|(?P<tok>\[[^\]]*\]|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'"""
    r"""|[A-Za-z_][A-Za-z0-9_.]*|[-+]?[0-9][0-9A-Za-z_.+-]*|[{}:,;<>\[\]])""",
)
TextProto = list[tuple[str, Any]]


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise GraphError(f"unexpected character {text[pos]!r} at offset {pos}")
        if match.group("tok") is not None:
            out.append(match.group("tok"))
        pos = match.end()
    return out


def _scalar(token: str) -> Any:
    if token[0] in "\"'":
        return bytes(token[1:-1], "utf-8").decode("unicode_escape")
    if token in ("true", "True"):
        return True
    if token in ("false", "False"):
        return False
    try:
        return int(token)
    except ValueError:
        pass
    try:
        return float(token)
    except ValueError:
        return token  # an enum value


def parse_textproto(text: str) -> TextProto:
    """Protobuf text format into ``[(field, value)]``, a message value being such a list.

    Enough of the format for MediaPipe graphs: fields ``name: scalar``, ``name {..}`` or
    ``name: {..}``, extension names ``[type.googleapis.com / x.y]``, adjacent string
    literals, optional ``,``/``;`` separators, ``#`` comments.  Raises :class:`GraphError`.
    """
    tokens = _tokens(text)
    pos = 0

    def message(closing: str | None) -> TextProto:
        nonlocal pos
        fields: TextProto = []
        while True:
            if pos >= len(tokens):
                if closing is None:
                    return fields
                raise GraphError(f"expected {closing!r}, reached the end of the graph")
            token = tokens[pos]
            if token == closing:
                pos += 1
                return fields
            if token in ",;":
                pos += 1
                continue
            if not (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token) or token.startswith("[")):
                raise GraphError(f"expected a field name, got {token!r}")
            name = re.sub(r"\s+", "", token)
            pos += 1
            colon = pos < len(tokens) and tokens[pos] == ":"
            if colon:
                pos += 1
            if pos >= len(tokens):
                raise GraphError(f"field {name} has no value")
            if tokens[pos] in ("{", "<"):
                end = "}" if tokens[pos] == "{" else ">"
                pos += 1
                fields.append((name, message(end)))
                continue
            if not colon:
                raise GraphError(f"expected ':' after {name}")
            value = tokens[pos]
            if value in "{}<>:,;[]":
                raise GraphError(f"field {name} has no value")
            pos += 1
            if value[0] in "\"'":
                parts = [_scalar(value)]
                while pos < len(tokens) and tokens[pos][0] in "\"'":
                    parts.append(_scalar(tokens[pos]))
                    pos += 1
                fields.append((name, "".join(parts)))
            else:
                fields.append((name, _scalar(value)))

    return message(None)


@dataclass(frozen=True, slots=True)
class GraphOptions:
    """What the stand-in reads from a servable's ``graph.pbtxt``."""

    kind: str  # embeddings | rerank
    node_name: str
    models_path: str
    target_device: str
    plugin_config: dict[str, Any]
    num_streams: int
    normalize_embeddings: bool = True
    truncate: bool = False
    max_allowed_chunks: int = DEFAULT_MAX_ALLOWED_CHUNKS
    max_position_embeddings: int | None = None


def _streams(plugin: Mapping[str, Any]) -> int:
    value = plugin.get("NUM_STREAMS", 1)
    try:
        return max(int(value), 1)
    except (TypeError, ValueError):
        return 1


def parse_graph(text: str) -> GraphOptions:
    """The calculator and its options; :class:`GraphError` when OVMS would refuse the graph."""
    if not text.strip():
        raise GraphError("Trying to parse empty mediapipe graph definition failed")
    try:
        graph = parse_textproto(text)
    except GraphError as exc:
        raise GraphError(
            f"Error parsing text-format mediapipe.CalculatorGraphConfig: {exc}"
        ) from None
    nodes = [value for name, value in graph if name == "node" and isinstance(value, list)]
    found: list[tuple[str, TextProto]] = []
    for node in nodes:
        calculator = next((v for k, v in node if k == "calculator"), None)
        if calculator in CALCULATORS:
            found.append((str(calculator), node))
    if not found:
        raise GraphError(
            "graph has no EmbeddingsCalculatorOV or RerankCalculatorOV node "
            "(the stand-in serves only those)"
        )
    calculator, node = found[0]
    kind = CALCULATORS[calculator]
    node_name = str(next((v for k, v in node if k == "name"), calculator))
    options: TextProto = []
    for key, value in node:
        if key == "node_options" and isinstance(value, list):
            for ext, body in value:
                if ext.endswith("/" + OPTION_TYPES[kind] + "]") and isinstance(body, list):
                    options = body
    seen: dict[str, Any] = {}
    for key, value in options:
        if key not in OPTION_FIELDS[kind]:
            raise GraphError(
                "Error parsing text-format mediapipe.CalculatorGraphConfig: Message type "
                f'"{OPTION_TYPES[kind]}" has no field named "{key}".'
            )
        seen[key] = value
    if "models_path" not in seen:
        raise GraphError(
            f"Message missing required fields: {OPTION_TYPES[kind]}.models_path (stand-in wording)"
        )
    plugin_text = str(seen.get("plugin_config", "") or "")
    plugin: dict[str, Any] = {}
    if plugin_text:
        try:
            loaded = json.loads(plugin_text)
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            plugin = loaded
        else:  # OVMS logs this and carries on with no plugin properties
            log(
                "error",
                "serving",
                f"Error during {kind} node plugin_config option parsing to JSON: {plugin_text}",
            )
    for key in ("max_allowed_chunks", "max_position_embeddings"):
        if key in seen and (not isinstance(seen[key], int) or seen[key] < 0):
            raise GraphError(
                "Error parsing text-format mediapipe.CalculatorGraphConfig: "
                f"Expected integer, got: {seen[key]} (field {key})"
            )
    return GraphOptions(
        kind=kind,
        node_name=node_name,
        models_path=str(seen["models_path"]),
        target_device=str(seen.get("target_device", DEFAULT_TARGET_DEVICE)),
        plugin_config=plugin,
        num_streams=_streams(plugin),
        normalize_embeddings=bool(seen.get("normalize_embeddings", True)),
        truncate=bool(seen.get("truncate", False)),
        max_allowed_chunks=int(seen.get("max_allowed_chunks", DEFAULT_MAX_ALLOWED_CHUNKS)),
        max_position_embeddings=(
            int(seen["max_position_embeddings"]) if "max_position_embeddings" in seen else None
        ),
    )


# --------------------------------------------------------------------------- servables


def device_class(target: str) -> str | None:
    """``GPU`` or ``CPU`` (``GPU.0`` counts as GPU), else ``None``."""
    head = target.split(".", 1)[0]
    if head in ("GPU", "CPU") and (target == head or target[len(head) + 1 :].isdigit()):
        return head
    return None


@dataclass
class Servable:
    """One MediaPipe graph of the repository, its state and its simulated memory."""

    name: str
    base_path: Path
    options: GraphOptions | None = None
    state: str = "BEGIN"  # internal PipelineDefinitionStateCode
    error: str | None = None
    window: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    baseline_bytes: int = 0
    pool_bytes: int = 0
    in_flight_bytes: int = 0
    in_process: int = 0
    accepted: int = 0
    rejected: int = 0
    responses: int = 0
    graph_errors: int = 0
    streams: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(1)
    )

    @property
    def available(self) -> bool:
        return self.state == "AVAILABLE"

    @property
    def device(self) -> str | None:
        return None if self.options is None else device_class(self.options.target_device)

    @property
    def on_gpu(self) -> bool:
        return self.available and self.device == "GPU"

    def public_state(self) -> tuple[str, str]:
        """``(state, error_code)`` as ``/v1/config`` shows them (``convertToModelStatus``)."""
        if self.state == "AVAILABLE":
            return "AVAILABLE", "OK"
        if self.state == "LOADING_PRECONDITION_FAILED":
            return "LOADING", "FAILED_PRECONDITION"
        if self.state == "RETIRED":
            return "END", "OK"
        return "LOADING", "OK"


def _model_window(model_dir: Path) -> int:
    """``max_position_embeddings`` of the model's ``config.json`` (as ``SidepacketServable``),
    else the stand-in's default for bge-reranker-v2-m3."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_POSITION_EMBEDDINGS
    if isinstance(config, dict):
        for key in ("max_position_embeddings", "n_positions", "seq_len", "seq_length", "n_ctx"):
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_MAX_POSITION_EMBEDDINGS


def load_servable(name: str, base_path: Path, graph_path: Path | None = None) -> Servable:
    """Validate one graph as OVMS's loader would; a failure leaves it in
    LOADING_PRECONDITION_FAILED.  ``graph_path`` defaults to ``base_path/graph.pbtxt``."""
    servable = Servable(name=name, base_path=base_path)
    try:
        graph_path = graph_path or base_path / GRAPH_FILE
        try:
            text = graph_path.read_text()
        except OSError:
            raise GraphError(f"Failed to open mediapipe graph definition: {graph_path}") from None
        options = parse_graph(text)
        servable.options = options
        device = device_class(options.target_device)
        model_dir = Path(options.models_path)
        if not model_dir.is_absolute():
            model_dir = base_path / model_dir
        # the order of SidepacketServable::initialize: tokenizer, then model, then compile
        if not (model_dir / "openvino_tokenizer.xml").is_file():
            raise GraphError(TOKENIZER_MISSING)
        for part in ("openvino_model.xml", "openvino_model.bin"):
            if not (model_dir / part).is_file():
                raise GraphError(
                    f"Exception from src/inference/src/cpp/core.cpp: Could not open the file: "
                    f'"{model_dir / part}" (stand-in wording)'
                )
        if device is None:
            raise GraphError(
                "Exception from src/inference/src/cpp/core.cpp: Device with "
                f'"{options.target_device}" name is not registered in the OpenVINO Runtime '
                "(stand-in wording)"
            )
        servable.window = options.max_position_embeddings or _model_window(model_dir)
        if options.kind == "rerank" and servable.window <= 2 * SPECIAL_TOKENS:
            raise GraphError(
                "max_position_embeddings should be larger than 2 * NUMBER_OF_SPECIAL_TOKENS"
            )
        servable.streams = threading.BoundedSemaphore(options.num_streams)
        if device == "GPU":
            gib = RERANK_BASELINE_GIB if options.kind == "rerank" else EMBED_BASELINE_GIB
            servable.baseline_bytes = int(gib * GIB)
        servable.state = "AVAILABLE"
        log(
            "info",
            "modelmanager",
            f"Mediapipe: {name} state changed to: AVAILABLE after handling: ValidationPassedEvent: "
            f"(target_device {options.target_device}, NUM_STREAMS {options.num_streams})",
        )
    except GraphError as exc:
        servable.state = "LOADING_PRECONDITION_FAILED"
        servable.error = str(exc)
        log("error", "modelmanager", f"Mediapipe: {name} validation failed: {exc}")
        log(
            "info",
            "modelmanager",
            f"Mediapipe: {name} state changed to: LOADING_PRECONDITION_FAILED after handling: "
            "ValidationFailedEvent: ",
        )
    return servable


def _servable_paths(raw: Mapping[str, Any], root: Path) -> tuple[Path, Path]:
    """``base_path`` and ``graph_path`` as ``MediapipeGraphConfig::parseNode`` sets them: the
    base relative to the config's directory (the name when absent or empty), the graph relative
    to the base (``graph.pbtxt`` when absent)."""
    name = str(raw["name"])
    base = Path(str(raw.get("base_path") or name))
    if not base.is_absolute():
        base = root / base
    graph = Path(str(raw.get("graph_path") or GRAPH_FILE))
    if not graph.is_absolute():
        graph = base / graph
    return base, graph


def load_repository(config_path: Path) -> list[Servable]:
    """Every servable of ``config.json``: ``mediapipe_config_list`` first (its entries
    ``{name, base_path, graph_path, subconfig}``, the legacy list), then ``model_config_list``
    (``{"config": {...}}``; an entry is a graph when its graph file exists, and the stand-in
    serves graphs only), as ``ModelManager::loadConfig`` reads them.  The schema requires
    ``model_config_list``."""
    try:
        document = json.loads(config_path.read_text())
    except OSError as exc:
        raise StartupError(f"Couldn't read the configuration file: {config_path}: {exc}") from None
    except ValueError as exc:
        raise StartupError(f"Configuration file is not a valid JSON file: {exc}") from None
    invalid = StartupError("Configuration file is not in valid configuration format")
    if not isinstance(document, dict) or not isinstance(document.get("model_config_list"), list):
        raise invalid
    graphs = document.get("mediapipe_config_list", [])
    if not isinstance(graphs, list):
        raise invalid
    root = config_path.resolve().parent
    entries: list[Mapping[str, Any]] = []
    for entry in graphs:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or set(entry) - MEDIAPIPE_KEYS
        ):
            raise invalid
        entries.append(entry)
    for entry in document["model_config_list"]:
        config = entry.get("config") if isinstance(entry, dict) else None
        if not isinstance(config, dict) or not isinstance(config.get("name"), str):
            raise invalid
        entries.append(config)
    servables: list[Servable] = []
    seen: set[str] = set()
    for entry in entries:
        name = entry["name"]
        if name in seen:
            log("error", "modelmanager", f"Mediapipe graph name: {name} is already occupied")
            continue
        seen.add(name)
        base, graph = _servable_paths(entry, root)
        servables.append(load_servable(name, base, graph))
    return servables


# --------------------------------------------------------------------------- model maths


def words(text: str) -> list[str]:
    """The stand-in's tokens: whitespace-separated words."""
    return text.split()


def _stem(term: str) -> str:
    """A crude suffix stripper, so "replace" and "replacing" meet."""
    for suffix in ("ing", "ed", "es", "s", "e"):
        if term.endswith(suffix) and len(term) - len(suffix) >= 3:
            return term[: -len(suffix)]
    return term


def _terms(text: str) -> list[str]:
    return [_stem(t) for t in re.findall(r"\w+", text.lower()) if t not in STOPWORDS]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def embed(text: str, normalize: bool = True, dimension: int = DIMENSION) -> list[float]:
    """Hashed bag of words (signed), L2-normalised: shared words make vectors similar."""
    vector = [0.0] * dimension
    for term in re.findall(r"\w+", text.lower()):
        h = _hash(term)
        vector[h % dimension] += 1.0 if (h >> 32) & 1 else -1.0
    if normalize:
        norm = math.sqrt(sum(v * v for v in vector))
        if norm > 0:
            vector = [v / norm for v in vector]
    return vector


def relevance(query: str, text: str, style: str) -> float:
    """A cross-encoder-like probability from query/document term overlap, or (``llm``) the
    near-zero, unseparated scores of an LLM-style reranker served in a cross-encoder slot."""
    if style == "llm":
        return 1e-12 + (1e-9 - 1e-12) * (_hash(query + "\0" + text) % 10_000) / 10_000
    query_terms = set(_terms(query))
    doc_terms = set(_terms(text))
    overlap = len(query_terms & doc_terms) / len(query_terms) if query_terms else 0.0
    jitter = ((_hash(query + "\0" + text) % 1000) / 1000 - 0.5) * 0.2
    logit = 10.0 * overlap - 5.0 + jitter
    return 1.0 / (1.0 + math.exp(-logit))


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The batch ``RerankCalculatorOV`` builds: one row per chunk."""

    chunks: list[tuple[int, str]]  # (document index, chunk text)
    width: int  # padded row width in tokens: longest chunk + query + special tokens


def chunk_plan(
    query: str, documents: Sequence[str], window: int, max_allowed_chunks: int
) -> ChunkPlan:
    """Chunk as ``PrepareInputsForRerankModel`` + ``chunkDocuments``; raise ``ValueError``
    with the calculator's message (the text after ``failed: ``)."""
    if len(documents) > max_allowed_chunks:
        raise ValueError("Number of documents exceeds max_allowed_chunks")
    query_tokens = min(len(words(query)), window // 2)
    per_chunk = window - query_tokens - SPECIAL_TOKENS
    if per_chunk <= 0:
        raise ValueError("Chunking failed: no space left for chunks")
    tokens = [words(d) for d in documents]
    longest = max((len(t) for t in tokens), default=0)
    chunks: list[tuple[int, str]] = []
    if longest <= per_chunk:
        chunks = [(i, d) for i, d in enumerate(documents)]
        width = longest
    else:
        width = 0
        for i, toks in enumerate(tokens):
            if len(toks) > per_chunk:
                for start in range(0, len(toks), per_chunk):
                    chunks.append((i, " ".join(toks[start : start + per_chunk])))
                width = max(width, per_chunk)
            else:
                chunks.append((i, documents[i]))
                width = max(width, len(toks))
        if len(chunks) > max_allowed_chunks:
            raise ValueError(
                "Chunking failed: exceeding max_allowed_chunks after chunking limit: "
                f"{max_allowed_chunks}; actual: {len(chunks)}"
            )
    return ChunkPlan(chunks=chunks, width=min(width + query_tokens + SPECIAL_TOKENS, window))


def rerank_cost_bytes(rows: int, width: int) -> int:
    """GPU memory a rerank batch of ``rows`` x ``width`` tokens takes (the seed's fit)."""
    return int(rows * RERANK_ROW_GIB * GIB * (width / REFERENCE_WIDTH) ** WIDTH_EXPONENT)


def embed_cost_bytes(rows: int, width: int) -> int:
    return int(rows * EMBED_ROW_GIB * GIB * (width / REFERENCE_WIDTH) ** WIDTH_EXPONENT)


# --------------------------------------------------------------------------- server state


class PinnedShmem:
    """A file in /dev/shm as large as the pinned GPU memory x scale (an iGPU's GPU memory is
    shmem in the container's cgroup); written with real bytes, only ever grown."""

    def __init__(self, directory: Path, scale: float) -> None:
        self.path = directory / f"cardshare-ovms-standin-pinned-{os.getpid()}"
        self.scale = scale
        self.size = 0
        self.lock = threading.Lock()

    def grow_to(self, resident: int) -> None:
        want = int(resident * self.scale)
        with self.lock:
            if want <= self.size:
                return
            block = b"\x5a" * (1024 * 1024)
            with self.path.open("ab") as handle:
                remaining = want - self.size
                while remaining > 0:
                    part = block[: min(remaining, len(block))]
                    handle.write(part)
                    remaining -= len(part)
            self.size = want

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


class Server:
    """The servables, the card registration and the counters behind the endpoints."""

    def __init__(
        self, settings: Settings, servables: Sequence[Servable], card: SimClient | None
    ) -> None:
        self.settings = settings
        self.servables = {s.name: s for s in servables}
        self.order = [s.name for s in servables]
        self.card = card
        self.lock = threading.Lock()
        self.busy_gpu = 0
        self.peak_bytes = 0
        self.shmem = (
            PinnedShmem(settings.shmem_dir, settings.shmem_scale)
            if settings.shmem_scale > 0
            else None
        )
        self._sync_memory()

    # memory ------------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        return sum(
            s.baseline_bytes + s.pool_bytes + s.in_flight_bytes
            for s in self.servables.values()
            if s.on_gpu
        )

    def settled_bytes(self) -> int:
        return sum(s.baseline_bytes + s.pool_bytes for s in self.servables.values() if s.on_gpu)

    def _sync_memory(self) -> None:
        """Push the resident figure to the card and the pinned file (call with the lock or
        before the server runs)."""
        resident = self.resident_bytes()
        self.peak_bytes = max(self.peak_bytes, resident)
        if self.card is not None:
            self.card.set_vram(resident)
        if self.shmem is not None:
            self.shmem.grow_to(self.settled_bytes())

    def memory(self) -> dict[str, Any]:
        with self.lock:
            return {
                "simulation": True,
                "resident_bytes": self.resident_bytes(),
                "peak_bytes": self.peak_bytes,
                "servables": {
                    name: {
                        "device": s.device or (s.options.target_device if s.options else None),
                        "state": s.state,
                        "baseline_bytes": s.baseline_bytes if s.on_gpu else 0,
                        "pool_bytes": s.pool_bytes if s.on_gpu else 0,
                        "in_flight_bytes": s.in_flight_bytes if s.on_gpu else 0,
                    }
                    for name, s in ((n, self.servables[n]) for n in self.order)
                },
            }

    # inference ---------------------------------------------------------------------------

    def infer(self, servable: Servable, rows: int, cost: int) -> None:
        """Hold one of the servable's streams for the simulated inference time; a GPU call's
        new pool is allocated while the old one is still held, then kept (the ratchet)."""
        with servable.streams:
            with self.lock:
                if servable.on_gpu:
                    if cost > servable.pool_bytes:
                        servable.in_flight_bytes = cost
                    self.busy_gpu += 1
                    if self.card is not None:
                        self.card.set_busy({"ccs": 1.0})
                    self._sync_memory()
            try:
                delay = self.settings.infer_seconds + self.settings.infer_seconds_per_item * rows
                if delay > 0:
                    time.sleep(delay)
            finally:
                with self.lock:
                    if servable.on_gpu:
                        servable.pool_bytes = max(servable.pool_bytes, cost)
                        servable.in_flight_bytes = 0
                        self.busy_gpu -= 1
                        if self.card is not None and self.busy_gpu == 0:
                            self.card.set_busy({})
                        self._sync_memory()

    # status documents ----------------------------------------------------------------------

    def config_status(self) -> str:
        return config_status_text([(n, self.servables[n].public_state()) for n in self.order])

    def metrics(self) -> str:
        """Prometheus text with OVMS's MediaPipe metric families (docs/metrics.md)."""
        with self.lock:
            rows = [
                (n, s.in_process, s.accepted, s.rejected, s.responses, s.graph_errors)
                for n, s in ((n, self.servables[n]) for n in self.order)
            ]
        families = [
            ("ovms_current_graphs", "gauge", "Number of MediaPipe graphs in process.", 1),
            (
                "ovms_requests_accepted",
                "counter",
                "Number of accepted requests which ended up inserting packet(s) into the "
                "MediaPipe graph.",
                2,
            ),
            (
                "ovms_requests_rejected",
                "counter",
                "Number of rejected requests which did not end up being inserted into the "
                "MediaPipe graph.",
                3,
            ),
            (
                "ovms_responses",
                "counter",
                "Number of responses generated by the MediaPipe graph.",
                4,
            ),
            (
                "ovms_graph_error",
                "counter",
                "Number of errors generated by the MediaPipe graph.",
                5,
            ),
        ]
        out = ["# SIMULATION: cardshare lab stand-in for OpenVINO Model Server"]
        for metric, kind, help_text, column in families:
            out += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
            for row in rows:
                name, value = row[0], row[column]
                if metric == "ovms_current_graphs":
                    out.append(f'{metric}{{name="{name}"}} {value}')
                    continue
                for method, count in (("Unary", value), ("Stream", 0)):
                    out.append(
                        f'{metric}{{api="V3",interface="REST",method="{method}",name="{name}"}} '
                        f"{count}"
                    )
        return "\n".join(out) + "\n"


def config_status_text(entries: Sequence[tuple[str, tuple[str, str]]]) -> str:
    """``GET /v1/config`` byte for byte in ``serializeModelsStatuses2Json()``'s layout (see
    ``tests/fixtures/ovms/v1-config.*.json``)."""
    blocks = []
    for name, (state, code) in entries:
        blocks.append(
            f"{json.dumps(name)} : \n"
            "{\n"
            ' "model_version_status": [\n'
            "  {\n"
            '   "version": "1",\n'
            f'   "state": "{state}",\n'
            '   "status": {\n'
            f'    "error_code": "{code}",\n'
            f'    "error_message": "{code}"\n'
            "   }\n"
            "  }\n"
            " ]\n"
            "}"
        )
    return "{\n" + ",\n".join(blocks) + "\n}"


# --------------------------------------------------------------------------- HTTP


class Refusal(Exception):
    """An HTTP error answer: status and the ``error`` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _mp_failure(node: str, code: str, message: str) -> Refusal:
    """A calculator's failure as the REST layer returns it (MEDIAPIPE_EXECUTION_ERROR, 400)."""
    return Refusal(
        400,
        f"{MEDIAPIPE_EXECUTION_FAILED}{code}: CalculatorGraph::Run() failed: \n"
        f'Calculator::Process() for node "{node}" failed: {message}',
    )


class OvmsHandler(Handler):
    server: OvmsServer

    @property
    def state(self) -> Server:
        return self.server.state

    def read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return read_chunked(self.rfile)
        return super().read_body()

    def _refuse(self, refusal: Refusal) -> None:
        log(
            "info",
            "serving",
            f"Processing HTTP/REST request failed: {self.command} {self.path_only}. "
            f"Reason: {refusal.message}",
        )
        self.send_json(refusal.status, {"error": refusal.message})

    def do_GET(self) -> None:
        path = self.path_only
        if path in ("/v2/health/ready", "/v2/health/live"):
            self.send_bytes(200, b"")
            return
        match = re.fullmatch(r"/v2/models/([^/]+)(?:/versions/(\d+))?/ready", path)
        if match:
            servable = self.state.servables.get(match.group(1))
            if servable is None:
                self._refuse(Refusal(404, MODEL_NAME_MISSING))
            elif not servable.available:
                self._refuse(Refusal(404, MODEL_VERSION_NOT_LOADED_YET))
            else:
                self.send_bytes(200, b"")
            return
        if path == "/v1/config":
            self.send_bytes(200, self.state.config_status().encode())
            return
        if path == "/metrics":
            if not self.state.settings.metrics:
                self._refuse(Refusal(400, INVALID_URL))
                return
            body = self.state.metrics().encode()
            self.send_bytes(200, body, "text/plain")
            return
        if path == "/standin/memory":
            self.send_json(200, self.state.memory())
            return
        self._refuse(Refusal(400, INVALID_URL))

    def do_POST(self) -> None:
        path = self.path_only
        try:
            raw = self.read_body()
        except BadChunkedBody:
            self.close_connection = True
            self.send_json(400, {"error": "Invalid chunked request body"})
            return
        kinds = {
            "/v3/embeddings": "embeddings",
            "/v3/v1/embeddings": "embeddings",
            "/v3/rerank": "rerank",
            "/v3/v1/rerank": "rerank",
        }
        kind = kinds.get(path)
        if kind is None:
            self._refuse(Refusal(400, INVALID_URL))
            return
        try:
            request, servable = self._admit(raw)
            self._run(kind, request, servable)
        except Refusal as refusal:
            self._refuse(refusal)

    def _admit(self, raw: bytes) -> tuple[dict[str, Any], Servable]:
        """``createV3HttpPayload`` and ``MediapipeFactory::create``: JSON, model, servable."""
        try:
            request = json.loads(raw)
        except ValueError:
            raise Refusal(412, JSON_INVALID + "Cannot parse JSON body") from None
        if not isinstance(request, dict):
            raise Refusal(412, JSON_INVALID + "JSON body must be an object")
        if "model" not in request:
            raise Refusal(412, JSON_INVALID + "model field is missing in JSON body")
        if not isinstance(request["model"], str):
            raise Refusal(412, JSON_INVALID + "model field is not a string")
        servable = self.state.servables.get(request["model"])
        if servable is None:
            raise Refusal(404, MEDIAPIPE_NAME_MISSING)
        if not servable.available:
            raise Refusal(500, MEDIAPIPE_NOT_LOADED_YET)
        return request, servable

    def _run(self, kind: str, request: dict[str, Any], servable: Servable) -> None:
        state = self.state
        assert servable.options is not None
        with state.lock:
            servable.accepted += 1
            servable.in_process += 1
        try:
            try:
                if servable.options.kind != kind:
                    # the graph's calculator gets a payload it does not understand
                    message = (
                        "query field is missing in request"
                        if servable.options.kind == "rerank"
                        else "Input is empty"
                    )
                    raise _mp_failure(servable.options.node_name, "INVALID_ARGUMENT", message)
                if kind == "rerank":
                    payload = self._rerank(request, servable)
                else:
                    payload = self._embeddings(request, servable)
            except Refusal:
                with state.lock:
                    servable.graph_errors += 1
                raise
            with state.lock:
                servable.responses += 1
            self.send_json(200, payload)
        finally:
            with state.lock:
                servable.in_process -= 1

    def _embeddings(self, request: Mapping[str, Any], servable: Servable) -> dict[str, Any]:
        options = servable.options
        assert options is not None
        node = options.node_name
        raw = request.get("input")
        if raw is None or raw == "" or raw == []:
            raise _mp_failure(node, "INVALID_ARGUMENT", "Input is empty")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise _mp_failure(
                node, "INVALID_ARGUMENT", "Input should be string or array of strings"
            )
        lengths = [len(words(t)) + EMBED_SPECIAL_TOKENS for t in texts]
        if not options.truncate:
            for length in lengths:
                if length > servable.window:
                    raise _mp_failure(
                        node,
                        "INVALID_ARGUMENT",
                        f"Input length {length} longer than allowed {servable.window}",
                    )
        width = min(max(lengths), servable.window)
        self.state.infer(servable, len(texts), embed_cost_bytes(len(texts), width))
        data = [
            {
                "object": "embedding",
                "embedding": embed(t, options.normalize_embeddings),
                "index": i,
            }
            for i, t in enumerate(texts)
        ]
        tokens = sum(min(n, servable.window) for n in lengths)
        return {
            "object": "list",
            "data": data,
            "model": request.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def _rerank(self, request: Mapping[str, Any], servable: Servable) -> dict[str, Any]:
        """``RerankHandler::parseRequest`` checks, then the calculator's chunking and scores."""
        options = servable.options
        assert options is not None
        node = options.node_name

        def invalid(message: str) -> Refusal:
            return _mp_failure(node, "INVALID_ARGUMENT", message)

        query = request.get("query")
        if "query" not in request:
            raise invalid("query field is missing in request")
        if not isinstance(query, str):
            raise invalid("query is not a string")
        if "documents" not in request:
            raise invalid("documents field is missing in request")
        raw_docs = request["documents"]
        if not isinstance(raw_docs, list):
            raise invalid("documents is not an array")
        documents: list[str] = []
        for doc in raw_docs:
            if isinstance(doc, str):
                documents.append(doc)
            elif isinstance(doc, dict):
                raise invalid("document map not supported (stand-in: string documents only)")
            else:
                raise invalid("documents array element is neither string nor object")
        top_n = request.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool)):
            raise invalid("top_n accepts integer values")
        return_documents = request.get("return_documents")
        if return_documents is not None and not isinstance(return_documents, bool):
            raise invalid("return_documents accepts boolean values")
        try:
            plan = chunk_plan(query, documents, servable.window, options.max_allowed_chunks)
        except ValueError as exc:
            raise _mp_failure(node, "INTERNAL", str(exc)) from None
        rows = len(plan.chunks)
        self.state.infer(servable, rows, rerank_cost_bytes(rows, plan.width))
        style = self.state.settings.rerank_style
        scores = [0.0] * len(documents)
        for index, text in plan.chunks:
            scores[index] = max(scores[index], relevance(query, text, style))
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        limit = len(documents) if top_n is None else max(top_n, 0)
        results: list[dict[str, Any]] = []
        for i in order[:limit]:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if return_documents:
                item["document"] = {"text": documents[i]}
            results.append(item)
        return {"results": results}


class OvmsServer(StandinServer):
    def __init__(self, address: tuple[str, int], state: Server) -> None:
        self.state = state
        super().__init__(address, OvmsHandler)


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if env is None else env)
    args = list(sys.argv[1:] if argv is None else argv)
    print("SIMULATION: cardshare lab stand-in for OpenVINO Model Server (no model runs here)")
    sys.stdout.flush()
    try:
        settings = prepare(args, environ)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    log("info", "serving", f"OpenVINO Model Server {VERSION}")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        servables = load_repository(settings.config_path)
    except StartupError as exc:
        log("error", "modelmanager", str(exc))
        return 1
    # loading (compiling for the device) takes a while; the REST port is bound only after it
    if stop.wait(max(settings.load_seconds - (time.monotonic() - started), 0)):
        return 0
    card = SimClient(comm=COMM, cmdline=["/ovms/bin/ovms", *args])
    on_gpu = any(s.on_gpu for s in servables)
    if card.card is None:
        log("info", "standin", f"SIMULATION: no simulated card under {card.root}; not registering")
    elif not on_gpu:
        log("info", "standin", "SIMULATION: no servable on GPU; not registering on the card")
    registered = False
    if on_gpu:
        try:
            registered = card.register(vram=0)
        except OSError as exc:  # e.g. a root uid 5000 (the image's user) cannot write
            log("error", "standin", f"SIMULATION: cannot register on the card: {exc}")
    state = Server(settings, servables, card if registered else None)
    try:
        server = OvmsServer((settings.bind, settings.rest_port), state)
    except OSError as exc:
        log(
            "error",
            "serving",
            f"Failed to start REST server at {settings.bind}:{settings.rest_port}",
        )
        log("error", "serving", str(exc))
        card.close()
        return 1
    serve_in_thread(server)
    log("info", "serving", f"REST server listening on port {settings.rest_port} with 1 threads")
    log("info", "serving", f"Started REST server at {settings.bind}:{settings.rest_port}")
    stop.wait()
    server.shutdown()
    server.server_close()
    if state.shmem is not None:
        state.shmem.remove()
    card.close(settings.release_seconds if registered else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
