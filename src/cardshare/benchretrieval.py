"""``cardshare bench retrieval``: latency and throughput of OpenVINO Model Server's
embeddings and rerank, in a record that can contradict its own headline.

Three scenarios, each warmed up at its own shape and then timed:

``rerank``
    ``POST {base}/v3/rerank`` ``{"model", "query", "documents": [N documents]}``; the answer
    must be ``{"results": [{"index", "relevance_score"}, ...]}`` with one result per document.
``embed-single``
    ``POST {base}/v3/embeddings`` ``{"model", "input": "<one text>"}``: the one-off call,
    dominated by request overhead rather than compute.
``embed-batch``
    the same with ``"input": [B texts]``; the answer must be OpenAI-shaped, ``{"data":
    [{"embedding": [...], "index": i}, ...]}`` with one vector per input, all of one dimension
    (read from the answer, never assumed).

The record: the numbers alone are a rate that belongs to a request nobody can identify, so
:class:`BenchRecord` takes as keyword-only inputs with no defaults the base URL, the UTC time,
the server's ``/v1/config`` snapshot, the payload shape (:class:`PayloadShape`: documents,
tokens per document, batch), the client concurrency, the arm claimed and the result of checking
it. A result cannot be assembled without its evidence, and the JSON output is that record plus
the results.

The arm: ``--arm gpu|cpu`` is what the operator believes; it is checked where something can
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

Method (also written into every record, ``method``): latency is per request, from sending it
to reading the last byte of the answer, over a new TCP connection per request (as a curl loop
makes; no proxy from the environment); the answer is parsed and checked after the clock
stops. p50 and p95 interpolate linearly between closest ranks (R's type 7, numpy's default,
``statistics.quantiles(method="inclusive")``) over the successful timed requests. Items per
second are the items of the successful timed requests over the wall time of the whole timed
phase, failed requests' time included. Warm-up requests go one at a time before each
scenario's timed phase and are not in the statistics. Concurrency C is C client threads, each
sending its next request as soon as its previous one is answered (a closed loop), until the
timed requests are spent. Tokens are approximated: each text is that many words drawn
deterministically from a fixed list of common lower-case English words, which the
XLM-RoBERTa SentencePiece vocabulary of ``bge-m3`` and ``bge-reranker-v2-m3`` is expected to
hold as about one piece each (not checked against the tokenizer here); the server's own count
for embeddings (``usage.prompt_tokens``) is recorded beside it. Eight payloads of the same
shape are cycled so consecutive requests do not carry the same text.

Failures are counted per kind, never raised: ``http_status`` (a non-2xx answer, with the
server's ``{"error": ...}`` text, such as the rerank guard's ``Chunking failed: exceeding
max_allowed_chunks after chunking limit: 64; actual: 100``), ``bad_answer`` (not JSON, the
wrong shape, the wrong number of results or vectors), ``timeout`` (no answer within the
timeout, applied to the connect and to each read) and ``connection`` (refused, reset, closed
without an answer). Before timing, each model must answer ``/v2/models/<name>/ready`` with 200
(``/v2/health/ready`` says 200 while a model failed to load); a model that does not stops the
run with its state from ``/v1/config``. A scenario whose timed requests all failed makes the
run fail (exit 1) after the record is written.

Standard library only (``http.client``, threads, ``json``), like the modules the recorder's
zipapp packs, so the benchmark can run on a bare ``python3`` next to the server.
"""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import quote, urlsplit

__all__ = [
    "ARMS",
    "FAILURE_KINDS",
    "SCENARIOS",
    "ArmCheck",
    "BenchError",
    "BenchOptions",
    "BenchRecord",
    "LatencyStats",
    "PayloadShape",
    "Report",
    "ScenarioResult",
    "TransportError",
    "check_arm",
    "check_embeddings_answer",
    "check_rerank_answer",
    "emit",
    "format_table",
    "graph_target_devices",
    "http_transport",
    "latency_stats",
    "quantile",
    "run",
]

SCHEMA = "cardshare.bench.retrieval/1"
ARMS = ("gpu", "cpu")
RERANK = "rerank"
EMBED_SINGLE = "embed-single"
EMBED_BATCH = "embed-batch"
SCENARIOS = (RERANK, EMBED_SINGLE, EMBED_BATCH)
FAILURE_KINDS = ("http_status", "bad_answer", "timeout", "connection")

