"""``cardshare bench retrieval`` (``cardshare.retrieval``): the record that cannot be made
without its evidence, the statistics, each kind of failure counted, the arm checked both ways,
and the command line end to end.

The server is :class:`FakeOVMS`, a real HTTP server on 127.0.0.1 in a thread that answers with
OpenVINO Model Server's shapes and errors (``tests/fixtures/ovms/README.md`` says where each
comes from). No assertion is about speed: latencies come from an injected clock where the
numbers matter."""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cardshare.cli import main
from cardshare.retrieval import bench
from cardshare.retrieval.arm import arm_of_device, check_arm, graph_target_devices
from cardshare.retrieval.record import (
    QUERY_WORDS,
    SCENARIOS,
    ArmCheck,
    BenchError,
    BenchRecord,
    PayloadShape,
)
from cardshare.retrieval.wire import (
    Answer,
    check_embeddings_answer,
    check_rerank_answer,
    embeddings_body,
    rerank_body,
)

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "ovms"
EMBED = "bge-m3"
RERANK = "bge-reranker-v2-m3"
CHUNK_SENTENCE = (
    "Chunking failed: exceeding max_allowed_chunks after chunking limit: 64; actual: 100"
)
# MediaPipe's wrapping of the calculator's failure (reconstructed, see the fixtures' README).
CHUNK_WRAP = (
    "INTERNAL: CalculatorGraph::Run() failed: \n"
    'Calculator::Process() for node "RerankExecutor" failed: '
)


# -- a stand-in for OpenVINO Model Server --------------------------------------------------------


class FakeOVMS:
    """``/v1/config``, ``/v2/models/<name>/ready``, ``/v3/embeddings`` and ``/v3/rerank`` with
    OVMS's shapes; knobs for each way a request can go wrong."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = json.loads(
            (FIXTURES / "v1-config.available.json").read_text()
        )
        self.dimension = 16  # not 1024: the bench must read it from the answers
        self.max_allowed_chunks = 64
        self.max_position_embeddings = 512
        self.delay = 0.0  # seconds before answering a /v3 request
        self.garbage: str | None = None  # not-json | short | shape
        self.drop = False  # close the connection without an answer
        self.fail_every: int | None = None  # a 503 on every n-th /v3 request
        self.device: str | None = None  # a stand-in that reports a device in /v1/config
        self.config_body: bytes | None = None  # replace /v1/config's answer
        self.log: list[tuple[str, str]] = []
        self._count = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake.log.append(("GET", self.path))
                if self.path == "/v1/config":
                    self._send(200, fake.config_bytes())
                elif self.path.startswith("/v2/models/") and self.path.endswith("/ready"):
                    name = self.path[len("/v2/models/") : -len("/ready")]
                    self._send(*fake.ready(name))
                else:
                    self._send(404, b'{"error": "Not Found"}')

            def do_POST(self) -> None:
                fake.log.append(("POST", self.path))
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                with fake._lock:
                    fake._count += 1
                    n = fake._count
                if fake.drop:
                    self.close_connection = True
                    return
                if fake.delay:
                    time.sleep(fake.delay)
                if fake.fail_every and n % fake.fail_every == 0:
                    self._send(503, b'{"error": "Model with requested version is not loaded yet"}')
                    return
                if self.path == "/v3/embeddings":
                    self._send(*fake.embeddings(body))
                elif self.path == "/v3/rerank":
                    self._send(*fake.rerank(body))
                else:
                    self._send(404, b'{"error": "Not Found"}')

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def config_bytes(self) -> bytes:
        if self.config_body is not None:
            return self.config_body
        doc = json.loads(json.dumps(self.config))
        if self.device is not None:
            for entry in doc.values():
                entry["model_version_status"][0]["target_device"] = self.device
        return json.dumps(doc).encode()

    def ready(self, name: str) -> tuple[int, bytes]:
        entry = self.config.get(name)
        if entry is None:
            return 404, b'{"error": "Model with requested name is not found"}'
        if entry["model_version_status"][0]["state"] != "AVAILABLE":
            return 404, b'{"error": "Model with requested version is not loaded yet"}'
        return 200, b""

    def embeddings(self, body: dict[str, Any]) -> tuple[int, bytes]:
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {
                "object": "embedding",
                "embedding": [((len(t) * (k + 1)) % 97) / 97 for k in range(self.dimension)],
                "index": i,
            }
            for i, t in enumerate(texts)
        ]
        if self.garbage == "short":
            data = data[:-1]
        tokens = sum(len(t.split()) + 2 for t in texts)
        doc = {
            "object": "list",
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return self._garbled(doc)

    def rerank(self, body: dict[str, Any]) -> tuple[int, bytes]:
        docs = body["documents"]
        limit = self.max_allowed_chunks
        if len(docs) > limit:
            # PrepareInputsForRerankModel refuses before chunking (OVMS source, 7e4df0c7)
            message = "Number of documents exceeds max_allowed_chunks"
            return 400, json.dumps({"error": CHUNK_WRAP + message}).encode()
        space = self.max_position_embeddings - len(body["query"].split()) - 4
        chunks = sum(math.ceil(len(d.split()) / space) for d in docs)
        if chunks > limit:
            message = (
                f"exceeding max_allowed_chunks after chunking limit: {limit}; actual: {chunks}"
            )
            return 400, json.dumps({"error": CHUNK_WRAP + "Chunking failed: " + message}).encode()
        scores = [1.0 / (1 + i + len(d) % 7) for i, d in enumerate(docs)]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        results = [{"index": i, "relevance_score": scores[i]} for i in order]
        if self.garbage == "short":
            results = results[:-1]
        return self._garbled({"results": results})

    def _garbled(self, doc: dict[str, Any]) -> tuple[int, bytes]:
        if self.garbage == "not-json":
            return 200, b"<html>upstream says hello</html>"
        if self.garbage == "shape":
            return 200, json.dumps({"result": "ok"}).encode()
        return 200, json.dumps(doc).encode()

    def v3_requests(self) -> list[tuple[str, str]]:
        return [r for r in self.log if r[1].startswith("/v3/")]


@pytest.fixture
def ovms() -> Iterator[FakeOVMS]:
    fake = FakeOVMS()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()


def make_repository(root: Path, embed_device: str = "GPU", rerank_device: str = "GPU") -> Path:
    """An exported repository: config.json and one graph per servable."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text((FIXTURES / "config.json").read_text())
    for name, fixture, device in (
        (EMBED, "embeddings-graph.gpu.pbtxt", embed_device),
        (RERANK, "rerank-graph.gpu.pbtxt", rerank_device),
    ):
        (root / name).mkdir(exist_ok=True)
        text = (FIXTURES / fixture).read_text().replace('"GPU"', f'"{device}"')
        (root / name / "graph.pbtxt").write_text(text)
    return root


