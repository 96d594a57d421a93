"""ovms_standin.py as a real process: OVMS's endpoints, load failures, the rerank guard, one
stream serialising, the memory ratchet on the simulated card, metrics.

Each test starts the stand-in (``python3 lab/standins/ovms_standin.py``) on a free port
against a copy of ``lab/fixtures/ovms-export`` in a tmp directory."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ovms_standin as ovms
import pytest
import simcard
from prometheus_client.parser import text_string_to_metric_families
from standin_testlib import PDEV, parse_fdinfo, request, wait_for

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "lab" / "standins" / "ovms_standin.py"
EXPORT = ROOT / "lab" / "fixtures" / "ovms-export"
FIXTURES = ROOT / "tests" / "fixtures" / "ovms"
EMBED = "bge-m3"
RERANK = "bge-reranker-v2-m3"
GIB = 1024**3
CHUNK_SENTENCE = (
    "Chunking failed: exceeding max_allowed_chunks after chunking limit: 64; actual: 100"
)
GUARDS = "      max_allowed_chunks: 64,\n      max_position_embeddings: 640,\n"
QUERY = "which river flows through the city of Paris"
RELEVANT = "The Seine is the river that flows through Paris, the capital city of France."
UNRELATED = [
    "Photosynthesis converts light energy into chemical energy in plants.",
    "A compiler translates source code into machine instructions.",
    "The recipe needs two eggs, flour and a cup of milk.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def repository(tmp_path: Path, device: str = "gpu") -> Path:
    """A writable copy of the exported repository; returns its config.json."""
    target = tmp_path / f"models-{device}"
    shutil.copytree(EXPORT / device, target)
    return target / "config.json"


def edit_graph(config: Path, model: str, change: Callable[[str], str]) -> None:
    graph = config.parent / model / "graph.pbtxt"
    graph.write_text(change(graph.read_text()))


def add_guards(text: str) -> str:
    """What the role does to an exported rerank graph: the two bounds into its options."""
    marker = "      models_path:"
    assert marker in text
    return text.replace(marker, GUARDS + marker, 1)


class Ovms:
    """One stand-in process; stdout goes to a file the test can read."""

    def __init__(self, tmp_path: Path, config: Path, *flags: str, **env: str) -> None:
        self.port = free_port()
        self.log = tmp_path / f"ovms-{self.port}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("STANDIN_")}
        environ.setdefault("CARDSHARE_SIM_ROOT", str(tmp_path / "no-card"))
        environ.update(
            {
                "STANDIN_LOAD_SECONDS": "0",
                "STANDIN_RELEASE_SECONDS": "0",
                "STANDIN_INFER_SECONDS": "0",
                "STANDIN_INFER_SECONDS_PER_ITEM": "0",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
        )
        environ.update(env)
        argv = ["--config_path", str(config), "--rest_port", str(self.port), "--port", "9000"]
        argv += ["--rest_bind_address", "127.0.0.1", *flags]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
            )
        wait_for(self._up, "the stand-in's REST port")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.output()
        try:
            return request(self.port, "GET", "/v2/health/live")[0] == 200
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, bytes]:
        status, _headers, body = request(self.port, "GET", path)
        return status, body

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, _headers, data = request(self.port, "POST", path, body)
        return status, json.loads(data) if data else None

    def rerank(self, documents: list[str], query: str = QUERY, **extra: Any) -> tuple[int, Any]:
        return self.post(
            "/v3/rerank", {"model": RERANK, "query": query, "documents": documents, **extra}
        )

    def memory(self) -> dict[str, Any]:
        status, body = self.get("/standin/memory")
        assert status == 200
        return dict(json.loads(body))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=10)


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Ovms]]:
    started: list[Ovms] = []

    def run(config: Path, *flags: str, **env: str) -> Ovms:
        server = Ovms(tmp_path, config, *flags, **env)
        started.append(server)
        return server

    yield run
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)


def long_documents(count: int, words: int) -> list[str]:
    return [" ".join(f"w{d}x{i}" for i in range(words)) for d in range(count)]


# -- command line ------------------------------------------------------------------------------


def test_unknown_flag_exits_2(tmp_path: Path) -> None:
    config = repository(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--config_path",
            str(config),
            "--rest_port",
            "1",
            "--model_repository",
            "/models",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 2
    assert "unrecognized arguments: --model_repository" in done.stderr


def test_rest_port_is_required(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--config_path", str(repository(tmp_path))],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.returncode == 2
    assert "--rest_port" in done.stderr


# -- endpoints --------------------------------------------------------------------------------


def test_health_readiness_and_config(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(
        repository(tmp_path),
        "--log_level",
        "INFO",
        "--rest_workers",
        "4",
        "--file_system_poll_wait_seconds",
        "0",
    )
    assert server.get("/v2/health/ready") == (200, b"")
    assert server.get("/v2/health/live") == (200, b"")
    assert server.get(f"/v2/models/{EMBED}/ready") == (200, b"")
    assert server.get(f"/v2/models/{RERANK}/ready") == (200, b"")
    status, body = server.get("/v2/models/nope/ready")
    assert (status, json.loads(body)) == (404, {"error": "Model with requested name is not found"})
    status, body = server.get("/v1/config")
    assert status == 200
    assert body == (FIXTURES / "v1-config.available.json").read_bytes()
    assert "SIMULATION" in server.output()
    assert server.stop() == 0


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_embeddings_shape_and_similarity(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(repository(tmp_path))
    texts = [
        "the river Seine flows through Paris",
        "the Seine river flows through the city of Paris",
        "a compiler translates source code",
    ]
    status, answer = server.post("/v3/embeddings", {"model": EMBED, "input": texts})
    assert status == 200
    assert answer["object"] == "list" and answer["model"] == EMBED
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in answer["data"])
    vectors = [d["embedding"] for d in answer["data"]]
    assert all(len(v) == 1024 for v in vectors)
    assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0) for v in vectors)
    assert cosine(vectors[0], vectors[1]) > 0.6 > 0.2 > cosine(vectors[0], vectors[2])
    words = sum(len(t.split()) + 2 for t in texts)  # each text's words plus <s> and </s>
    assert answer["usage"] == {"prompt_tokens": words, "total_tokens": words}
    status, single = server.post("/v3/embeddings", {"model": EMBED, "input": texts[0]})
    assert status == 200 and single["data"][0]["embedding"] == vectors[0]


def test_rerank_ranks_the_relevant_document_first(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    server = start(repository(tmp_path))
    documents = [*UNRELATED[:2], RELEVANT, UNRELATED[2]]
    status, answer = server.rerank(documents)
    assert status == 200
    results = answer["results"]
    assert results[0]["index"] == 2
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] > 0.8 and all(0 < s < 0.1 for s in scores[1:])
    status, top = server.rerank(documents, top_n=1, return_documents=True)
    assert status == 200
    assert top == {"results": [{**results[0], "document": {"text": RELEVANT}}]}


def test_llm_style_reranker_has_no_separation(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(repository(tmp_path), STANDIN_RERANK_STYLE="llm")
    status, answer = server.rerank([*UNRELATED, RELEVANT])
    assert status == 200
    scores = [r["relevance_score"] for r in answer["results"]]
    assert all(1e-12 <= s < 1e-8 for s in scores)
    assert max(scores) - min(scores) < 1e-8


def test_requests_the_server_refuses(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(repository(tmp_path))
    assert server.post("/v3/rerank", {"model": "nope", "query": "q", "documents": []}) == (
        404,
        {"error": "Mediapipe graph definition with requested name is not found"},
    )
    status, _headers, body = request(server.port, "POST", "/v3/rerank", raw=b"{not json")
    assert (status, json.loads(body)) == (
        412,
        {"error": "The file is not valid json - Cannot parse JSON body"},
    )
    assert server.post("/v3/rerank", {"query": "q"}) == (
        412,
        {"error": "The file is not valid json - model field is missing in JSON body"},
    )
    status, answer = server.post("/v3/rerank", {"model": RERANK, "documents": ["a"]})
    assert status == 400
    assert answer["error"].endswith(
        'node "RerankExecutor" failed: query field is missing in request'
    )
    assert server.get("/metrics") == (400, b'{"error": "Invalid request URL"}')
    assert "Processing HTTP/REST request failed: POST /v3/rerank" in server.output()


# -- servables that fail to load ----------------------------------------------------------------


def test_missing_tokenizer_leaves_the_server_ready_and_the_model_not(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    config = repository(tmp_path)
    (config.parent / RERANK / "openvino_tokenizer.xml").unlink()
    server = start(config)
    assert server.get("/v2/health/ready") == (200, b"")
    status, body = server.get(f"/v2/models/{RERANK}/ready")
    assert (status, json.loads(body)) == (
        404,
        {"error": "Model with requested version is not loaded yet"},
    )
    assert server.get(f"/v2/models/{EMBED}/ready") == (200, b"")
    status, body = server.get("/v1/config")
    assert body == (FIXTURES / "v1-config.rerank-failed.json").read_bytes()
    assert server.rerank(["a"]) == (500, {"error": "Mediapipe is not loaded yet"})
    status, _ = server.post("/v3/embeddings", {"model": EMBED, "input": "still served"})
    assert status == 200
    log = server.output()
    assert "Either openvino_tokenizer.xml was not provided or it was not loaded correctly" in log
    assert f"{RERANK} state changed to: LOADING_PRECONDITION_FAILED" in log


@pytest.mark.parametrize(
    ("damage", "logged"),
    [
        (lambda d: (d / "openvino_model.xml").unlink(), "openvino_model.xml"),
        (
            lambda d: (d / "graph.pbtxt").write_text(
                (d / "graph.pbtxt").read_text().replace('"GPU"', '"NPU"')
            ),
            'Device with "NPU" name is not registered',
        ),
        (
            lambda d: (d / "graph.pbtxt").write_text((d / "graph.pbtxt").read_text()[:-30]),
            "Error parsing text-format mediapipe.CalculatorGraphConfig",
        ),
        (
            lambda d: (d / "graph.pbtxt").write_text(
                (d / "graph.pbtxt")
                .read_text()
                .replace("target_device", "max_allowed_chunk: 64,\n      target_device")
            ),
            'has no field named "max_allowed_chunk"',
        ),
    ],
    ids=["no-model-xml", "npu", "cut-graph", "typo-in-guard"],
)
def test_a_broken_servable_fails_alone(
    tmp_path: Path, start: Callable[..., Ovms], damage: Callable[[Path], None], logged: str
) -> None:
    config = repository(tmp_path)
    damage(config.parent / RERANK)
    server = start(config)
    assert server.get("/v2/health/ready") == (200, b"")
    assert server.get(f"/v2/models/{RERANK}/ready")[0] == 404
    assert server.get(f"/v2/models/{EMBED}/ready") == (200, b"")
    doc = json.loads(server.get("/v1/config")[1])
    assert doc[RERANK]["model_version_status"][0]["state"] == "LOADING"
    assert doc[RERANK]["model_version_status"][0]["status"]["error_code"] == "FAILED_PRECONDITION"
    assert logged in server.output()


# -- the server's config.json ------------------------------------------------------------------


def test_a_config_with_only_the_mediapipe_list_serves_both(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    config = repository(tmp_path)
    shutil.copy(FIXTURES / "config.mediapipe.json", config)
    server = start(config)
    assert server.get(f"/v2/models/{EMBED}/ready") == (200, b"")
    assert server.get(f"/v2/models/{RERANK}/ready") == (200, b"")
    assert server.get("/v1/config")[1] == (FIXTURES / "v1-config.available.json").read_bytes()


def test_graph_path_and_base_path_resolve_as_the_server_resolves_them(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    config = repository(tmp_path)
    (config.parent / RERANK / "graph.pbtxt").rename(config.parent / RERANK / "rerank.pbtxt")
    (config.parent / EMBED).rename(config.parent / "embeddings")
    document = {
        "model_config_list": [
            {"config": {"name": RERANK, "base_path": RERANK, "graph_path": "rerank.pbtxt"}}
        ],
        "mediapipe_config_list": [{"name": EMBED, "base_path": "embeddings/"}],
    }
    config.write_text(json.dumps(document))
    server = start(config)
    doc = json.loads(server.get("/v1/config")[1])
    assert [doc[m]["model_version_status"][0]["state"] for m in (EMBED, RERANK)] == [
        "AVAILABLE",
        "AVAILABLE",
    ]


@pytest.mark.parametrize(
    "document",
    [
        {"mediapipe_config_list": [{"name": EMBED, "base_path": EMBED}]},
        {"model_config_list": [], "mediapipe_config_list": [{"name": EMBED, "nireq": 1}]},
    ],
    ids=["no-model-config-list", "unknown-key"],
)
def test_a_config_the_schema_refuses_stops_the_server(tmp_path: Path, document: Any) -> None:
    config = repository(tmp_path)
    config.write_text(json.dumps(document))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--config_path", str(config), "--rest_port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "STANDIN_LOAD_SECONDS": "0"},
        check=False,
    )
    assert result.returncode == 1
    assert "Configuration file is not in valid configuration format" in result.stdout


def test_a_graph_without_target_device_serves_on_the_cpu(
    tmp_path: Path, start: Callable[..., Ovms], card_root: Path
) -> None:
    """The options' default up to 2026.2 (the stand-in's release): what `ovms --pull` writes
    since 2026.3 serves on the CPU, holding no GPU memory."""
    config = repository(tmp_path)
    for model, fixture in ((EMBED, "embeddings"), (RERANK, "rerank")):
        shutil.copy(FIXTURES / f"{fixture}-graph.pull.pbtxt", config.parent / model / "graph.pbtxt")
    server = start(config, CARDSHARE_SIM_ROOT=str(card_root))
    assert server.get(f"/v2/models/{RERANK}/ready") == (200, b"")
    assert server.rerank([RELEVANT, *UNRELATED])[0] == 200
    memory = server.memory()
    assert memory["servables"][RERANK]["device"] == "CPU"
    assert memory["resident_bytes"] == 0


# -- the rerank guard ---------------------------------------------------------------------------


def test_guard_refuses_with_the_calculators_sentence(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    config = repository(tmp_path)
    edit_graph(config, RERANK, add_guards)
    server = start(config)
    # 50 documents of 1000 words; 640 - 8 query words - 4 special tokens = 628 per chunk: 100
    status, answer = server.rerank(long_documents(50, 1000))
    assert status == 400
    assert answer["error"] == (
        "Mediapipe execution failed. MP status - INTERNAL: CalculatorGraph::Run() failed: \n"
        f'Calculator::Process() for node "RerankExecutor" failed: {CHUNK_SENTENCE}'
    )
    status, answer = server.rerank(["short"] * 65)
    assert status == 400
    assert answer["error"].endswith("failed: Number of documents exceeds max_allowed_chunks")
    status, answer = server.rerank(long_documents(32, 1000))  # 64 chunks: allowed
    assert status == 200 and len(answer["results"]) == 32
    assert "exceeding max_allowed_chunks after chunking limit: 64; actual: 100" in server.output()


def test_without_guards_the_default_allows_10000(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    server = start(repository(tmp_path))
    status, answer = server.rerank(long_documents(50, 1000))
    assert status == 200 and len(answer["results"]) == 50
    status, answer = server.rerank([f"document {i}" for i in range(100)])
    assert status == 200 and len(answer["results"]) == 100


def test_a_long_document_scores_by_its_best_chunk(
    tmp_path: Path, start: Callable[..., Ovms]
) -> None:
    config = repository(tmp_path)
    edit_graph(config, RERANK, add_guards)
    server = start(config)
    padding = " ".join(f"filler{i}" for i in range(1500))
    status, answer = server.rerank([UNRELATED[0], padding + " " + RELEVANT])
    assert status == 200
    assert answer["results"][0]["index"] == 1 and answer["results"][0]["relevance_score"] > 0.8


# -- NUM_STREAMS ----------------------------------------------------------------------------------


def two_at_once(server: Ovms) -> float:
    statuses: list[int] = []

    def call() -> None:
        statuses.append(server.rerank([RELEVANT])[0])

    threads = [threading.Thread(target=call) for _ in range(2)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200, 200]
    return time.monotonic() - began


@pytest.mark.parametrize(("streams", "serial"), [("1", True), ("2", False)])
def test_num_streams(
    tmp_path: Path, start: Callable[..., Ovms], streams: str, serial: bool
) -> None:
    config = repository(tmp_path)
    edit_graph(
        config, RERANK, lambda t: t.replace('"NUM_STREAMS": "1"', f'"NUM_STREAMS": "{streams}"')
    )
    server = start(config, STANDIN_INFER_SECONDS="0.4")
    elapsed = two_at_once(server)
    if serial:
        assert elapsed >= 0.78  # the second call queued behind the first
    else:
        assert elapsed < 0.75


# -- memory: the ratchet, the card, shmem ---------------------------------------------------


def test_the_pool_ratchets_and_never_comes_back(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(repository(tmp_path))
    fresh = server.memory()
    # the seed's 1.71 GiB after load is the server's, both models: 1.11 + 0.6
    baseline = int(1.11 * GIB) + int(0.6 * GIB)
    assert fresh["resident_bytes"] == baseline
    assert fresh["servables"][RERANK] == {
        "device": "GPU",
        "state": "AVAILABLE",
        "baseline_bytes": int(1.11 * GIB),
        "pool_bytes": 0,
        "in_flight_bytes": 0,
    }
    # 40 documents of 494 words + 8 query words + 4 special tokens: T = 506
    assert server.rerank(long_documents(40, 494))[0] == 200
    large = server.memory()
    expected = int(40 * 0.0202 * GIB * (506 / 332) ** 1.78)
    assert large["servables"][RERANK]["pool_bytes"] == expected
    assert large["resident_bytes"] == baseline + expected
    assert server.rerank(["a short one", "another"])[0] == 200
    assert server.memory()["resident_bytes"] == baseline + expected
    assert server.memory()["peak_bytes"] >= baseline + expected


def test_cpu_servables_hold_no_gpu_memory(
    tmp_path: Path, start: Callable[..., Ovms], card_root: Path
) -> None:
    server = start(repository(tmp_path, "cpu"), CARDSHARE_SIM_ROOT=str(card_root))
    assert server.rerank(long_documents(10, 300))[0] == 200
    memory = server.memory()
    assert memory["resident_bytes"] == 0
    assert memory["servables"][RERANK]["device"] == "CPU"
    assert not [p for p in (card_root / "proc").iterdir() if p.name.isdigit()]
    assert "no servable on GPU; not registering" in server.output()


def card_entries(root: Path) -> list[Path]:
    return [p for p in (root / "proc").iterdir() if p.name.isdigit()]


def test_the_card_shows_the_servers_vram(
    tmp_path: Path, start: Callable[..., Ovms], card_root: Path
) -> None:
    server = start(repository(tmp_path), CARDSHARE_SIM_ROOT=str(card_root))
    entries = wait_for(lambda: card_entries(card_root), "the card entry")
    assert len(entries) == 1
    entry = entries[0]
    assert (entry / "comm").read_text() == "ovms\n"
    assert (entry / "cmdline").read_bytes().split(b"\0")[0] == b"/ovms/bin/ovms"
    fdinfo = parse_fdinfo((entry / "fdinfo" / "12").read_text())
    assert fdinfo["drm-pdev"] == PDEV
    assert simcard.read_resident_vram(card_root, PDEV) == server.memory()["resident_bytes"]
    assert server.rerank(long_documents(40, 494))[0] == 200
    resident = server.memory()["resident_bytes"]
    assert resident > int(2.31 * GIB)
    assert simcard.read_resident_vram(card_root, PDEV) == resident
    assert server.stop() == 0
    assert card_entries(card_root) == []


def test_pinned_shmem_grows_with_the_pool(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    server = start(
        repository(tmp_path), STANDIN_PINNED_SHMEM_SCALE="1e-6", STANDIN_PINNED_SHMEM_DIR=str(shm)
    )
    (pinned,) = wait_for(lambda: list(shm.iterdir()), "the pinned file")
    before = pinned.stat().st_size
    assert before == int(server.memory()["resident_bytes"] * 1e-6)
    assert server.rerank(long_documents(40, 494))[0] == 200
    after = pinned.stat().st_size
    assert after == int(server.memory()["resident_bytes"] * 1e-6) > before
    assert pinned.read_bytes()[:4] != b"\0\0\0\0"  # real bytes, not a sparse hole
    server.stop()
    assert list(shm.iterdir()) == []


# -- metrics ---------------------------------------------------------------------------------------


def metric_values(server: Ovms) -> dict[tuple[str, str, str], float]:
    status, body = server.get("/metrics")
    assert status == 200
    values = {}
    text = body.decode()
    # OVMS writes counters without the _total suffix (docs/metrics.md); the parser adds it to
    # the samples, so key by the family's name
    assert 'ovms_requests_accepted{api="V3",interface="REST",method="Unary",name="' in text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(family.name, sample.labels["name"], sample.labels.get("method", ""))] = (
                sample.value
            )
    return values


def test_metrics_count_graphs_in_process(tmp_path: Path, start: Callable[..., Ovms]) -> None:
    server = start(repository(tmp_path), "--metrics_enable", STANDIN_INFER_SECONDS="0.8")
    before = metric_values(server)
    assert before[("ovms_current_graphs", RERANK, "")] == 0
    assert before[("ovms_requests_accepted", RERANK, "Unary")] == 0
    caller = threading.Thread(target=lambda: server.rerank([RELEVANT]))
    caller.start()
    wait_for(
        lambda: metric_values(server)[("ovms_current_graphs", RERANK, "")] == 1,
        "the slow call in process",
    )
    caller.join()
    after = metric_values(server)
    assert after[("ovms_current_graphs", RERANK, "")] == 0
    assert after[("ovms_requests_accepted", RERANK, "Unary")] == 1
    assert after[("ovms_responses", RERANK, "Unary")] == 1
    assert after[("ovms_requests_rejected", RERANK, "Unary")] == 0
    assert after[("ovms_requests_accepted", EMBED, "Unary")] == 0


# -- in-process units -----------------------------------------------------------------------


def test_the_fixture_graphs_parse() -> None:
    rerank = ovms.parse_graph((FIXTURES / "rerank-graph.gpu.pbtxt").read_text())
    assert (rerank.kind, rerank.node_name, rerank.target_device) == (
        "rerank",
        "RerankExecutor",
        "GPU",
    )
    assert (rerank.num_streams, rerank.max_allowed_chunks, rerank.max_position_embeddings) == (
        1,
        10000,
        None,
    )
    guarded = ovms.parse_graph(add_guards((FIXTURES / "rerank-graph.gpu.pbtxt").read_text()))
    assert (guarded.max_allowed_chunks, guarded.max_position_embeddings) == (64, 640)
    embed = ovms.parse_graph((FIXTURES / "embeddings-graph.gpu.pbtxt").read_text())
    assert (embed.kind, embed.normalize_embeddings, embed.plugin_config) == (
        "embeddings",
        True,
        {"NUM_STREAMS": "1"},
    )


def test_chunk_plan_follows_the_calculator() -> None:
    plan = ovms.chunk_plan("q " * 8, ["a " * 10, "b " * 3], 640, 64)
    assert (len(plan.chunks), plan.width) == (2, 10 + 8 + 4)
    plan = ovms.chunk_plan("q " * 8, ["a " * 1000, "b " * 3], 640, 64)
    assert [i for i, _ in plan.chunks] == [0, 0, 1] and plan.width == 640
    with pytest.raises(
        ValueError,
        match=r"^Chunking failed: exceeding max_allowed_chunks after "
        r"chunking limit: 2; actual: 3$",
    ):
        ovms.chunk_plan("q " * 8, ["a " * 1000, "b " * 3], 640, 2)
    assert ovms.rerank_cost_bytes(64, 332) == int(64 * 0.0202 * GIB)