AGREES = "agrees"
PARTLY = "partly checked"
NOT_CHECKED = "not checked"
CONTRADICTED = "contradicted"

#: Distinct payloads of one shape, cycled over the requests of a scenario.
ROTATION = 8
#: Words in the rerank query.
QUERY_WORDS = 8
#: Distinct failure messages kept per scenario (the rest are counted under "other").
MAX_MESSAGES = 5
#: Distinct server token counts kept per scenario.
MAX_TOKEN_COUNTS = 10

METHOD = {
    "utc_time": "when the /v1/config snapshot was taken, before anything was timed",
    "latency": (
        "per request, from sending it to reading the last byte of the answer; a new TCP "
        "connection per request (as a curl loop makes), no proxy; the answer is parsed and "
        "checked after the clock stops"
    ),
    "quantiles": (
        "p50 and p95 by linear interpolation between closest ranks (R type 7, numpy's default, "
        "statistics.quantiles method='inclusive') over the successful timed requests"
    ),
    "items_per_second": (
        "items of the successful timed requests divided by the wall time of the whole timed "
        "phase, failed requests' time included"
    ),
    "warmup": (
        "sent one at a time before each scenario's timed phase, at that scenario's shape; not "
        "in the statistics"
    ),
    "concurrency": (
        "C client threads, each sending its next request as soon as its previous one is "
        "answered, until the timed requests are spent"
    ),
    "timeout": "applied to the connect and to each read of a request",
    "tokens": (
        "a text of T tokens is T words drawn deterministically from a fixed list of common "
        "lower-case English words, expected to be about one SentencePiece piece each in the "
        "XLM-RoBERTa vocabulary of bge-m3 and bge-reranker-v2-m3 (not checked against the "
        "tokenizer); the tokenizer adds its own <s> and </s>; for embeddings the server's count "
        "(usage.prompt_tokens) is recorded in the results"
    ),
    "payloads": f"{ROTATION} payloads of the same shape are cycled over the requests",
}

# Common words; the texts are drawn from these by a fixed generator, so a given shape always
# produces the same bytes.
_WORD_LIST = (
    "river stone light market garden window paper music forest winter summer bridge letter "
    "table water mountain city road school family house morning evening village harbour "
    "island field flower train station kitchen bread coffee cloud rain snow wind sun moon "
    "star night day week year history story picture colour green blue red white black small "
    "large old new long short early late quiet open warm cold fresh simple clear strong north "
    "south east west town street park library museum teacher student doctor farmer worker "
    "friend child mother father brother sister animal horse bird fish tree leaf grass sand "
    "shore boat ship wall door floor chair book word song game team plan price office machine "
    "engine wheel metal glass wood cotton salt sugar fruit apple lemon"
)
WORDS = tuple(_WORD_LIST.split())


class BenchError(Exception):
    """A run that cannot go on, one line that names the fix (exit 1)."""