def options(base_url: str, **changes: Any) -> bench.BenchOptions:
    payload = changes.pop("payload", PayloadShape(documents=4, tokens_per_document=12, batch=3))
    values: dict[str, Any] = {
        "base_url": base_url,
        "arm": "gpu",
        "repository": None,
        "rerank_model": RERANK,
        "embeddings_model": EMBED,
        "payload": payload,
        "concurrency": 1,
        "warmup": 1,
        "iterations": 3,
        "timeout": 5.0,
        "scenarios": SCENARIOS,
    }
    values.update(changes)
    return bench.BenchOptions(**values)


# -- the record ---------------------------------------------------------------------------------

WHEN = datetime(2026, 8, 21, 12, 0, 0, tzinfo=UTC)


def record_kwargs() -> dict[str, Any]:
    return {
        "base_url": "http://127.0.0.1:8000",
        "utc_time": WHEN,
        "server_config": json.loads((FIXTURES / "v1-config.available.json").read_text()),
        "payload": PayloadShape(documents=20, tokens_per_document=64, batch=32),
        "concurrency": 4,
        "arm": "gpu",
        "arm_check": ArmCheck(arm="gpu", verdict="not checked", checked=(), not_checked=()),
        "models": {"rerank": RERANK, "embeddings": EMBED},
        "scenarios": SCENARIOS,
        "warmup": 3,
        "iterations": 30,
        "timeout_seconds": 60.0,
    }


@pytest.mark.parametrize("name", sorted(record_kwargs()))
def test_record_refuses_construction_without_each_input(name: str) -> None:
    kwargs = record_kwargs()
    del kwargs[name]
    with pytest.raises(TypeError, match=f"missing 1 required keyword-only argument: '{name}'"):
        BenchRecord(**kwargs)


@pytest.mark.parametrize("name", ["documents", "tokens_per_document", "batch"])
def test_payload_shape_refuses_construction_without_each_input(name: str) -> None:
    kwargs = {"documents": 20, "tokens_per_document": 64, "batch": 32}
    del kwargs[name]
    with pytest.raises(TypeError, match=f"missing 1 required keyword-only argument: '{name}'"):
        PayloadShape(**kwargs)


