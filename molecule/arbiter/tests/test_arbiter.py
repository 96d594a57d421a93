"""What a user of the arbiter role cares about, read on the lab host after converge.

HTTP goes through python3's urllib on the lab host (the services listen on its 127.0.0.1).
"""

import json
import re
import shlex

from labtest import wait_for

ARBITER = "http://127.0.0.1:8090"
PROXY = "http://127.0.0.1:8080"
TOKEN_FILE = "/etc/cardshare/arbiter/token"
MODEL = "Qwen2.5-7B-Instruct"

# One HTTP request on the lab host; prints {"status", "headers", "body"} (body as text, or
# base64 for binary answers).
_HTTP = r"""
import base64, json, sys, urllib.error, urllib.request
method, url, body, token = sys.argv[1:5]
headers = {"Content-Type": "application/json"}
if token:
    headers["Authorization"] = "Bearer " + open(token).read().strip()
req = urllib.request.Request(url, data=body.encode() if body else None, method=method,
                             headers=headers)
try:
    resp = urllib.request.urlopen(req, timeout=150)
    status, raw, hdrs = resp.status, resp.read(), dict(resp.headers)
except urllib.error.HTTPError as exc:
    status, raw, hdrs = exc.code, exc.read(), dict(exc.headers)
try:
    text = raw.decode()
except UnicodeDecodeError:
    text = "base64:" + base64.b64encode(raw).decode()
print(json.dumps({"status": status, "headers": hdrs, "body": text}))
"""


def http(host, method, url, body=None, token=False):
    cmd = "python3 -c {} {} {} {} {}".format(
        shlex.quote(_HTTP),
        method,
        shlex.quote(url),
        shlex.quote(json.dumps(body) if body is not None else ""),
        TOKEN_FILE if token else "''",
    )
    return json.loads(host.check_output(cmd))


def inspect(host, name):
    return json.loads(host.check_output(f"docker inspect {name}"))[0]


def test_status_reports_llm(host):
    answer = http(host, "GET", f"{ARBITER}/v1/status")
    assert answer["status"] == 200
    status = json.loads(answer["body"])
    assert status["mode"] == "llm"
    assert status["alerts"] == []


def test_a_completion_passes_the_proxy(host):
    answer = http(
        host,
        "POST",
        f"{PROXY}/v1/completions",
        {"model": MODEL, "prompt": "ping", "max_tokens": 1},
    )
    assert answer["status"] == 200
    doc = json.loads(answer["body"])
    assert doc["model"] == MODEL
    assert len(doc["choices"]) == 1


def test_a_job_without_the_token_is_refused(host):
    answer = http(host, "POST", f"{ARBITER}/v1/jobs", {"workflow": {}})
    assert answer["status"] == 401
    assert json.loads(answer["body"]) == {"error": "missing or wrong bearer token"}


def test_token_is_private_and_long(host):
    token = host.file(TOKEN_FILE)
    assert token.mode == 0o600
    assert (token.user, token.group) == ("root", "root")
    assert re.fullmatch(r"[A-Za-z0-9]{48}\n", token.content_string)
    assert host.file("/etc/cardshare/arbiter").mode == 0o700


def test_both_containers_run_the_built_image_with_host_networking(host):
    tag = None
    for name in ("arbiter-arbiter-1", "arbiter-proxy-1"):
        doc = inspect(host, name)
        assert doc["State"]["Running"]
        assert doc["State"]["Health"]["Status"] == "healthy"
        assert doc["HostConfig"]["NetworkMode"] == "host"
        tag = tag or doc["Config"]["Image"]
        assert doc["Config"]["Image"] == tag
    name, version_hash = tag.split(":")
    assert name == "cardshare/arbiter"
    version, short_hash = version_hash.rsplit("-", 1)
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", version)
    labels = inspect(host, tag)["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version
    assert labels["io.cardshare.source-hash"].startswith(short_hash)
    # the package is installed in the image, with its command line
    out = host.check_output(f"docker run --rm {tag} cardshare --help")
    assert "scan" in out


def test_arbiter_mounts(host):
    doc = inspect(host, "arbiter-arbiter-1")
    mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in doc["Mounts"]}
    assert mounts["/var/run/docker.sock"] == ("/var/run/docker.sock", True)
    assert mounts["/var/lib/cardshare/arbiter"] == ("/var/lib/cardshare/arbiter", True)
    assert mounts["/run/secrets/cardshare-arbiter"] == ("/etc/cardshare/arbiter", False)
    assert mounts["/etc/cardshare/arbiter.json"] == ("/opt/cardshare/arbiter/arbiter.json", False)
    # SIMULATION: the lab's card root, read-only at the same path (no pid: host in the lab)
    assert mounts["/srv/cardshare-sim"] == ("/srv/cardshare-sim", False)
    assert mounts["/srv/cardshare-recorder"] == ("/var/lib/cardshare/recorder", False)
    assert doc["HostConfig"]["PidMode"] == ""


