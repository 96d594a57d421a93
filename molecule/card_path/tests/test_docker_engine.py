"""What a user of docker_engine cares about, read on the lab host after converge."""

import json


def test_engine_is_enabled_and_running(host):
    docker = host.service("docker")
    assert docker.is_enabled
    assert docker.is_running
    assert host.run("docker info --format '{{.ServerVersion}}'").rc == 0


def test_conflicting_podman_docker_is_gone(host):
    assert not host.package("podman-docker").is_installed
    assert host.run("rpm -q docker-compose-plugin").rc == 0


def test_compose_v2_is_at_least_2_18(host):
    version = host.check_output("docker compose version --short").lstrip("v")
    major, minor = (int(p) for p in version.split(".")[:2])
    assert (major, minor) >= (2, 18)


def test_daemon_json_rotates_logs(host):
    conf = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert conf["log-driver"] == "json-file"
    assert conf["log-opts"] == {"max-size": "50m", "max-file": "5"}
    # and the running engine uses it
    assert host.check_output("docker info --format '{{.LoggingDriver}}'") == "json-file"


def test_repository_points_at_the_configured_baseurl(host):
    repo = host.file("/etc/yum.repos.d/docker-ce-stable.repo").content_string
    assert "baseurl = file:///srv/repos/docker-ce/rhel/10/x86_64/stable" in repo


def test_published_render_gid_is_the_render_group(host):
    gid = int(host.file("/root/docker_engine_render_gid").content_string)
    assert gid == host.group("render").gid


def test_a_container_sees_the_render_node(host):
    gid = host.group("render").gid
    out = host.check_output(
        "docker run --rm --device /srv/cardshare-sim/dev/dri/renderD128:/dev/dri/renderD128 "
        f"--group-add {gid} cardshare-lab/pybase:current stat -c '%t:%T %g' /dev/dri/renderD128"
    )
    assert out == f"e2:80 {gid}"


def test_stand_in_images_were_loaded(host):
    # SIMULATION: the lab's registry stand-in loads the stand-ins when the engine starts
    images = host.check_output("docker image ls --format '{{.Repository}}:{{.Tag}}'").split()
    for name in ("vllm-standin", "comfyui-standin", "plex-standin", "pybase"):
        assert f"cardshare-lab/{name}:current" in images