def test_record_and_shape_take_no_positional_arguments() -> None:
    with pytest.raises(TypeError, match="positional argument"):
        PayloadShape(20, 64, 32)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional argument"):
        BenchRecord(*record_kwargs().values())  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("base_url", None, ValueError, "base_url must be a str, got NoneType"),
        ("base_url", "127.0.0.1:8000", ValueError, "base_url must be http(s)://HOST[:PORT]"),
        ("base_url", "http://h:8000/", ValueError, "trailing slash"),
        ("utc_time", "2026-08-21T12:00:00Z", TypeError, "utc_time must be a datetime, got str"),
        ("utc_time", datetime(2026, 8, 21, 12), ValueError, "utc_time must be timezone-aware UTC"),
        (
            "utc_time",
            datetime(2026, 8, 21, 14, tzinfo=timezone(timedelta(hours=2))),
            ValueError,
            "utc_time must be timezone-aware UTC",
        ),
        ("server_config", None, TypeError, "server_config must be the /v1/config answer"),
        ("server_config", ["bge-m3"], TypeError, "got list"),
        ("server_config", {"m": float("nan")}, ValueError, "server_config is not JSON data"),
        ("payload", None, TypeError, "payload must be a PayloadShape, got NoneType"),
        ("payload", {"documents": 20}, TypeError, "payload must be a PayloadShape, got dict"),
        ("concurrency", None, TypeError, "concurrency must be an int, got NoneType"),
        ("concurrency", 0, ValueError, "concurrency must be 1 or more, got 0"),
        ("concurrency", True, TypeError, "concurrency must be an int, got bool"),
        ("arm", "npu", ValueError, "arm must be one of gpu, cpu, got 'npu'"),
        (
            "arm_check",
            ArmCheck(arm="cpu", verdict="agrees", checked=(), not_checked=()),
            ValueError,
            "arm_check is for arm cpu, not gpu",
        ),
        ("arm_check", None, TypeError, "arm_check must be an ArmCheck"),
        ("models", None, TypeError, "models must map each role to a model name"),
        ("scenarios", (), ValueError, "scenarios must be a non-empty tuple"),
        ("scenarios", ("rerank", "chat"), ValueError, "scenarios must be a non-empty tuple"),
        ("warmup", -1, ValueError, "warmup must be 0 or more, got -1"),
        ("iterations", 0, ValueError, "iterations must be 1 or more, got 0"),
        ("timeout_seconds", 0, ValueError, "timeout_seconds must be above 0, got 0"),
        ("timeout_seconds", None, ValueError, "timeout_seconds must be above 0, got None"),
    ],
)
def test_record_refuses_bad_inputs(name: str, value: Any, error: type, message: str) -> None:
    kwargs = record_kwargs()
    kwargs[name] = value
    with pytest.raises(error) as raised:
        BenchRecord(**kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("documents", 0, ValueError, "documents must be 1 or more, got 0"),
        (
            "tokens_per_document",
            None,
            TypeError,
            "tokens_per_document must be an int, got NoneType",
        ),
        ("batch", 2.0, TypeError, "batch must be an int, got float"),
    ],
)
def test_payload_shape_refuses_bad_inputs(name: str, value: Any, error: type, message: str) -> None:
    kwargs: dict[str, Any] = {"documents": 20, "tokens_per_document": 64, "batch": 32}
    kwargs[name] = value
    with pytest.raises(error, match=message):
        PayloadShape(**kwargs)


def test_record_keeps_a_copy_of_the_snapshot() -> None:
    kwargs = record_kwargs()
    live = kwargs["server_config"]
    record = BenchRecord(**kwargs)
    live[EMBED]["model_version_status"][0]["state"] = "END"
    assert (
        record.as_dict()["server_config"][EMBED]["model_version_status"][0]["state"] == "AVAILABLE"
    )
    doc = record.as_dict()
    assert doc["utc_time"] == "2026-08-21T12:00:00Z"
    assert doc["payload"] == {
        "documents": 20,
        "tokens_per_document": 64,
        "batch": 32,
        "query_tokens": 8,
    }
    assert doc["concurrency"] == 4
    assert set(doc["method"]) >= {
        "latency",
        "quantiles",
        "items_per_second",
        "tokens",
        "concurrency",
    }


# -- statistics ---------------------------------------------------------------------------------


def test_quantiles_of_a_known_sequence() -> None:
    stats = bench.latency_stats([ms / 1000 for ms in range(20, 0, -1)])  # 20 ms .. 1 ms
    assert stats is not None
    assert stats.n == 20
    assert (stats.min_ms, stats.max_ms) == pytest.approx((1.0, 20.0))
    assert stats.p50_ms == pytest.approx(10.5)
    assert stats.p95_ms == pytest.approx(19.05)  # 19 + 0.05 * (20 - 19)
    assert stats.mean_ms == pytest.approx(10.5)