def test_arbiter_config_carries_the_lab_timings(host):
    doc = inspect(host, "arbiter-arbiter-1")
    assert doc["Config"]["Cmd"] == [
        "python3",
        "-m",
        "cardshare.arbiter",
        "--config",
        "/etc/cardshare/arbiter.json",
    ]
    conf = json.loads(
        host.check_output("docker exec arbiter-arbiter-1 cat /etc/cardshare/arbiter.json")
    )
    assert conf["idle_seconds"] == 5
    assert conf["served_model_name"] == MODEL
    assert conf["llm_client_names"] == ["vllm/vllm"]
    assert conf["image_client_names"] == ["comfyui/comfyui"]
    assert conf["card_current_json"] == "/var/lib/cardshare/arbiter/card/current.json"


def test_fresh_scan_inside_the_arbiter_names_vllm(host):
    host.check_output(
        "docker exec arbiter-arbiter-1 python3 -m cardshare scan --root /srv/cardshare-sim "
        "--data-dir /var/lib/cardshare/arbiter/card --podman-socket= --quiet"
    )
    snap = json.loads(host.file("/var/lib/cardshare/arbiter/card/current.json").content_string)
    names = {c["name"] for card in snap["cards"].values() for c in card["clients"]}
    assert "vllm/vllm" in names


WORKFLOW = {
    "1": {
        "class_type": "CheckpointLoaderSimple",
        "inputs": {"ckpt_name": "flux1-kontext-dev-fp8.safetensors"},
    },
    "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 1]}},
    "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
    "4": {
        "class_type": "EmptyLatentImage",
        "inputs": {"width": 512, "height": 512, "batch_size": 1},
    },
    "5": {
        "class_type": "KSampler",
        "inputs": {
            "model": ["1", 0],
            "seed": 7,
            "steps": 4,
            "cfg": 1.0,
            "sampler_name": "euler",
            "scheduler": "simple",
            "positive": ["2", 0],
            "negative": ["3", 0],
            "latent_image": ["4", 0],
            "denoise": 1.0,
        },
    },
    "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
    "7": {
        "class_type": "SaveImage",
        "inputs": {"images": ["6", 0], "filename_prefix": "molecule"},
    },
}


def test_one_image_job_end_to_end(host):
    """Idle agents: the arbiter lends the card to ComfyUI, runs the job, and hands it back."""
    answer = http(host, "POST", f"{ARBITER}/v1/jobs", {"workflow": WORKFLOW}, token=True)
    assert answer["status"] == 201, answer
    job_id = json.loads(answer["body"])["id"]

    def job():
        doc = json.loads(http(host, "GET", f"{ARBITER}/v1/jobs/{job_id}", token=True)["body"])
        return doc if doc["state"] in ("done", "failed") else None

    final = wait_for(
        "the job to end",
        job,
        180,
        step=2,
        explain=lambda: http(host, "GET", f"{ARBITER}/v1/status")["body"],
    )
    assert final["state"] == "done", final

    assert http(host, "GET", f"{ARBITER}/v1/jobs/{job_id}/outputs/0")["status"] == 401
    png = http(host, "GET", f"{ARBITER}/v1/jobs/{job_id}/outputs/0", token=True)
    assert png["status"] == 200
    assert png["headers"]["Content-Type"] == "image/png"
    assert png["body"].startswith("base64:iVBORw0KGgo")  # the PNG signature

    def back_to_llm():
        status = json.loads(http(host, "GET", f"{ARBITER}/v1/status")["body"])
        return status if status["mode"] == "llm" and status["queue_length"] == 0 else None

    status = wait_for(
        "llm mode with an empty queue",
        back_to_llm,
        120,
        step=2,
        explain=lambda: http(host, "GET", f"{ARBITER}/v1/status")["body"],
    )
    assert status["swaps"], status
    assert inspect(host, "vllm-vllm-1")["State"]["Health"]["Status"] in ("healthy", "starting")
    completion = http(
        host, "POST", f"{PROXY}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    )
    assert completion["status"] == 200
    assert not inspect(host, "comfyui-comfyui-1")["State"]["Running"]