class TransportError(Exception):
    """No HTTP answer: ``kind`` is ``timeout`` or ``connection``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Transport(Protocol):
    """One HTTP request: (status, body) of any answer, else :class:`TransportError`."""

    def __call__(
        self, method: str, url: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]: ...


Clock = Callable[[], float]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _require_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    assert isinstance(value, int)
    if value < minimum:
        raise ValueError(f"{name} must be {minimum} or more, got {value}")


def _base_url_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a str, got {type(value).__name__}"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be http(s)://HOST[:PORT], got {value!r}"
    if parts.query or parts.fragment or value.endswith("/"):
        return f"must have no query, fragment or trailing slash, got {value!r}"
    return None


# -- the record --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PayloadShape:
    """What each request carries: rerank ``documents`` per request, ``tokens_per_document``
    in every text (documents and embedding inputs), embedding inputs per batched request."""

    documents: int
    tokens_per_document: int
    batch: int

    def __post_init__(self) -> None:
        _require_int("documents", self.documents, 1)
        _require_int("tokens_per_document", self.tokens_per_document, 1)
        _require_int("batch", self.batch, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "tokens_per_document": self.tokens_per_document,
            "batch": self.batch,
            "query_tokens": QUERY_WORDS,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmCheck:
    """The arm claimed and what was found: ``verdict`` is ``agrees`` (every model agreed by
    at least one source), ``partly checked``, ``not checked`` or ``contradicted``;
    ``checked`` says what was compared and with what, ``not_checked`` what could not be and
    why."""

    arm: str
    verdict: str
    checked: tuple[str, ...]
    not_checked: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.verdict not in (AGREES, PARTLY, NOT_CHECKED, CONTRADICTED):
            raise ValueError(f"unknown verdict {self.verdict!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm,
            "verdict": self.verdict,
            "checked": list(self.checked),
            "not_checked": list(self.not_checked),
        }


@dataclass(frozen=True, kw_only=True)
class BenchRecord:
    """The evidence a measurement carries. Every field is a required keyword argument with no
    default, and each is checked: a record cannot be made without the base URL, the UTC time,
    the ``/v1/config`` snapshot, the payload shape and the client concurrency."""

    base_url: str
    utc_time: datetime
    server_config: Mapping[str, Any]
    payload: PayloadShape
    concurrency: int
    arm: str
    arm_check: ArmCheck
    models: Mapping[str, str]
    scenarios: tuple[str, ...]
    warmup: int
    iterations: int
    timeout_seconds: float

    def __post_init__(self) -> None:
        problem = _base_url_problem(self.base_url)
        if problem is not None:
            raise ValueError(f"base_url {problem}")
        if not isinstance(self.utc_time, datetime):
            raise TypeError(f"utc_time must be a datetime, got {type(self.utc_time).__name__}")
        if self.utc_time.utcoffset() != timedelta(0):
            raise ValueError(f"utc_time must be timezone-aware UTC, got {self.utc_time!r}")
        if not isinstance(self.server_config, Mapping):
            raise TypeError(
                "server_config must be the /v1/config answer (an object), got "
                f"{type(self.server_config).__name__}"
            )
        try:  # a private, JSON-clean copy: the record is what was seen, not a live reference
            snapshot = json.loads(json.dumps(self.server_config, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"server_config is not JSON data: {exc}") from None
        object.__setattr__(self, "server_config", snapshot)
        if not isinstance(self.payload, PayloadShape):
            raise TypeError(f"payload must be a PayloadShape, got {type(self.payload).__name__}")
        _require_int("concurrency", self.concurrency, 1)
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if not isinstance(self.arm_check, ArmCheck):
            raise TypeError(f"arm_check must be an ArmCheck, got {type(self.arm_check).__name__}")
        if self.arm_check.arm != self.arm:
            raise ValueError(f"arm_check is for arm {self.arm_check.arm}, not {self.arm}")
        if not isinstance(self.models, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in self.models.items()
        ):
            raise TypeError("models must map each role to a model name")
        object.__setattr__(self, "models", dict(self.models))
        if (
            not isinstance(self.scenarios, tuple)
            or not self.scenarios
            or any(s not in SCENARIOS for s in self.scenarios)
        ):
            raise ValueError(f"scenarios must be a non-empty tuple of {', '.join(SCENARIOS)}")
        _require_int("warmup", self.warmup, 0)
        _require_int("iterations", self.iterations, 1)
        if not _is_number(self.timeout_seconds) or not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be above 0, got {self.timeout_seconds!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "utc_time": self.utc_time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "server_config": self.server_config,
            "payload": self.payload.as_dict(),
            "concurrency": self.concurrency,
            "arm": self.arm,
            "arm_check": self.arm_check.as_dict(),
            "models": dict(self.models),
            "scenarios": list(self.scenarios),
            "warmup": self.warmup,
            "iterations": self.iterations,
            "timeout_seconds": self.timeout_seconds,
            "method": dict(METHOD),
        }


# -- statistics --------------------------------------------------------------------------------


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values by linear interpolation between closest ranks
    (R type 7, numpy's default, ``statistics.quantiles(method="inclusive")``)."""
    if not ordered:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within 0..1, got {q}")
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Latencies of the successful timed requests, in milliseconds."""

    n: int
    min_ms: float
    p50_ms: float
    p95_ms: float
    max_ms: float
    mean_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "min_ms": round(self.min_ms, 3),
            "p50_ms": round(self.p50_ms, 3),
            "p95_ms": round(self.p95_ms, 3),
            "max_ms": round(self.max_ms, 3),
            "mean_ms": round(self.mean_ms, 3),
        }


def latency_stats(seconds: Sequence[float]) -> LatencyStats | None:
    """p50, p95 and the rest of latencies given in seconds; None for none."""
    if not seconds:
        return None
    ms = sorted(s * 1000.0 for s in seconds)
    return LatencyStats(
        n=len(ms),
        min_ms=ms[0],
        p50_ms=quantile(ms, 0.50),
        p95_ms=quantile(ms, 0.95),
        max_ms=ms[-1],
        mean_ms=math.fsum(ms) / len(ms),
    )


# -- payloads ----------------------------------------------------------------------------------


def make_text(words: int, seed: int) -> str:
    """``words`` words from :data:`WORDS`, the same for the same seed on every platform."""
    x = (seed * 2654435761 + 1) & 0x7FFFFFFF
    out = []
    for _ in range(words):
        x = (1103515245 * x + 12345) & 0x7FFFFFFF
        out.append(WORDS[(x >> 8) % len(WORDS)])
    return " ".join(out)


def _texts(count: int, words: int, variant: int) -> list[str]:
    return [make_text(words, variant * 100_003 + n * 7_919 + 17) for n in range(count)]


def rerank_body(model: str, payload: PayloadShape, variant: int) -> bytes:
    doc = {
        "model": model,
        "query": make_text(QUERY_WORDS, variant * 100_003 + 5),
        "documents": _texts(payload.documents, payload.tokens_per_document, variant),
    }
    return json.dumps(doc).encode("utf-8")


def embeddings_body(model: str, inputs: int | None, tokens: int, variant: int) -> bytes:
    """One text as a string when ``inputs`` is None (the one-off call), else a list."""
    texts = _texts(1 if inputs is None else inputs, tokens, variant)
    doc = {"model": model, "input": texts[0] if inputs is None else texts}
    return json.dumps(doc).encode("utf-8")


# -- answers -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """What a 2xx answer held: ``problem`` when it is not the expected document."""

    problem: str | None
    dimension: int | None = None
    prompt_tokens: int | None = None


def _json_object(data: bytes, what: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeError):
        return None, f"{what} answer is not JSON: {data[:60]!r}"
    if not isinstance(doc, dict):
        return None, f"{what} answer is a JSON {type(doc).__name__}, not an object"
    return doc, None


def check_rerank_answer(data: bytes, documents: int) -> Answer:
    """``{"results": [{"index", "relevance_score"}]}`` with one result per document."""
    doc, problem = _json_object(data, "the rerank")
    if doc is None:
        return Answer(problem)
    results = doc.get("results")
    if not isinstance(results, list):
        return Answer("the rerank answer has no results list")
    if len(results) != documents:
        return Answer(f"the rerank answer has {len(results)} results for {documents} documents")
    seen: set[int] = set()
    for n, item in enumerate(results):
        if not isinstance(item, dict):
            return Answer(f"rerank result {n} is not an object")
        index, score = item.get("index"), item.get("relevance_score")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < documents:
            return Answer(f"rerank result {n} has index {index!r}, not 0..{documents - 1}")
        if index in seen:
            return Answer(f"rerank results name document {index} twice")
        seen.add(index)
        if not _is_number(score):
            return Answer(f"rerank result {n} has relevance_score {score!r}, not a number")
    return Answer(None)


def check_embeddings_answer(data: bytes, inputs: int) -> Answer:
    """``{"data": [{"embedding": [...], "index": i}]}``: one vector per input, one dimension."""
    doc, problem = _json_object(data, "the embeddings")
    if doc is None:
        return Answer(problem)
    items = doc.get("data")
    if not isinstance(items, list):
        return Answer("the embeddings answer has no data list")
    if len(items) != inputs:
        return Answer(f"the embeddings answer has {len(items)} vectors for {inputs} inputs")
    dimensions: set[int] = set()
    indexes: set[int] = set()
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            return Answer(f"embeddings item {n} is not an object")
        vector, index = item.get("embedding"), item.get("index")
        if not isinstance(vector, list) or not vector or not all(map(_is_number, vector)):
            return Answer(f"embeddings item {n} has no vector of numbers")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < inputs:
            return Answer(f"embeddings item {n} has index {index!r}, not 0..{inputs - 1}")
        dimensions.add(len(vector))
        indexes.add(index)
    if len(indexes) != inputs:
        return Answer("embeddings items repeat an index")
    if len(dimensions) != 1:
        return Answer(f"embeddings vectors differ in dimension: {sorted(dimensions)}")
    usage = doc.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return Answer(None, dimensions.pop(), tokens if _is_int(tokens) else None)


def error_text(data: bytes) -> str:
    """OVMS's ``{"error": "..."}`` message, else the body's text, on one line."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        text = doc["error"]
    else:
        text = data.decode("utf-8", "replace")
    text = " ".join(text.split())
    if not text:
        return "(no body)"
    return text if len(text) <= 300 else text[:300] + "..."


