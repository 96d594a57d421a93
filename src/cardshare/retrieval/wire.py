"""What ``cardshare bench retrieval`` (:mod:`cardshare.retrieval.bench`) sends to OpenVINO
Model Server and how it reads the answers: the payloads (texts of common words from a fixed
generator, the same bytes for a given shape), the checks of a rerank and an embeddings answer,
the server's error text, and one HTTP request on a new connection."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from cardshare.retrieval.record import QUERY_WORDS, PayloadShape, is_int, is_number

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
        if not is_number(score):
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
        if not isinstance(vector, list) or not vector or not all(map(is_number, vector)):
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
    return Answer(None, dimensions.pop(), tokens if is_int(tokens) else None)


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