@pytest.mark.parametrize(
    "values",
    [
        [5.0, 1.0, 3.0],
        [77.3, 80.1, 79.9, 87.1, 76.0, 91.5, 78.8, 77.7, 83.0, 79.2, 120.4],
        [float(v) for v in range(1, 101)],
    ],
)
def test_quantile_method_is_statistics_inclusive(values: list[float]) -> None:
    """The documented method: statistics.quantiles(method="inclusive")."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    ordered = sorted(values)
    assert bench.quantile(ordered, 0.50) == pytest.approx(cuts[49])
    assert bench.quantile(ordered, 0.95) == pytest.approx(cuts[94])


def test_quantiles_of_one_value_and_of_none() -> None:
    one = bench.latency_stats([0.042])
    assert one is not None
    assert (one.p50_ms, one.p95_ms) == pytest.approx((42.0, 42.0))
    assert bench.latency_stats([]) is None


class ScriptedServer:
    """A transport whose answers take a known time on a fake clock."""

    def __init__(self, latencies: list[float], answer: bytes) -> None:
        self.latencies = list(latencies)
        self.answer = answer
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def __call__(
        self, method: str, url: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        self.now += self.latencies.pop(0)
        return 200, self.answer


def test_run_scenario_stats_and_rate_from_known_latencies() -> None:
    answer = json.dumps({"results": [{"index": i, "relevance_score": 0.5} for i in range(4)]})
    warm = [9.0]  # a slow first call: excluded from the statistics, not from nothing else
    timed = [0.010, 0.020, 0.030, 0.040]
    server = ScriptedServer(warm + timed, answer.encode())
    opts = options("http://x:1", scenarios=("rerank",), warmup=1, iterations=4)
    (scenario,) = bench.build_scenarios(opts)
    result = bench.run_scenario(
        scenario,
        base_url="http://x:1",
        warmup=1,
        iterations=4,
        concurrency=1,
        timeout=1.0,
        transport=server,
        clock=server.clock,
    )
    assert result.warmup.ok == 1
    assert result.timed.ok == 4
    assert result.latency is not None
    assert result.latency.p50_ms == pytest.approx(25.0)
    assert result.latency.p95_ms == pytest.approx(38.5)
    assert result.latency.max_ms == pytest.approx(40.0)
    assert result.wall_seconds == pytest.approx(0.1)
    assert result.items_per_second == pytest.approx(4 * 4 / 0.1)  # 4 requests of 4 documents
    assert result.requests_per_second == pytest.approx(40.0)


# -- answers ------------------------------------------------------------------------------------


def _rerank(results: Any) -> bytes:
    return json.dumps({"results": results}).encode()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            _rerank([{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}]),
            None,
        ),
        (b"<html>", "the rerank answer is not JSON: b'<html>'"),
        (b"[]", "the rerank answer is a JSON list, not an object"),
        (b"{}", "the rerank answer has no results list"),
        (
            _rerank([{"index": 0, "relevance_score": 0.1}]),
            "the rerank answer has 1 results for 2 documents",
        ),
        (
            _rerank([{"index": 0, "relevance_score": 0.1}, {"index": 2, "relevance_score": 0.1}]),
            "rerank result 1 has index 2, not 0..1",
        ),
        (
            _rerank([{"index": 0, "relevance_score": 0.1}, {"index": 0, "relevance_score": 0.1}]),
            "rerank results name document 0 twice",
        ),
        (
            _rerank(
                [{"index": 0, "relevance_score": 0.1}, {"index": True, "relevance_score": 0.1}]
            ),
            "rerank result 1 has index True, not 0..1",
        ),
        (
            _rerank(
                [{"index": 0, "relevance_score": "high"}, {"index": 1, "relevance_score": 0.1}]
            ),
            "rerank result 0 has relevance_score 'high', not a number",
        ),
        (_rerank([0, 1]), "rerank result 0 is not an object"),
    ],
)
def test_rerank_answers(data: bytes, problem: str | None) -> None:
    assert check_rerank_answer(data, 2).problem == problem


def _embed(items: Any, usage: Any = None) -> bytes:
    doc: dict[str, Any] = {"object": "list", "data": items}
    if usage is not None:
        doc["usage"] = usage
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"nope", "the embeddings answer is not JSON: b'nope'"),
        (b'{"error": "x"}', "the embeddings answer has no data list"),
        (
            _embed([{"embedding": [0.1], "index": 0}]),
            "the embeddings answer has 1 vectors for 2 inputs",
        ),
        (
            _embed([{"embedding": [0.1], "index": 0}, {"embedding": [0.1, 0.2], "index": 1}]),
            "embeddings vectors differ in dimension: [1, 2]",
        ),
        (
            _embed([{"embedding": [0.1], "index": 0}, {"embedding": [0.1], "index": 0}]),
            "embeddings items repeat an index",
        ),
        (
            _embed([{"embedding": [], "index": 0}, {"embedding": [0.1], "index": 1}]),
            "embeddings item 0 has no vector of numbers",
        ),
        (
            _embed([{"embedding": "AAAA", "index": 0}, {"embedding": [0.1], "index": 1}]),
            "embeddings item 0 has no vector of numbers",
        ),
        (
            _embed([{"embedding": [0.1], "index": 0}, {"embedding": [0.1], "index": 5}]),
            "embeddings item 1 has index 5, not 0..1",
        ),
    ],
)
def test_embeddings_answers_refused(data: bytes, problem: str) -> None:
    assert check_embeddings_answer(data, 2).problem == problem


def test_embeddings_answer_gives_dimension_and_server_tokens() -> None:
    data = _embed(
        [{"embedding": [0.1, 0.2, 0.3], "index": 1}, {"embedding": [0.3, 0.2, 0.1], "index": 0}],
        {"prompt_tokens": 14, "total_tokens": 14},
    )
    assert check_embeddings_answer(data, 2) == Answer(None, 3, 14)


# -- against the stand-in -----------------------------------------------------------------------


def test_a_clean_run_has_the_record_and_the_results(ovms: FakeOVMS, tmp_path: Path) -> None:
    report = bench.run(options(ovms.url))
    doc = json.loads(report.to_json())
    assert set(doc) == {"schema", "record", "results", "complete", "problems"}
    assert doc["schema"] == "cardshare.bench.retrieval/1"
    assert doc["complete"] is True
    record = doc["record"]
    for key in (
        "base_url",
        "utc_time",
        "server_config",
        "payload",
        "concurrency",
        "arm",
        "arm_check",
    ):
        assert key in record
    assert record["base_url"] == ovms.url
    assert record["server_config"] == json.loads(
        (FIXTURES / "v1-config.available.json").read_text()
    )
    assert record["payload"] == {
        "documents": 4,
        "tokens_per_document": 12,
        "batch": 3,
        "query_tokens": 8,
    }
    assert [r["scenario"] for r in doc["results"]] == ["rerank", "embed-single", "embed-batch"]
    by_name = {r["scenario"]: r for r in doc["results"]}
    for r in doc["results"]:
        assert r["timed"] == {
            "requests": 3,
            "ok": 3,
            "failed": 0,
            "failures": dict.fromkeys(bench.FAILURE_KINDS, 0),
            "messages": {},
        }
        assert r["warmup"]["requests"] == 1
        assert r["latency"]["n"] == 3
        assert r["items_per_second"] > 0
    assert by_name["rerank"]["items_per_request"] == 4
    assert by_name["embed-batch"]["items_per_request"] == 3
    assert by_name["embed-batch"]["embedding_dimensions"] == [16]
    # the server's own count of 3 texts of 12 words (+2 special tokens each in the stand-in)
    assert by_name["embed-batch"]["server_prompt_tokens_per_request"] == [42]
    assert by_name["embed-single"]["server_prompt_tokens_per_request"] == [14]
    # 3 scenarios x (1 warm-up + 3 timed)
    assert len(ovms.v3_requests()) == 12


def test_texts_are_about_the_token_count_and_reproducible() -> None:
    body = json.loads(embeddings_body(EMBED, 3, 50, variant=2))
    assert [len(t.split()) for t in body["input"]] == [50, 50, 50]
    assert len(set(body["input"])) == 3
    assert embeddings_body(EMBED, 3, 50, variant=2) == embeddings_body(EMBED, 3, 50, variant=2)
    assert embeddings_body(EMBED, 3, 50, variant=2) != embeddings_body(EMBED, 3, 50, variant=3)
    single = json.loads(embeddings_body(EMBED, None, 7, variant=0))
    assert isinstance(single["input"], str)
    assert len(single["input"].split()) == 7
    rerank = json.loads(
        rerank_body(RERANK, PayloadShape(documents=5, tokens_per_document=9, batch=1), 0)
    )
    assert len(rerank["documents"]) == 5
    assert {len(d.split()) for d in rerank["documents"]} == {9}
    assert len(rerank["query"].split()) == QUERY_WORDS


def _only(kind: str, result: bench.ScenarioResult, count: int) -> None:
    expected = dict.fromkeys(bench.FAILURE_KINDS, 0)
    expected[kind] = count
    assert result.timed.failures == expected
    assert result.timed.ok == result.timed.requests - count


def test_the_rerank_guards_400_is_counted_with_its_words(ovms: FakeOVMS) -> None:
    ovms.max_position_embeddings = 64  # 60-word documents make 2 chunks each: 50 -> 100
    payload = PayloadShape(documents=50, tokens_per_document=60, batch=1)
    report = bench.run(options(ovms.url, payload=payload, scenarios=("rerank",)))
    (result,) = report.results
    _only("http_status", result, 3)
    (message,) = result.timed.messages
    assert message.startswith(
        "http_status: HTTP 400: INTERNAL: CalculatorGraph::Run() failed: Calculator"
    )
    assert message.endswith(CHUNK_SENTENCE)
    assert result.latency is None
    assert result.items_per_second is None


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "not-json",
            "bad_answer: the rerank answer is not JSON: b'<html>upstream says hello</html>'",
        ),
        ("short", "bad_answer: the rerank answer has 3 results for 4 documents"),
        ("shape", "bad_answer: the rerank answer has no results list"),
    ],
)
def test_a_garbage_answer_is_counted(ovms: FakeOVMS, mode: str, message: str) -> None:
    ovms.garbage = mode
    report = bench.run(options(ovms.url, scenarios=("rerank",)))
    (result,) = report.results
    _only("bad_answer", result, 3)
    assert result.timed.messages == {message: 3}


def test_a_short_embeddings_answer_is_counted(ovms: FakeOVMS) -> None:
    ovms.garbage = "short"
    report = bench.run(options(ovms.url, scenarios=("embed-batch",)))
    (result,) = report.results
    _only("bad_answer", result, 3)
    assert result.timed.messages == {
        "bad_answer: the embeddings answer has 2 vectors for 3 inputs": 3
    }


def test_a_slow_answer_is_a_timeout(ovms: FakeOVMS) -> None:
    ovms.delay = 1.0
    report = bench.run(
        options(ovms.url, scenarios=("embed-single",), warmup=0, iterations=2, timeout=0.2)
    )
    (result,) = report.results
    _only("timeout", result, 2)
    assert result.timed.messages == {"timeout: no answer within 0.2 s": 2}


def test_a_dropped_connection_is_counted(ovms: FakeOVMS) -> None:
    ovms.drop = True
    report = bench.run(options(ovms.url, scenarios=("embed-single",), warmup=0))
    (result,) = report.results
    _only("connection", result, 3)
    assert result.timed.messages == {"connection: closed without an answer": 3}


def test_some_failures_leave_statistics_of_the_rest(ovms: FakeOVMS) -> None:
    ovms.fail_every = 2
    report = bench.run(options(ovms.url, scenarios=("embed-single",), warmup=0, iterations=4))
    (result,) = report.results
    _only("http_status", result, 2)
    assert result.latency is not None and result.latency.n == 2
    assert report.problems() == []


def test_concurrent_clients_send_every_request(ovms: FakeOVMS) -> None:
    report = bench.run(
        options(ovms.url, scenarios=("embed-batch",), warmup=0, iterations=9, concurrency=3)
    )
    (result,) = report.results
    assert (result.timed.requests, result.timed.ok) == (9, 9)
    assert report.record.concurrency == 3
    assert len(ovms.v3_requests()) == 9


def test_every_request_failing_exits_1_after_the_record(ovms: FakeOVMS, tmp_path: Path) -> None:
    ovms.max_position_embeddings = 64
    payload = PayloadShape(documents=50, tokens_per_document=60, batch=2)
    report = bench.run(options(ovms.url, payload=payload))
    out_file = tmp_path / "bench.json"
    out, err = io.StringIO(), io.StringIO()
    code = bench.emit(report, out=out, err=err, out_file=out_file, table=False)
    assert code == 1
    assert out.getvalue() == ""
    doc = json.loads(out_file.read_text())
    assert doc["complete"] is False
    assert doc["problems"] == [
        f"rerank: all 3 timed requests to /v3/rerank ({RERANK}) failed; commonest: "
        f"http_status: HTTP 400: INTERNAL: CalculatorGraph::Run() failed: Calculator::Process() "
        f'for node "RerankExecutor" failed: {CHUNK_SENTENCE}'
    ]
    assert f"cardshare: error: {doc['problems'][0]}\n" in err.getvalue()
    assert "rerank" in err.getvalue().split("SCENARIO")[1]  # the table went to err
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary file left


def test_a_model_that_is_not_ready_stops_the_run_before_timing(ovms: FakeOVMS) -> None:
    ovms.config = json.loads((FIXTURES / "v1-config.rerank-failed.json").read_text())
    with pytest.raises(BenchError) as raised:
        bench.run(options(ovms.url))
    assert str(raised.value) == (
        f"model {RERANK} is not ready at {ovms.url} (GET /v2/models/{RERANK}/ready answered 404: "
        "Model with requested version is not loaded yet); /v1/config says version 1 LOADING "
        "(FAILED_PRECONDITION)"
    )
    assert ovms.v3_requests() == []


def test_a_model_the_server_does_not_serve(ovms: FakeOVMS) -> None:
    with pytest.raises(BenchError) as raised:
        bench.run(options(ovms.url, embeddings_model="bge-large"))
    assert str(raised.value) == (
        f"model bge-large is not ready at {ovms.url} (GET /v2/models/bge-large/ready answered "
        "404: Model with requested name is not found); /v1/config does not list it (it lists "
        f"{EMBED}, {RERANK})"
    )


def test_no_server_and_not_a_server(ovms: FakeOVMS) -> None:
    with pytest.raises(BenchError) as raised:
        bench.run(options("http://127.0.0.1:9"))
    assert str(raised.value) == (
        "cannot reach OpenVINO Model Server at http://127.0.0.1:9: connection refused; is it "
        "running, and is --base-url its REST address?"
    )
    ovms.config_body = b"<html>a login page</html>"
    with pytest.raises(BenchError, match="did not answer a JSON object"):
        bench.run(options(ovms.url))


# -- the arm ------------------------------------------------------------------------------------

SERVER_SILENT = (
    f"arm not checked against the server for {EMBED}, {RERANK}: OpenVINO Model Server reports "
    "no device (/v1/config gives each servable's state only; /v2/models/<name>/ready and "
    "/metrics name none)"
)


def test_arm_not_checkable_is_said_plainly(ovms: FakeOVMS) -> None:
    report = bench.run(options(ovms.url, scenarios=("embed-single",), iterations=1, warmup=0))
    check = report.record.arm_check
    assert check.verdict == "not checked"
    assert check.checked == ()
    assert check.not_checked == (
        f"arm not checked against the server for {EMBED}: OpenVINO Model Server reports no "
        "device (/v1/config gives each servable's state only; /v2/models/<name>/ready and "
        "/metrics name none)",
        "arm not checked against a model repository: no --repository given (the device is "
        "baked into each servable's graph.pbtxt as target_device at export time)",
    )


def test_arm_checked_against_the_repository(ovms: FakeOVMS, tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "gpu")
    report = bench.run(options(ovms.url, repository=repo, iterations=1, warmup=0))
    check = report.record.arm_check
    assert check.verdict == "agrees"
    assert check.checked == (
        f"{EMBED}: {repo / EMBED / 'graph.pbtxt'} says GPU: agrees with --arm gpu",
        f"{RERANK}: {repo / RERANK / 'graph.pbtxt'} says GPU: agrees with --arm gpu",
    )
    assert check.not_checked == (
        SERVER_SILENT,
        f"that the server at {ovms.url} loaded {repo / 'config.json'} is not checked: OpenVINO "
        "Model Server's API does not name the repository it serves",
    )


def test_arm_contradicted_by_the_repository_times_nothing(ovms: FakeOVMS, tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "cpu", "CPU", "CPU")
    with pytest.raises(BenchError) as raised:
        bench.run(options(ovms.url, repository=repo))
    assert str(raised.value) == (
        f"--arm gpu is contradicted, nothing was timed: {EMBED}: {repo / EMBED / 'graph.pbtxt'} "
        f"says CPU: CONTRADICTS --arm gpu; {RERANK}: {repo / RERANK / 'graph.pbtxt'} says CPU: "
        "CONTRADICTS --arm gpu; check --arm and --base-url (they change together)"
    )
    assert ovms.v3_requests() == []
    # the same repository is the CPU arm's evidence
    report = bench.run(options(ovms.url, arm="cpu", repository=repo, iterations=1, warmup=0))
    assert report.record.arm_check.verdict == "agrees"


@pytest.mark.parametrize(
    ("reported", "arm", "verdict"),
    [("GPU.0", "gpu", "agrees"), ("CPU", "gpu", "contradicted"), ("CPU", "cpu", "agrees")],
)
def test_arm_checked_against_a_server_that_reports_a_device(
    reported: str, arm: str, verdict: str
) -> None:
    config = json.loads((FIXTURES / "v1-config.available.json").read_text())
    config[EMBED]["model_version_status"][0]["target_device"] = reported
    check = check_arm(arm, [EMBED], config, None, "http://h:8000")
    assert check.verdict == verdict
    word = "agrees with" if verdict == "agrees" else "CONTRADICTS"
    assert check.checked == (
        f"{EMBED}: the server's /v1/config at http://h:8000 says {reported}: {word} --arm {arm}",
    )


def test_a_reporting_server_contradicting_the_arm_stops_the_run(ovms: FakeOVMS) -> None:
    ovms.device = "CPU"
    with pytest.raises(BenchError, match="--arm gpu is contradicted, nothing was timed"):
        bench.run(options(ovms.url))
    assert ovms.v3_requests() == []


def test_arm_check_limits(tmp_path: Path) -> None:
    config = json.loads((FIXTURES / "v1-config.available.json").read_text())
    repo = make_repository(tmp_path / "r", embed_device="AUTO")
    graph = repo / RERANK / "graph.pbtxt"
    # a comment naming another device is not the graph's device
    graph.write_text('# was target_device: "CPU" before the re-export\n' + graph.read_text())
    check = check_arm("gpu", [EMBED, RERANK], config, repo, "http://h:8000")
    assert check.verdict == "partly checked"
    assert check.checked == (f"{RERANK}: {graph} says GPU: agrees with --arm gpu",)
    assert check.not_checked[1] == (
        f"{EMBED}: {repo / EMBED / 'graph.pbtxt'} says target_device 'AUTO', which names no "
        "single device (OpenVINO chooses or splits at load time)"
    )


def test_a_repository_that_is_not_the_servers(tmp_path: Path) -> None:
    config = json.loads((FIXTURES / "v1-config.available.json").read_text())
    config["gte-large"] = config[EMBED]
    repo = make_repository(tmp_path / "r")
    (repo / RERANK / "graph.pbtxt").write_text('node { calculator: "RerankCalculatorOV" }\n')
    check = check_arm("gpu", [EMBED, RERANK, "gte-large"], config, repo, "http://h:8000")
    assert check.not_checked[1:4] == (
        f"{RERANK}: {repo / RERANK / 'graph.pbtxt'} names no target_device",
        f"gte-large: {repo / 'config.json'} lists no servable of that name",
        f"{repo / 'config.json'} lists {EMBED}, {RERANK} but the server's /v1/config lists "
        f"{EMBED}, {RERANK}, gte-large: this repository may not be what the server loaded",
    )
    with pytest.raises(BenchError) as raised:
        check_arm("gpu", [EMBED], config, tmp_path / "absent", "http://h:8000")
    assert str(raised.value) == (
        f"cannot read the model repository's {tmp_path / 'absent'}: No such file or directory; "
        "--repository takes the exported repository the server serves (its config.json)"
    )


def test_graph_devices_ignore_comments() -> None:
    text = (FIXTURES / "rerank-graph.gpu.pbtxt").read_text()
    assert graph_target_devices(text) == ["GPU"]
    assert graph_target_devices('x: "a # b"  # target_device: "CPU"\ntarget_device: "GPU"') == [
        "GPU"
    ]
    assert [arm_of_device(d) for d in ("GPU", "GPU.1", "cpu", "NPU", "AUTO", "HETERO:GPU,CPU")] == [
        "gpu",
        "gpu",
        "cpu",
        "npu",
        None,
        None,
    ]


# -- the command line ---------------------------------------------------------------------------


def _cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "cardshare", "bench", "retrieval", *argv],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=timeout,
    )


def test_cli_end_to_end(ovms: FakeOVMS, tmp_path: Path) -> None:
    repo = make_repository(tmp_path / "gpu")
    out_file = tmp_path / "runs" / "gpu.json"
    out_file.parent.mkdir()
    common = ("--base-url", ovms.url, "--arm", "gpu", "--repository", str(repo))
    sizes = (
        "--documents",
        "5",
        "--tokens-per-document",
        "10",
        "--batch",
        "4",
        "--concurrency",
        "2",
    )
    run = _cli(*common, *sizes, "--warmup", "1", "--iterations", "4", "--out", str(out_file))
    assert (run.returncode, run.stdout) == (0, ""), run.stderr
    assert "Traceback" not in run.stderr
    doc = json.loads(out_file.read_text())
    assert doc["complete"] is True
    assert doc["record"]["payload"] == {
        "documents": 5,
        "tokens_per_document": 10,
        "batch": 4,
        "query_tokens": 8,
    }
    assert doc["record"]["concurrency"] == 2
    assert doc["record"]["arm_check"]["verdict"] == "agrees"
    assert datetime.strptime(doc["record"]["utc_time"], "%Y-%m-%dT%H:%M:%SZ")
    lines = run.stderr.splitlines()
    assert lines[0] == "bench: rerank: 1 warm-up, 4 timed (5 items each, concurrency 2)"
    assert any(line.startswith(f"bench retrieval {ovms.url} at ") for line in lines)
    header = next(line for line in lines if line.startswith("SCENARIO"))
    assert header.split() == [
        "SCENARIO",
        "MODEL",
        "ITEMS",
        "OK",
        "P50",
        "MS",
        "P95",
        "MS",
        "ITEMS/S",
        "FAILED",
    ]
    assert any(line.split()[:4] == ["embed-batch", EMBED, "4", "4/4"] for line in lines)
    assert "embed-batch: embedding dimension 16 (read from the answers)" in lines
    assert f"  NOT checked: {SERVER_SILENT}" in lines

    # without --out the JSON is stdout; --table puts the table there instead
    plain = _cli(*common, "--scenario", "embed-single", "--iterations", "1", "--warmup", "0")
    assert plain.returncode == 0, plain.stderr
    assert [r["scenario"] for r in json.loads(plain.stdout)["results"]] == ["embed-single"]
    table = _cli(*common, "--scenario", "rerank", "--iterations", "1", "--warmup", "0", "--table")
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith(f"bench retrieval {ovms.url} at ")
    assert "SCENARIO" not in table.stderr


def test_cli_failures_are_one_line_and_exit_1(ovms: FakeOVMS, tmp_path: Path) -> None:
    ovms.max_position_embeddings = 64
    failed = _cli(
        "--base-url",
        ovms.url,
        "--arm",
        "cpu",
        "--scenario",
        "rerank",
        "--documents",
        "50",
        "--tokens-per-document",
        "60",
        "--iterations",
        "2",
        "--warmup",
        "0",
    )
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["complete"] is False
    assert failed.stderr.splitlines()[-1].startswith(
        f"cardshare: error: rerank: all 2 timed requests to /v3/rerank ({RERANK}) failed; "
        "commonest: http_status: HTTP 400:"
    )
    contradicted = _cli(
        "--base-url",
        ovms.url,
        "--arm",
        "gpu",
        "--repository",
        str(make_repository(tmp_path / "cpu", "CPU", "CPU")),
    )
    assert (contradicted.returncode, contradicted.stdout) == (1, "")
    assert contradicted.stderr.startswith(
        "cardshare: error: --arm gpu is contradicted, nothing was timed: "
    )
    assert len(contradicted.stderr.splitlines()) == 1
    unreachable = _cli("--base-url", "http://127.0.0.1:9", "--arm", "gpu")
    assert unreachable.returncode == 1
    assert unreachable.stderr == (
        "cardshare: error: cannot reach OpenVINO Model Server at http://127.0.0.1:9: connection "
        "refused; is it running, and is --base-url its REST address?\n"
    )
    for run in (failed, contradicted, unreachable):
        assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arm", "gpu"], "the following arguments are required: --base-url"),
        (["--base-url", "http://h:1"], "the following arguments are required: --arm"),
        (["--base-url", "http://h:1", "--arm", "igpu"], "argument --arm: invalid choice: 'igpu'"),
        (["--base-url", "h:1", "--arm", "gpu"], "expected OpenVINO Model Server's REST address"),
        (
            ["--base-url", "http://h:1", "--arm", "gpu", "--concurrency", "0"],
            "expected 1 or more, got 0",
        ),
        (
            ["--base-url", "http://h:1", "--arm", "gpu", "--scenario", "chat"],
            "invalid choice: 'chat'",
        ),
    ],
)
def test_cli_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "retrieval", *argv]) == 2
    assert message in capsys.readouterr().err


# -- shipping -----------------------------------------------------------------------------------


def _builder() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_zipapp
    finally:
        sys.path.pop(0)
    return build_zipapp


def test_the_module_is_standard_library_only() -> None:
    """Ready for the recorder's zipapp: the builder's own check finds nothing foreign."""
    for module in ("bench", "record", "wire", "arm"):
        source = (ROOT / "src" / "cardshare" / "retrieval" / f"{module}.py").read_text()
        assert _builder().foreign_imports(source, f"{module}.py") == []


def test_the_zipapp_carries_the_bench(tmp_path: Path) -> None:
    builder = _builder()
    pyz = builder.build(tmp_path / "cardshare.pyz")
    run = subprocess.run(
        [
            sys.executable,
            "-I",
            str(pyz),
            "bench",
            "retrieval",
            "--base-url",
            "http://127.0.0.1:9",
            "--arm",
            "gpu",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={},
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "retrieval/bench.py" in builder.MODULES
    assert "cannot reach OpenVINO Model Server" in run.stderr
