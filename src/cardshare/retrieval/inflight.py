"""What the watchdog (:mod:`cardshare.retrieval.ratchet`) reads of the requests in flight:
``ovms_current_requests`` plus ``ovms_current_graphs`` of the server's ``/metrics``, parsed
strictly as the Prometheus text format; unknown when that cannot be done."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

#: How long ``/metrics`` may take to answer before in flight is unknown.
METRICS_TIMEOUT_SECONDS = 5.0
#: A larger ``/metrics`` answer is not read (in flight unknown).
METRICS_MAX_BYTES = 8 * 1024 * 1024
#: The gauges of OpenVINO Model Server whose sum is the work in flight (docs/metrics.md).
IN_FLIGHT_METRICS = ("ovms_current_requests", "ovms_current_graphs")

_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_VALUE_RE = re.compile(
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|Inf|inf)|NaN|nan"
)
_TIMESTAMP_RE = re.compile(r"-?[0-9]+")
_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Exposition:
    """A parsed Prometheus text exposition: the ``# TYPE`` of each family and the samples."""

    types: dict[str, str]
    samples: tuple[Sample, ...]


def _blanks(line: str, pos: int) -> int:
    """The position of the first character at or after ``pos`` that is not a blank or tab."""
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return pos


def _labels(line: str, pos: int, number: int) -> tuple[dict[str, str], int]:
    """Parse ``{name="value",...}`` from ``pos`` (just after ``{``); returns the labels and
    the position after ``}``."""
    labels: dict[str, str] = {}

    def bad(what: str) -> ValueError:
        return ValueError(f"line {number}: {what} at column {pos + 1}: {line[:120]!r}")

    while True:
        pos = _blanks(line, pos)
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        found = _LABEL_NAME_RE.match(line, pos)
        if found is None:
            raise bad("expected a label name")
        name = found.group()
        pos = found.end()
        pos = _blanks(line, pos)
        if line[pos : pos + 1] != "=":
            raise bad(f"expected = after label {name}")
        pos = _blanks(line, pos + 1)
        if line[pos : pos + 1] != '"':
            raise bad(f"expected the quoted value of label {name}")
        pos += 1
        value: list[str] = []
        while True:
            if pos >= len(line):
                raise bad(f"unterminated value of label {name}")
            char = line[pos]
            if char == '"':
                pos += 1
                break
            if char == "\\":
                escaped = _ESCAPES.get(line[pos + 1 : pos + 2])
                if escaped is None:
                    raise bad(f"bad escape in the value of label {name}")
                value.append(escaped)
                pos += 2
                continue
            value.append(char)
            pos += 1
        if name in labels:
            raise bad(f"label {name} given twice")
        labels[name] = "".join(value)
        pos = _blanks(line, pos)
        if pos < len(line) and line[pos] == ",":
            pos += 1
            continue
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        raise bad("expected , or }")


def _sample(line: str, number: int) -> Sample:
    found = _METRIC_NAME_RE.match(line)
    if found is None:
        raise ValueError(f"line {number}: not a metric name: {line[:120]!r}")
    name = found.group()
    pos = found.end()
    labels: dict[str, str] = {}
    after_name = _blanks(line, pos)
    if line[after_name : after_name + 1] == "{":
        labels, pos = _labels(line, after_name + 1, number)
    rest = line[pos:]
    if not rest[:1] or rest[:1] not in " \t":
        raise ValueError(f"line {number}: expected a space and a value: {line[:120]!r}")
    # blanks are spaces and tabs only: a carriage return is part of the value (and refused)
    fields = re.split(r"[ \t]+", rest.strip(" \t"))
    if not 1 <= len(fields) <= 2 or _VALUE_RE.fullmatch(fields[0]) is None:
        raise ValueError(f"line {number}: expected a value [timestamp]: {line[:120]!r}")
    if len(fields) == 2 and _TIMESTAMP_RE.fullmatch(fields[1]) is None:
        raise ValueError(f"line {number}: bad timestamp: {line[:120]!r}")
    return Sample(name, labels, float(fields[0]))