# -- HTTP --------------------------------------------------------------------------------------


def http_transport(method: str, url: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    """One request on a new connection (no proxy from the environment); any status is
    returned, the absence of an answer raises :class:`TransportError`."""
    parts = urlsplit(url)
    factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = factory(parts.hostname or "", parts.port, timeout=timeout)
    path = parts.path or "/"
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError:
        raise TransportError("timeout", f"no answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise TransportError("connection", "connection refused") from None
    except http.client.RemoteDisconnected:
        raise TransportError("connection", "closed without an answer") from None
    except (OSError, http.client.HTTPException) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TransportError("connection", detail or type(exc).__name__) from None
    finally:
        conn.close()


# -- the arm -----------------------------------------------------------------------------------

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
        raise BenchError(
            f"cannot read the model repository's {config_path}: {exc.strerror or exc}; "
            "--repository takes the exported repository the server serves (its config.json)"
        ) from None
    except (ValueError, UnicodeError) as exc:
        raise BenchError(f"the model repository's {config_path} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BenchError(f"the model repository's {config_path} is not a JSON object")
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
) -> ArmCheck:
    """Compare ``arm`` with every device the server reports for ``models`` and, with a
    ``repository``, with each model's ``graph.pbtxt``; say what could not be compared."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
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
        verdict = CONTRADICTED
    elif models and agreed == set(models):
        verdict = AGREES
    elif agreed:
        verdict = PARTLY
    else:
        verdict = NOT_CHECKED
    return ArmCheck(
        arm=arm, verdict=verdict, checked=tuple(checked), not_checked=tuple(not_checked)
    )


# -- running -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """A run's settings (the command line's defaults live in ``cardshare.cli.bench``)."""

    base_url: str
    arm: str
    repository: Path | None
    rerank_model: str
    embeddings_model: str
    payload: PayloadShape
    concurrency: int
    warmup: int
    iterations: int
    timeout: float
    scenarios: tuple[str, ...]

    def models(self) -> dict[str, str]:
        roles = {}
        if RERANK in self.scenarios:
            roles["rerank"] = self.rerank_model
        if EMBED_SINGLE in self.scenarios or EMBED_BATCH in self.scenarios:
            roles["embeddings"] = self.embeddings_model
        return roles


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    path: str
    model: str
    items: int
    bodies: tuple[bytes, ...]
    check: Callable[[bytes], Answer]


def build_scenarios(options: BenchOptions) -> list[Scenario]:
    p = options.payload
    out = []
    for name in options.scenarios:
        if name == RERANK:
            bodies = tuple(rerank_body(options.rerank_model, p, v) for v in range(ROTATION))
            out.append(
                Scenario(
                    name,
                    "/v3/rerank",
                    options.rerank_model,
                    p.documents,
                    bodies,
                    functools.partial(check_rerank_answer, documents=p.documents),
                )
            )
        else:
            inputs = None if name == EMBED_SINGLE else p.batch
            bodies = tuple(
                embeddings_body(options.embeddings_model, inputs, p.tokens_per_document, v)
                for v in range(ROTATION)
            )
            items = 1 if inputs is None else inputs
            out.append(
                Scenario(
                    name,
                    "/v3/embeddings",
                    options.embeddings_model,
                    items,
                    bodies,
                    functools.partial(check_embeddings_answer, inputs=items),
                )
            )
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: its latency when an answer came, the failure kind and message if any."""

    seconds: float | None
    failure: str | None = None
    message: str | None = None
    dimension: int | None = None
    prompt_tokens: int | None = None


def attempt(
    scenario: Scenario,
    n: int,
    base_url: str,
    timeout: float,
    transport: Transport,
    clock: Clock,
) -> Outcome:
    body = scenario.bodies[n % len(scenario.bodies)]
    start = clock()
    try:
        status, data = transport("POST", base_url + scenario.path, body, timeout)
    except TransportError as exc:
        return Outcome(None, exc.kind, exc.detail)
    seconds = clock() - start
    if not 200 <= status < 300:
        return Outcome(seconds, "http_status", f"HTTP {status}: {error_text(data)}")
    answer = scenario.check(data)
    if answer.problem is not None:
        return Outcome(seconds, "bad_answer", answer.problem)
    return Outcome(seconds, None, None, answer.dimension, answer.prompt_tokens)


@dataclass(frozen=True, slots=True)
class Tally:
    """Requests sent, answered well, and failed per kind, with the commonest messages."""

    requests: int
    ok: int
    failures: dict[str, int]
    messages: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.requests - self.ok,
            "failures": dict(self.failures),
            "messages": dict(self.messages),
        }


