"""What a user of the vllm role cares about, read on the lab host after converge.

The values come from the engine's view of the running container and from the server's
answers, never from the rendered compose file. The lab card is simulated (32 GiB, see
lab/SIMULATION.md) and the server is the lab's vLLM stand-in.
"""

import json
import re
import shlex

import pytest

GIB = 1024**3
CARD = 32 * GIB
SIM_ROOT = "/srv/cardshare-sim"
URL = "http://127.0.0.1:8000"

# Run on the lab host: one HTTP request with the standard library, status and body out.
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


def http(host, method, path, body=None):
    payload = json.dumps(body) if body is not None else ""
    out = host.check_output(
        "python3 -c %s %s %s %s",
        HTTP,
        method,
        URL + path,
        payload,
    )
    status, _, text = out.partition("\n")
    return int(status), text


@pytest.fixture(scope="module")
def container(host):
    ids = host.check_output(
        "docker ps --quiet --no-trunc --filter label=com.docker.compose.project=vllm "
        "--filter label=com.docker.compose.service=vllm"
    ).split()
    assert len(ids) == 1, f"expected one running vllm container, found {ids}"
    return json.loads(host.check_output("docker inspect %s", ids[0]))[0]


def flag(args, name):
    return args[args.index(name) + 1]


def test_utilisation_is_computed_from_the_card_and_its_tenants(container):
    # 32 GiB card, two 2 GiB Plex transcodes, the retrieval tier's 4614 MiB (the lab's
    # vllm_reservations), 0.8 GiB driver headroom -> 23238.8 / 32768 MiB -> 0.70
    assert flag(container["Config"]["Cmd"], "--gpu-memory-utilization") == "0.70"


def test_context_is_64k_with_yarn_factor_2(container):
    args = container["Config"]["Cmd"]
    assert flag(args, "--max-model-len") == "65536"
    overrides = json.loads(flag(args, "--hf-overrides"))
    assert overrides == {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 32768,
        }
    }
    assert "--rope-scaling" not in args


def test_tool_calls_use_the_hermes_parser(container):
    args = container["Config"]["Cmd"]
    assert "--enable-auto-tool-choice" in args
    assert flag(args, "--tool-call-parser") == "hermes"
    assert "--quantization" not in args


def test_model_path_and_served_name(container):
    args = container["Config"]["Cmd"]
    assert args[0] == "/llm/models/Qwen2.5-7B-Instruct"
    assert flag(args, "--served-model-name") == "Qwen2.5-7B-Instruct"
    mounts = {m["Destination"]: m for m in container["Mounts"]}
    assert mounts["/llm/models"]["Source"] == "/var/lib/cardshare/models"
    assert mounts["/llm/models"]["RW"] is False
    assert mounts["/root/.cache/huggingface"]["Source"] == "/var/lib/cardshare/hf-cache"


def test_memory_cap_is_16g(container):
    assert container["HostConfig"]["Memory"] == 16 * GIB
    assert container["State"]["OOMKilled"] is False


def test_container_has_the_card_the_render_group_and_host_network(host, container):
    hc = container["HostConfig"]
    assert hc["NetworkMode"] == "host"
    assert hc["GroupAdd"] == [str(host.group("render").gid)]
    assert {"PathOnHost": f"{SIM_ROOT}/dev/dri", "PathInContainer": "/dev/dri"}.items() <= (
        hc["Devices"][0].items()
    )
    assert hc["ShmSize"] == 32 * GIB
    assert hc["RestartPolicy"]["Name"] == "unless-stopped"
    out = host.check_output("docker exec %s stat -c %%t:%%T /dev/dri/renderD128", container["Id"])
    assert out == "e2:80"


def test_environment(container):
    env = dict(item.split("=", 1) for item in container["Config"]["Env"])
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "ZE_AFFINITY_MASK" not in env
    assert env["CARDSHARE_SIM_ROOT"] == SIM_ROOT  # lab inventory (SIMULATION)


def test_container_is_healthy_by_its_python_healthcheck(container):
    assert container["State"]["Health"]["Status"] == "healthy"
    assert container["Config"]["Healthcheck"]["Test"][:2] == ["CMD", "python3"]


def test_health_answers_200(host):
    status, body = http(host, "GET", "/health")
    assert (status, body) == (200, "")


def test_models_show_the_planned_context(host):
    status, body = http(host, "GET", "/v1/models")
    assert status == 200
    models = {m["id"]: m for m in json.loads(body)["data"]}
    assert models["Qwen2.5-7B-Instruct"]["max_model_len"] == 65536


def test_one_token_completion(host):
    status, body = http(
        host,
        "POST",
        "/v1/completions",
        {"model": "Qwen2.5-7B-Instruct", "prompt": "Say hi", "max_tokens": 1},
    )
    assert status == 200
    reply = json.loads(body)
    assert reply["usage"]["completion_tokens"] == 1
    assert reply["choices"][0]["finish_reason"] == "length"


