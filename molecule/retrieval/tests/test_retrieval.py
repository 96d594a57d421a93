"""What a user of the retrieval tier cares about, read on the lab host after side_effect.

The server is the lab's OVMS stand-in (SIMULATION, lab/standins/README.md) on the simulated
card; the values come from the engine, the server's answers and the files on the host.
"""

import json

import pytest

URL = "http://127.0.0.1:8100"
MODELS = ("bge-m3", "bge-reranker-v2-m3")
SERVING = "/var/lib/cardshare/retrieval/models/gpu"

HTTP = """
import json, sys, urllib.error, urllib.request
method, url, body = sys.argv[1], sys.argv[2], sys.argv[3]
data = body.encode() if body else None
req = urllib.request.Request(url, data=data, method=method,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=30) as resp:
        print(resp.status); print(resp.read().decode())
except urllib.error.HTTPError as err:
    print(err.code); print(err.read().decode())
"""


def call(host, method, path, body=None):
    out = host.check_output(
        "python3 -c %s %s %s %s",
        HTTP,
        method,
        URL + path,
        json.dumps(body) if body is not None else "",
    )
    status, _, text = out.partition("\n")
    return int(status), text


@pytest.fixture(scope="module")
def container(host):
    return json.loads(host.check_output("docker inspect retrieval-ovms-1"))[0]


def test_the_server_runs_healthy_with_the_card_and_its_cap(container):
    assert container["State"]["Running"] and container["State"]["Health"]["Status"] == "healthy"
    assert container["Config"]["Image"] == "cardshare-lab/ovms-standin:current"
    assert [d["PathInContainer"] for d in container["HostConfig"]["Devices"]] == [
        "/dev/dri/renderD128"
    ]
    # the lab's guards (32 x 512): worst sequence 4.51 GiB at 70 % of a 6591 MiB cap
    assert container["HostConfig"]["Memory"] == 6591 * 1024**2
    assert container["Config"]["Labels"]["io.cardshare.revision"] == "lab-2026.2.1-r2"
    # the healthcheck asks each model, not the server
    test = " ".join(container["Config"]["Healthcheck"]["Test"])
    assert "/v2/models/%s/ready" in test and "bge-reranker-v2-m3" in test


@pytest.mark.parametrize("model", MODELS)
def test_each_model_is_ready_and_available(host, model):
    assert call(host, "GET", f"/v2/models/{model}/ready")[0] == 200
    status, text = call(host, "GET", "/v1/config")
    assert status == 200
    # served by its highest AVAILABLE version, as the server serves an unversioned request
    versions = json.loads(text)[model]["model_version_status"]
    assert [v for v in versions if v["state"] == "AVAILABLE"], versions


def test_the_guards_are_in_the_served_graph_and_refuse_with_the_servers_words(host):
    graph = host.file(f"{SERVING}/bge-reranker-v2-m3/graph.pbtxt").content_string
    assert "max_allowed_chunks: 32" in graph and "max_position_embeddings: 512" in graph
    status, text = call(
        host,
        "POST",
        "/v3/rerank",
        # 20 documents of 1000 words: two chunks each at a 512-token row (query and four
        # special tokens included) -> 40 chunks, above the 32 allowed
        {"model": "bge-reranker-v2-m3", "query": "q", "documents": ["w " * 1000] * 20},
    )
    assert status == 400
    assert (
        "Chunking failed: exceeding max_allowed_chunks after chunking limit: 32; actual: 40" in text
    )


def test_the_marker_holds_the_revision_and_the_record_the_width(host):
    marker = json.loads(host.file(f"{SERVING}/.cardshare-seed").content_string)
    assert marker["revision"] == "lab-2026.2.1-r2"
    assert not host.file(f"{SERVING}/.cardshare-seed.partial").exists
    record = json.loads(host.file("/var/lib/cardshare/retrieval/tier.json").content_string)
    status, text = call(host, "POST", "/v3/embeddings", {"model": "bge-m3", "input": "one text"})
    assert status == 200
    assert record["embedding_dimension"] == len(json.loads(text)["data"][0]["embedding"])
    assert record["revision"] == "lab-2026.2.1-r2"


def test_the_probe_ranks_the_relevant_document_first(host):
    status, text = call(
        host,
        "POST",
        "/v3/rerank",
        {
            "model": "bge-reranker-v2-m3",
            "query": "water pump replacement",
            "documents": ["bread and butter", "replace the water pump", "a symphony"],
        },
    )
    assert status == 200
    results = json.loads(text)["results"]
    assert results[0]["index"] == 1 and results[0]["relevance_score"] > 0.1


def test_the_watchdog_timer_is_hardened_and_has_run(host):
    timer = host.service("cardshare-retrieval-watchdog.timer")
    assert timer.is_running and timer.is_enabled
    props = host.check_output(
        "systemctl show cardshare-retrieval-watchdog.service "
        "-p NoNewPrivileges -p ProtectSystem -p PrivateDevices -p IPAddressDeny"
    )
    assert "NoNewPrivileges=yes" in props and "ProtectSystem=strict" in props
    state = json.loads(
        host.file("/var/lib/cardshare/retrieval/watchdog/ratchet.json").content_string
    )
    # the side effect's run restarted the server once
    assert state["restarts_total"] >= 1
    prom = host.file(
        "/var/lib/node_exporter/textfile_collector/cardshare-retrieval.prom"
    ).content_string
    assert "cardshare_retrieval_restarts_total" in prom


def test_nothing_of_the_cpu_arm_is_left(host):
    assert (
        host.check_output(
            "docker ps --all --quiet --filter label=com.docker.compose.project=retrieval-cpu-arm"
        )
        == ""
    )
    assert not host.file("/var/lib/cardshare/retrieval/models/cpu").exists
    bench = json.loads(host.file("/var/lib/cardshare/retrieval/bench/cpu.json").content_string)
    assert bench["record"]["arm"] == "cpu"
    assert bench["record"]["base_url"] == "http://127.0.0.1:8101"