def tally(outcomes: Sequence[Outcome]) -> Tally:
    failures = dict.fromkeys(FAILURE_KINDS, 0)
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.failure is not None:
            failures[o.failure] += 1
            text = f"{o.failure}: {o.message}"
            counts[text] = counts.get(text, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    messages = dict(ranked[:MAX_MESSAGES])
    rest = sum(c for _, c in ranked[MAX_MESSAGES:])
    if rest:
        messages["other"] = rest
    ok = sum(1 for o in outcomes if o.failure is None)
    return Tally(len(outcomes), ok, failures, messages)


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    endpoint: str
    model: str
    items_per_request: int
    warmup: Tally
    timed: Tally
    latency: LatencyStats | None
    wall_seconds: float
    items_per_second: float | None
    requests_per_second: float | None
    embedding_dimensions: tuple[int, ...]
    server_prompt_tokens: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "scenario": self.scenario,
            "endpoint": self.endpoint,
            "model": self.model,
            "items_per_request": self.items_per_request,
            "warmup": self.warmup.as_dict(),
            "timed": self.timed.as_dict(),
            "latency": None if self.latency is None else self.latency.as_dict(),
            "wall_seconds": round(self.wall_seconds, 6),
            "items_per_second": _round(self.items_per_second),
            "requests_per_second": _round(self.requests_per_second),
        }
        if self.endpoint == "/v3/embeddings":
            doc["embedding_dimensions"] = list(self.embedding_dimensions)
            doc["server_prompt_tokens_per_request"] = list(self.server_prompt_tokens)
        return doc


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run_scenario(
    scenario: Scenario,
    *,
    base_url: str,
    warmup: int,
    iterations: int,
    concurrency: int,
    timeout: float,
    transport: Transport,
    clock: Clock,
) -> ScenarioResult:
    """Warm up one request at a time, then send ``iterations`` requests from ``concurrency``
    threads; timed outcomes only make the statistics."""

    def one(n: int) -> Outcome:
        return attempt(scenario, n, base_url, timeout, transport, clock)

    warm = [one(ROTATION - 1 - n % ROTATION) for n in range(warmup)]
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=concurrency, thread_name_prefix="bench"
    ) as pool:
        start = clock()
        timed = list(pool.map(one, range(iterations)))
        wall = clock() - start
    good = [o for o in timed if o.failure is None]
    stats = latency_stats([o.seconds for o in good if o.seconds is not None])
    rate = wall > 0 and bool(good)
    tokens = sorted({o.prompt_tokens for o in good if o.prompt_tokens is not None})
    return ScenarioResult(
        scenario=scenario.name,
        endpoint=scenario.path,
        model=scenario.model,
        items_per_request=scenario.items,
        warmup=tally(warm),
        timed=tally(timed),
        latency=stats,
        wall_seconds=wall,
        items_per_second=len(good) * scenario.items / wall if rate else None,
        requests_per_second=len(good) / wall if rate else None,
        embedding_dimensions=tuple(sorted({o.dimension for o in good if o.dimension})),
        server_prompt_tokens=tuple(tokens[:MAX_TOKEN_COUNTS]),
    )