def parse_exposition(text: str) -> Exposition:
    """Parse the Prometheus text format (0.0.4) strictly: every line is a comment, a
    ``# HELP``/``# TYPE`` of a valid name (a family typed twice is an error) or a sample
    ``name{labels} value [timestamp]``; anything else raises ``ValueError`` naming the line."""
    types: dict[str, str] = {}
    samples: list[Sample] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line[1:].split(None, 3)
            if len(parts) < 2 or parts[0] not in ("HELP", "TYPE"):
                continue  # a plain comment
            if _METRIC_NAME_RE.fullmatch(parts[1]) is None:
                raise ValueError(f"line {number}: bad metric name {parts[1]!r}")
            if parts[0] == "TYPE":
                if len(parts) != 3 or parts[2] not in _TYPES:
                    raise ValueError(f"line {number}: bad TYPE line: {line[:120]!r}")
                if parts[1] in types:
                    raise ValueError(f"line {number}: {parts[1]} typed twice")
                types[parts[1]] = parts[2]
            continue
        samples.append(_sample(line, number))
    return Exposition(types, tuple(samples))


def in_flight_of(exposition: Exposition) -> float:
    """``ovms_current_requests`` plus ``ovms_current_graphs``, all series summed.

    At least one of the two families must be there (typed, or with samples): a server that
    exports neither (metrics off, or a ``--metrics_list`` without them) cannot say it is idle.
    Raises ``ValueError`` when neither is there, one is typed as something else than a gauge,
    or a value is not a finite number of 0 or more.
    """
    sampled = {s.name for s in exposition.samples}
    present = [n for n in IN_FLIGHT_METRICS if n in exposition.types or n in sampled]
    if not present:
        raise ValueError(
            "the metrics name neither ovms_current_requests nor ovms_current_graphs "
            "(is the server started with --metrics_enable, and --metrics_list, if given, "
            "listing them?)"
        )
    for name in present:
        kind = exposition.types.get(name, "gauge")
        if kind not in ("gauge", "untyped"):
            raise ValueError(f"{name} is a {kind}, not a gauge")
    total = 0.0
    for sample in exposition.samples:
        if sample.name not in IN_FLIGHT_METRICS:
            continue
        if not math.isfinite(sample.value) or sample.value < 0:
            raise ValueError(f"{sample.name}{sample.labels} is {sample.value}")
        total += sample.value
    return total


def fetch_in_flight(
    base_url: str, timeout: float = METRICS_TIMEOUT_SECONDS
) -> tuple[float | None, str]:
    """``(in flight, "")`` from ``<base_url>/metrics``, or ``(None, why)`` when it is unknown:
    no answer (refused, timed out after ``timeout`` seconds), an error status, a body that is
    too large, not UTF-8 or not a valid exposition (:func:`in_flight_of`).  Never raises."""
    # imported here: the recorder's scan stays light
    import http.client
    import urllib.error
    import urllib.request

    url = base_url.rstrip("/") + "/metrics"
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    # no proxy from the environment: the server is local
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    try:
        with opener.open(request, timeout=timeout) as resp:
            chunks: list[bytes] = []
            size = 0
            while True:
                chunk = resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > METRICS_MAX_BYTES:
                    return None, f"GET {url}: the answer is larger than {METRICS_MAX_BYTES} bytes"
                if time.monotonic() > deadline:
                    raise TimeoutError("timed out")
                chunks.append(chunk)
            body = b"".join(chunks)
    except urllib.error.HTTPError as exc:
        exc.close()
        return None, f"GET {url} answered {exc.code}"
    except urllib.error.URLError as exc:
        return None, f"GET {url}: {_no_answer(exc.reason, timeout)}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return None, f"GET {url}: {_no_answer(exc, timeout)}"
    try:
        return in_flight_of(parse_exposition(body.decode("utf-8"))), ""
    except UnicodeDecodeError:
        return None, f"GET {url}: the answer is not UTF-8 text"
    except ValueError as exc:
        return None, f"GET {url}: not a usable exposition: {exc}"


def _no_answer(reason: object, timeout: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__