def test_chat_with_tools_returns_tool_calls(host):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    status, body = http(
        host,
        "POST",
        "/v1/chat/completions",
        {
            "model": "Qwen2.5-7B-Instruct",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [tool],
        },
    )
    assert status == 200
    choice = json.loads(body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


_SIZE = re.compile(r"^drm-resident-vram0:\s*(\d+)(?:\s+(KiB|MiB|GiB))?\s*$", re.MULTILINE)
_UNIT = {None: 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB}


def test_registered_on_the_simulated_card_with_its_share(host, container):
    # SIMULATION: the stand-in is a DRM client of the lab's card, named by its container
    script = (
        f"for d in {SIM_ROOT}/proc/[0-9]*; do "
        f'grep -qs {shlex.quote(container["Id"])} "$d/cgroup" && cat "$d"/fdinfo/*; done'
    )
    fdinfo = host.check_output("bash -c %s", script)
    match = _SIZE.search(fdinfo)
    assert match, f"no drm-resident-vram0 in the container's fdinfo: {fdinfo!r}"
    vram = int(match.group(1)) * _UNIT[match.group(2)]
    assert abs(vram - 0.70 * CARD) <= 1024**2
    assert "drm-driver:\txe" in fdinfo or re.search(r"^drm-driver:\s+xe$", fdinfo, re.M)


def test_published_plan(host):
    plan = json.loads(host.file("/root/vllm_plan.json").content_string)
    assert plan["gpu_memory_utilization"] == 0.70
    assert plan["context"]["yarn_factor"] == 2.0
    assert plan["memory_limit_bytes"] == 16 * GIB
    assert plan["url"] == URL
    assert (plan["compose_project"], plan["compose_service"]) == ("vllm", "vllm")


# The ladder (lab card 32 GiB, Qwen2.5-7B: 15 GiB of weights, 1 GiB of runtime, 56 KiB of KV
# cache per token, two sequences): 49152 tokens need 21.25 GiB -> 0.67, 32768 need 19.5 GiB
# -> 0.61, both below the full plan's 0.70.
LADDER = [
    ("vllm", "vllm", 0.70, 65536),
    ("vllm-ladder", "plan1", 0.67, 49152),
    ("vllm-ladder", "plan2", 0.61, 32768),
]


def _inspect(host, project, service):
    ids = host.check_output(
        "docker ps --all --quiet --no-trunc --filter label=com.docker.compose.project=%s "
        "--filter label=com.docker.compose.service=%s",
        project,
        service,
    ).split()
    assert len(ids) == 1, f"expected one {project}/{service} container, found {ids}"
    return json.loads(host.check_output("docker inspect %s", ids[0]))[0]


@pytest.mark.parametrize(("project", "service", "util", "length"), LADDER[1:])
def test_smaller_plans_are_created_not_started(host, project, service, util, length):
    c = _inspect(host, project, service)
    assert c["State"]["Status"] == "created"
    args = c["Config"]["Cmd"]
    assert flag(args, "--gpu-memory-utilization") == f"{util:.2f}"
    assert flag(args, "--max-model-len") == str(length)
    if length > 32768:
        factor = json.loads(flag(args, "--hf-overrides"))["rope_scaling"]["factor"]
        assert factor == 1.5  # the smallest factor that reaches 49152 over 32768
    else:
        assert "--hf-overrides" not in args
    assert c["HostConfig"]["Memory"] == 16 * GIB
    assert c["HostConfig"]["NetworkMode"] == "host"


def test_published_ladder_for_the_arbiter(host):
    plan = json.loads(host.file("/root/vllm_plan.json").content_string)
    got = [
        (p.get("project", "vllm"), p["service"], p["gpu_memory_utilization"], p["max_model_len"])
        for p in plan["arbiter_plans"]
    ]
    assert got == LADDER
    reservations = [p["reservation_bytes"] for p in plan["arbiter_plans"]]
    assert reservations == sorted(reservations, reverse=True)
    assert plan["driver_headroom_bytes"] == int(0.8 * GIB)


def _wait_health(host):
    host.check_output(
        "for i in $(seq 60); do python3 -c %s GET %s/health '' | head -1 | grep -qx 200 "
        "&& exit 0; sleep 1; done; exit 1",
        HTTP,
        URL,
    )


def test_a_smaller_plan_really_starts_and_serves_its_context(host):
    """The stand-in refuses what vLLM refuses (a context beyond the window, memory short):
    the smallest plan started in place of the full one serves 32768 tokens on the same port."""
    small = _inspect(host, "vllm-ladder", "plan2")["Id"]
    full = _inspect(host, "vllm", "vllm")["Id"]
    host.check_output("docker stop %s", full)
    try:
        host.check_output("docker start %s", small)
        _wait_health(host)
        status, body = http(host, "GET", "/v1/models")
        assert status == 200
        assert [m["max_model_len"] for m in json.loads(body)["data"]] == [32768]
    finally:
        host.run("docker stop %s", small)
        host.check_output("docker start %s", full)
        _wait_health(host)