def fetch_config(base_url: str, timeout: float, transport: Transport) -> dict[str, Any]:
    """``GET /v1/config``: each servable's state, the record's snapshot."""
    url = base_url + "/v1/config"
    try:
        status, data = transport("GET", url, None, timeout)
    except TransportError as exc:
        raise BenchError(
            f"cannot reach OpenVINO Model Server at {base_url}: {exc.detail}; is it running, and "
            "is --base-url its REST address?"
        ) from None
    if status != 200:
        raise BenchError(f"GET {url} answered {status}: {error_text(data)}")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeError):
        doc = None
    if not isinstance(doc, dict):
        raise BenchError(
            f"GET {url} did not answer a JSON object ({data[:60]!r}): is {base_url} OpenVINO "
            "Model Server's REST address?"
        )
    return doc


def servable_state(server_config: Mapping[str, Any], model: str) -> str:
    """A servable's versions and states from ``/v1/config``, on one line."""
    entry = server_config.get(model)
    if not isinstance(entry, dict):
        listed = ", ".join(sorted(server_config)) or "nothing"
        return f"/v1/config does not list it (it lists {listed})"
    parts = []
    for v in entry.get("model_version_status") or []:
        if not isinstance(v, dict):
            continue
        status = v.get("status")
        code = status.get("error_code") if isinstance(status, dict) else None
        message = status.get("error_message") if isinstance(status, dict) else None
        text = f"version {v.get('version')} {v.get('state')}"
        if code not in (None, "OK"):
            text += f" ({code}"
            text += f": {message})" if message and message != code else ")"
        parts.append(text)
    return "/v1/config says " + ("; ".join(parts) if parts else "no version")


