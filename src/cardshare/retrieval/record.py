"""The record of ``cardshare bench retrieval`` (:mod:`cardshare.retrieval.bench`): its
constants, its error, and the evidence every measurement carries.

The numbers alone are a rate that belongs to a request nobody can identify, so
:class:`BenchRecord` takes as keyword-only inputs with no defaults the base URL, the UTC time,
the server's ``/v1/config`` snapshot, the payload shape (:class:`PayloadShape`: documents,
tokens per document, batch), the client concurrency, the arm claimed and the result of checking
it. A result cannot be assembled without its evidence, and the JSON output is that record plus
the results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

ARMS = ("gpu", "cpu")
RERANK = "rerank"
EMBED_SINGLE = "embed-single"
EMBED_BATCH = "embed-batch"
SCENARIOS = (RERANK, EMBED_SINGLE, EMBED_BATCH)

AGREES = "agrees"
PARTLY = "partly checked"
NOT_CHECKED = "not checked"
CONTRADICTED = "contradicted"

#: Distinct payloads of one shape, cycled over the requests of a scenario.
ROTATION = 8
#: Words in the rerank query.
QUERY_WORDS = 8

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


class BenchError(Exception):
    """A run that cannot go on, one line that names the fix (exit 1)."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _require_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value):
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
        if not is_number(self.timeout_seconds) or not self.timeout_seconds > 0:
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
