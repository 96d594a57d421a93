"""What a user of comfyui cares about, read from the lab host's engine after converge.

SIMULATION: the image is the lab's ComfyUI stand-in (lab/standins/README.md) with placeholder
model files; the role and the engine are real.
"""

import json

import pytest
from labtest import wait_for

PROJECT_FILTER = (
    "--filter label=com.docker.compose.project=comfyui "
    "--filter label=com.docker.compose.service=comfyui"
)
API = "http://127.0.0.1:8188"
MODELS = "/var/lib/cardshare/comfyui/models"
KONTEXT = "flux1-dev-kontext_fp8_scaled.safetensors"


def http_get(host, url):
    """GET url from the lab host itself (the API is published on its 127.0.0.1)."""
    script = (
        "import sys, urllib.request as u; "
        "sys.stdout.write(u.urlopen(sys.argv[1], timeout=10).read().decode())"
    )
    return host.check_output(f"python3 -c '{script}' '{url}'")


def container(host):
    ids = host.check_output(
        f"docker container ls --all --quiet --no-trunc {PROJECT_FILTER}"
    ).split()
    assert len(ids) == 1, ids
    return json.loads(host.check_output(f"docker container inspect {ids[0]}"))[0]


def test_created_and_left_stopped(host):
    c = container(host)
    assert not c["State"]["Running"]
    # created by the role; "exited" once the role's verify probe has started and stopped it
    assert c["State"]["Status"] in ("created", "exited")
    assert c["HostConfig"]["RestartPolicy"]["Name"] in ("", "no")


def test_carries_the_card_and_the_render_group(host):
    c = container(host)
    devices = [(d["PathOnHost"], d["PathInContainer"]) for d in c["HostConfig"]["Devices"]]
    assert devices == [("/srv/cardshare-sim/dev/dri", "/dev/dri")]
    gid = int(host.file("/root/docker_engine_render_gid").content_string)
    assert gid == host.group("render").gid
    assert c["HostConfig"]["GroupAdd"] == [str(gid)]


def test_publishes_the_api_on_localhost_only(host):
    c = container(host)
    assert c["HostConfig"]["PortBindings"] == {
        "8188/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8188"}]
    }


def test_mounts_models_input_and_output(host):
    mounts = {m["Destination"]: m["Source"] for m in container(host)["Mounts"]}
    assert mounts["/opt/ComfyUI/models"] == MODELS
    assert mounts["/opt/ComfyUI/input"] == "/var/lib/cardshare/comfyui/input"
    assert mounts["/opt/ComfyUI/output"] == "/var/lib/cardshare/comfyui/output"
    # SIMULATION: the lab mounts the simulated card's root at the same path
    assert mounts["/srv/cardshare-sim"] == "/srv/cardshare-sim"


def test_healthcheck_uses_python_not_curl(host):
    test = container(host)["Config"]["Healthcheck"]["Test"]
    assert test[:3] == ["CMD", "python3", "-c"]
    assert "/object_info" in test[3]
    assert "curl" not in " ".join(test)


def test_compose_file_is_managed_and_valid(host):
    compose = host.file("/opt/cardshare/comfyui/compose.yaml")
    assert compose.mode == 0o640
    assert "Ansible managed" in compose.content_string.splitlines()[0]
    assert host.run("docker compose --project-directory /opt/cardshare/comfyui config -q").rc == 0


def test_the_probe_marked_the_container_it_proved(host):
    """comfyui_probe auto probes a container until it has passed once: the mark names this one."""
    mark = host.file("/opt/cardshare/comfyui/probe-passed")
    assert mark.is_file
    assert mark.user == "root"
    assert mark.content_string.strip() == container(host)["Id"]


@pytest.fixture
def started(host):
    """Start the stopped container as the arbiter would, and stop it again afterwards."""
    cid = container(host)["Id"]
    host.check_output(f"docker container start {cid}")
    try:
        yield cid
    finally:
        host.check_output(f"docker container stop --time 30 {cid}")


def test_starts_answers_and_stops_again(host, started):
    wait_for(
        "the container to become healthy",
        lambda: (
            host.check_output(
                "docker container inspect --format '{{.State.Health.Status}}' " + started
            )
            == "healthy"
        ),
        90,
    )
    stats = json.loads(http_get(host, f"{API}/system_stats"))
    assert stats["devices"] and stats["devices"][0]["vram_total"] > 0
    info = json.loads(http_get(host, f"{API}/object_info"))
    assert {"UNETLoader", "DualCLIPLoader", "VAELoader", "SaveImage"} <= info.keys()
    # the models directory reaches the container: the Kontext file is a choice of the loader
    assert KONTEXT in info["UNETLoader"]["input"]["required"]["unet_name"][0]
    assert "ae.safetensors" in info["VAELoader"]["input"]["required"]["vae_name"][0]


def test_is_stopped_after_the_probe(host):
    assert not container(host)["State"]["Running"]
    probe = f"import urllib.request as u; u.urlopen('{API}/', timeout=3)"
    assert host.run(f'python3 -c "{probe}"').rc != 0