def check_ready(
    base_url: str,
    models: Sequence[str],
    server_config: Mapping[str, Any],
    timeout: float,
    transport: Transport,
) -> None:
    """Each model answers ``/v2/models/<name>/ready`` with 200, else :class:`BenchError`."""
    for model in models:
        url = f"{base_url}/v2/models/{quote(model, safe='')}/ready"
        try:
            status, data = transport("GET", url, None, timeout)
        except TransportError as exc:
            raise BenchError(f"GET {url}: {exc.detail}") from None
        if status != 200:
            raise BenchError(
                f"model {model} is not ready at {base_url} (GET /v2/models/{model}/ready "
                f"answered {status}: {error_text(data)}); {servable_state(server_config, model)}"
            )


@dataclass(frozen=True, slots=True)
class Report:
    """The record and the results: the JSON output."""

    record: BenchRecord
    results: tuple[ScenarioResult, ...]

    def problems(self) -> list[str]:
        """Why the run failed: each scenario whose timed requests all failed."""
        out = []
        for r in self.results:
            if r.timed.ok == 0:
                top = next(iter(r.timed.messages), "no requests")
                out.append(
                    f"{r.scenario}: all {r.timed.requests} timed requests to {r.endpoint} "
                    f"({r.model}) failed; commonest: {top}"
                )
        return out

    def as_dict(self) -> dict[str, Any]:
        problems = self.problems()
        return {
            "schema": SCHEMA,
            "record": self.record.as_dict(),
            "results": [r.as_dict() for r in self.results],
            "complete": not problems,
            "problems": problems,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n"


def run(
    options: BenchOptions,
    *,
    transport: Transport = http_transport,
    clock: Clock | None = None,
    now: Callable[[], datetime] | None = None,
    progress: TextIO | None = None,
) -> Report:
    """Snapshot ``/v1/config``, check each model is ready and the arm, then time the
    scenarios. :class:`BenchError` before anything is timed when that cannot go on."""
    tick: Clock = clock if clock is not None else time.perf_counter
    when = now() if now is not None else datetime.now(UTC)
    models = options.models()
    names = sorted(set(models.values()))
    config = fetch_config(options.base_url, options.timeout, transport)
    check_ready(options.base_url, names, config, options.timeout, transport)
    arm_check = check_arm(options.arm, names, config, options.repository, options.base_url)
    if arm_check.verdict == CONTRADICTED:
        said = "; ".join(c for c in arm_check.checked if "CONTRADICTS" in c)
        raise BenchError(
            f"--arm {options.arm} is contradicted, nothing was timed: {said}; check --arm and "
            "--base-url (they change together)"
        )
    record = BenchRecord(
        base_url=options.base_url,
        utc_time=when,
        server_config=config,
        payload=options.payload,
        concurrency=options.concurrency,
        arm=options.arm,
        arm_check=arm_check,
        models=models,
        scenarios=options.scenarios,
        warmup=options.warmup,
        iterations=options.iterations,
        timeout_seconds=options.timeout,
    )
    results = []
    for scenario in build_scenarios(options):
        if progress is not None:
            progress.write(
                f"bench: {scenario.name}: {options.warmup} warm-up, {options.iterations} timed "
                f"({scenario.items} item{'' if scenario.items == 1 else 's'} each, "
                f"concurrency {options.concurrency})\n"
            )
            progress.flush()
        results.append(
            run_scenario(
                scenario,
                base_url=options.base_url,
                warmup=options.warmup,
                iterations=options.iterations,
                concurrency=options.concurrency,
                timeout=options.timeout,
                transport=transport,
                clock=tick,
            )
        )
    return Report(record, tuple(results))


# -- the table ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(report: Report) -> str:
    """A short plain-text summary: context, one row per scenario, the arm check."""
    rec = report.record
    p = rec.payload
    lines = [
        f"bench retrieval {rec.base_url} at {rec.as_dict()['utc_time']}, arm {rec.arm}",
        f"payload: rerank {p.documents} documents, {p.tokens_per_document} tokens each (approx.), "
        f"embeddings batch {p.batch}; concurrency {rec.concurrency}; "
        f"{rec.warmup} warm-up + {rec.iterations} timed per scenario",
    ]
    rows = [("SCENARIO", "MODEL", "ITEMS", "OK", "P50 MS", "P95 MS", "ITEMS/S", "FAILED")]
    for r in report.results:
        failed = ", ".join(f"{k} {v}" for k, v in r.timed.failures.items() if v) or "-"
        rows.append(
            (
                r.scenario,
                r.model,
                str(r.items_per_request),
                f"{r.timed.ok}/{r.timed.requests}",
                _ms(r.latency.p50_ms if r.latency else None),
                _ms(r.latency.p95_ms if r.latency else None),
                _ms(r.items_per_second),
                failed,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.extend(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    for r in report.results:
        if r.embedding_dimensions:
            dims = ", ".join(str(d) for d in r.embedding_dimensions)
            lines.append(f"{r.scenario}: embedding dimension {dims} (read from the answers)")
    check = rec.arm_check
    lines.append(
        f"arm {check.arm}: {check.verdict} ({len(check.checked)} checked, "
        f"{len(check.not_checked)} not checked)"
    )
    lines.extend(f"  checked: {c}" for c in check.checked)
    lines.extend(f"  NOT checked: {c}" for c in check.not_checked)
    return "\n".join(lines) + "\n"


def emit(report: Report, *, out: TextIO, err: TextIO, out_file: Path | None, table: bool) -> int:
    """The JSON to ``out_file`` (atomically) or else to ``out``; the table to ``err``, or to
    ``out`` instead of the JSON with ``table``. Returns the exit code: 1 when a scenario's
    timed requests all failed (said on ``err``), else 0 (failed requests are warned of)."""
    from cardshare.atomicfile import write_atomic

    text = report.to_json()
    if out_file is not None:
        write_atomic(out_file, text.encode("utf-8"))
    elif not table:
        out.write(text)
    (out if table else err).write(format_table(report))
    problems = report.problems()
    for r in report.results:
        failed = r.timed.requests - r.timed.ok
        if failed and r.timed.ok:
            err.write(
                f"cardshare: warning: {r.scenario}: {failed} of {r.timed.requests} timed requests "
                "failed; the statistics are of the others\n"
            )
    for problem in problems:
        err.write(f"cardshare: error: {problem}\n")
    return 1 if problems else 0
