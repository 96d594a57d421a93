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

The record (:mod:`cardshare.retrieval.record`), what is sent and how the answers are read
(:mod:`cardshare.retrieval.wire`) and the check of the arm (:mod:`cardshare.retrieval.arm`)
are modules of their own.

The method, what the figures mean and how the texts are made, is written into every record
(``method``: :data:`cardshare.retrieval.record.METHOD`).

Failures are counted per kind, never raised: ``http_status`` (a non-2xx answer, with the
server's ``{"error": ...}`` text, such as the rerank guard's ``Chunking failed: exceeding
max_allowed_chunks after chunking limit: 64; actual: 100``), ``bad_answer`` (not JSON, the
wrong shape, the wrong number of results or vectors), ``timeout`` (no answer within the
timeout, applied to the connect and to each read) and ``connection`` (refused, reset, closed
without an answer). Before timing, each model must answer ``/v2/models/<name>/ready`` with 200
(``/v2/health/ready`` says 200 while a model failed to load); a model that does not stops the
run with its state from ``/v1/config``. A scenario whose timed requests all failed makes the
run fail (exit 1) after the record is written.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from cardshare.retrieval import wire
from cardshare.retrieval.arm import check_arm
from cardshare.retrieval.record import (
    CONTRADICTED,
    EMBED_BATCH,
    EMBED_SINGLE,
    RERANK,
    ROTATION,
    BenchError,
    BenchRecord,
    PayloadShape,
)

SCHEMA = "cardshare.bench.retrieval/1"
FAILURE_KINDS = ("http_status", "bad_answer", "timeout", "connection")
#: Distinct failure messages kept per scenario (the rest are counted under "other").
MAX_MESSAGES = 5
#: Distinct server token counts kept per scenario.
MAX_TOKEN_COUNTS = 10

Clock = Callable[[], float]


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
    check: Callable[[bytes], wire.Answer]


def build_scenarios(options: BenchOptions) -> list[Scenario]:
    p = options.payload
    out = []
    for name in options.scenarios:
        if name == RERANK:
            bodies = [wire.rerank_body(options.rerank_model, p, v) for v in range(ROTATION)]
            check = functools.partial(wire.check_rerank_answer, documents=p.documents)
            path, model, items = "/v3/rerank", options.rerank_model, p.documents
        else:
            inputs = None if name == EMBED_SINGLE else p.batch
            bodies = [
                wire.embeddings_body(options.embeddings_model, inputs, p.tokens_per_document, v)
                for v in range(ROTATION)
            ]
            items = 1 if inputs is None else inputs
            check = functools.partial(wire.check_embeddings_answer, inputs=items)
            path, model = "/v3/embeddings", options.embeddings_model
        out.append(Scenario(name, path, model, items, tuple(bodies), check))
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
    transport: wire.Transport,
    clock: Clock,
) -> Outcome:
    body = scenario.bodies[n % len(scenario.bodies)]
    start = clock()
    try:
        status, data = transport("POST", base_url + scenario.path, body, timeout)
    except wire.TransportError as exc:
        return Outcome(None, exc.kind, exc.detail)
    seconds = clock() - start
    if not 200 <= status < 300:
        return Outcome(seconds, "http_status", f"HTTP {status}: {wire.error_text(data)}")
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
    transport: wire.Transport,
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


def fetch_config(base_url: str, timeout: float, transport: wire.Transport) -> dict[str, Any]:
    """``GET /v1/config``: each servable's state, the record's snapshot."""
    url = base_url + "/v1/config"
    try:
        status, data = transport("GET", url, None, timeout)
    except wire.TransportError as exc:
        raise BenchError(
            f"cannot reach OpenVINO Model Server at {base_url}: {exc.detail}; is it running, and "
            "is --base-url its REST address?"
        ) from None
    if status != 200:
        raise BenchError(f"GET {url} answered {status}: {wire.error_text(data)}")
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
    transport: wire.Transport,
) -> None:
    """Each model answers ``/v2/models/<name>/ready`` with 200, else :class:`BenchError`."""
    for model in models:
        url = f"{base_url}/v2/models/{quote(model, safe='')}/ready"
        try:
            status, data = transport("GET", url, None, timeout)
        except wire.TransportError as exc:
            raise BenchError(f"GET {url}: {exc.detail}") from None
        if status != 200:
            raise BenchError(
                f"model {model} is not ready at {base_url} (GET /v2/models/{model}/ready answered "
                f"{status}: {wire.error_text(data)}); {servable_state(server_config, model)}"
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
    transport: wire.Transport = wire.http_transport,
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
