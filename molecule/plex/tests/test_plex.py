"""What a user of plex cares about, read from the lab host's engine after converge.

SIMULATION: the image is the lab's Plex stand-in (lab/standins/README.md); its transcodes are
switched on through the stand-in's lab control and show as DRM clients on the simulated card.
"""

import json
import re
from pathlib import PurePosixPath

import pytest
from labtest import wait_for

PROJECT_FILTER = (
    "--filter label=com.docker.compose.project=plex --filter label=com.docker.compose.service=plex"
)
PLEX = "http://127.0.0.1:32400"
SIM = "/srv/cardshare-sim"
PREFERENCES = (
    "/var/lib/cardshare/plex/config/Library/Application Support/Plex Media Server/Preferences.xml"
)


def http(host, url, method="GET"):
    script = (
        "import sys, urllib.request as u; "
        "post = sys.argv[2] == 'POST'; "
        "r = u.Request(sys.argv[1], method=sys.argv[2], data=b'' if post else None); "
        "sys.stdout.write(u.urlopen(r, timeout=10).read().decode())"
    )
    return host.check_output(f"python3 -c \"{script}\" '{url}' {method}")


def container(host):
    ids = host.check_output(
        f"docker container ls --all --quiet --no-trunc {PROJECT_FILTER}"
    ).split()
    assert len(ids) == 1, ids
    return json.loads(host.check_output(f"docker container inspect {ids[0]}"))[0]


def transcoders(host, container_id):
    """Simulated DRM clients named `Plex Transcoder` whose cgroup is the Plex container."""
    out = host.run(
        f"grep -l -x 'Plex Transcoder' {SIM}/proc/[0-9]*/comm 2>/dev/null"
    ).stdout.split()
    pids = []
    for comm in out:
        proc = PurePosixPath(comm).parent
        cgroup = host.file(f"{proc}/cgroup").content_string
        if container_id in cgroup:
            pids.append(proc.name)
    return pids


def test_runs_healthy_on_the_host_network(host):
    c = container(host)
    assert c["State"]["Running"]
    assert c["State"]["Health"]["Status"] == "healthy"
    assert c["HostConfig"]["NetworkMode"] == "host"
    assert c["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"


def test_carries_the_card_and_the_render_group(host):
    c = container(host)
    devices = [(d["PathOnHost"], d["PathInContainer"]) for d in c["HostConfig"]["Devices"]]
    assert devices == [(f"{SIM}/dev/dri", "/dev/dri")]
    gid = host.group("render").gid
    assert int(host.file("/root/docker_engine_render_gid").content_string) == gid
    assert c["HostConfig"]["GroupAdd"] == [str(gid)]
    # and the running container sees the render node as a DRM character device
    out = host.check_output(f"docker exec {c['Id']} stat -c '%F %t:%T' /dev/dri/renderD128")
    assert out == "character special file e2:80"


def test_mounts_config_transcode_data_and_time_zone(host):
    c = container(host)
    mounts = {m["Destination"]: m["Source"] for m in c["Mounts"]}
    assert mounts["/config"] == "/var/lib/cardshare/plex/config"
    assert mounts["/transcode"] == "/var/lib/cardshare/plex/transcode"
    assert mounts["/data"] == "/var/lib/cardshare/plex/data"
    assert "TZ=Etc/UTC" in c["Config"]["Env"]


def test_claim_token_passed_on_the_first_run_only(host):
    # converge ran the role with a (made-up) token before and after the server had a
    # Preferences.xml (SIMULATION: written by converge, as the real server writes it on its
    # first start): the first run passed the token, the second no longer does
    assert host.file(f"{PREFERENCES}").exists
    assert "claim-" not in host.file("/opt/cardshare/plex/compose.yaml").content_string
    env_file = host.file("/opt/cardshare/plex/plex-claim.env")
    assert env_file.mode == 0o600
    assert env_file.user == "root"
    assert not re.search(r"^PLEX_CLAIM=", env_file.content_string, re.M)
    # the first run's server got the token (the stand-in reports it as claimed="1")
    assert 'claimed="1"' in host.file("/root/plex_first_run_identity.xml").content_string
    # the second run recreated the container without it (compose sees the env file change)
    assert not any(e.startswith("PLEX_CLAIM=") for e in container(host)["Config"]["Env"])


def test_identity_answers(host):
    identity = http(host, f"{PLEX}/identity")
    assert re.search(r'<MediaContainer[^>]* machineIdentifier="[0-9a-f]+"', identity)
    assert re.search(r' version="1\.\d+\.\d+\.\d+-[0-9a-f]+"', identity)


@pytest.fixture
def transcode_on(host):
    """SIMULATION: switch a transcode on through the stand-in's lab control, off afterwards."""
    http(host, f"{PLEX}/:/cardshare-sim/transcode?state=on", method="POST")
    try:
        yield
    finally:
        http(host, f"{PLEX}/:/cardshare-sim/transcode?state=off", method="POST")


def test_a_transcode_shows_on_the_card_and_in_sessions(host, transcode_on):
    cid = container(host)["Id"]
    pids = wait_for("a Plex Transcoder on the card", lambda: transcoders(host, cid), 30, step=0.5)
    assert len(pids) == 1, pids
    fdinfo = host.check_output(f"cat {SIM}/proc/{pids[0]}/fdinfo/*")
    assert re.search(r"^drm-cycles-vcs:\s+\d+", fdinfo, re.M)
    sessions = http(host, f"{PLEX}/status/sessions")
    assert '<MediaContainer size="1"' in sessions
    session = re.search(r"<TranscodeSession [^>]*>", sessions)
    assert session, sessions
    for attr in ("transcodeHwRequested", "transcodeHwDecoding", "transcodeHwEncoding"):
        assert f'{attr}="1"' in session.group(0)


def test_no_transcoder_when_transcodes_are_off(host):
    cid = container(host)["Id"]
    wait_for("no Plex Transcoder on the card", lambda: not transcoders(host, cid), 15, step=0.5)
    assert '<MediaContainer size="0"' in http(host, f"{PLEX}/status/sessions")
