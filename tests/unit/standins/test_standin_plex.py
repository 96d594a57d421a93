"""plex_standin.py: /identity, /status/sessions with token, the simulated transcode switch."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import plex_standin as ps
import pytest
import simcard
from standin_http import serve_in_thread
from standin_testlib import parse_fdinfo, request


@pytest.mark.parametrize(
    ("text", "count"),
    [("on\n", 1), ("off", 0), ("", 0), ("2", 2), (" TRUE ", 1), ("0", 0)],
)
def test_parse_transcode_flag(text: str, count: int) -> None:
    assert ps.parse_transcode_flag(text) == count


def test_parse_transcode_flag_refuses_garbage() -> None:
    with pytest.raises(
        ValueError, match=r"^transcode flag must be on, off or a count, got 'maybe'$"
    ):
        ps.parse_transcode_flag("maybe\n")


def make_client_factory(root: Path) -> ps.ClientFactory:
    def factory(index: int) -> simcard.SimClient:
        return simcard.SimClient(ps.TRANSCODER_COMM, ["Plex Transcoder", str(index)], root=root,
                                 container_id=None)  # fmt: skip

    return factory


@pytest.fixture
def plex(tmp_path: Path, sim_env: Path) -> Iterator[tuple[int, ps.PlexState]]:
    env = {"PLEX_TOKEN": "secret-token", "PLEX_CLAIM": "claim-xyz", "STANDIN_RELEASE_SECONDS": "0"}
    state = ps.PlexState(tmp_path / "state", env, make_client_factory(sim_env))
    server = ps.PlexServer(("127.0.0.1", 0), state)
    state.start()
    serve_in_thread(server)
    yield int(server.server_address[1]), state
    server.shutdown()
    server.server_close()
    state.shutdown()


TOKEN = {"X-Plex-Token": "secret-token"}


def test_identity(plex: tuple[int, ps.PlexState]) -> None:
    port, state = plex
    status, headers, body = request(port, "GET", "/identity")
    root = ET.fromstring(body)
    assert status == 200 and headers["content-type"].startswith("text/xml")
    assert root.tag == "MediaContainer"
    assert root.attrib["claimed"] == "1"
    assert root.attrib["version"] == ps.VERSION
    assert root.attrib["machineIdentifier"] == state.machine_id
    assert b"claim-xyz" not in body
    assert b"SIMULATION" in body


def test_machine_identifier_is_kept(tmp_path: Path) -> None:
    first = ps.PlexState(tmp_path, {})
    assert ps.PlexState(tmp_path, {}).machine_id == first.machine_id
    assert first.claimed is False
    assert len(first.machine_id) == 40


@pytest.mark.parametrize(
    ("headers", "path", "status"),
    [
        ({}, "/status/sessions", 401),
        ({"X-Plex-Token": "wrong"}, "/status/sessions", 401),
        (TOKEN, "/status/sessions", 200),
        ({}, "/status/sessions?X-Plex-Token=secret-token", 200),
    ],
)
def test_sessions_need_the_token(
    plex: tuple[int, ps.PlexState], headers: dict[str, str], path: str, status: int
) -> None:
    assert request(plex[0], "GET", path, headers=headers)[0] == status


def transcodes(port: int) -> list[dict[str, str]]:
    root = ET.fromstring(request(port, "GET", "/status/sessions", headers=TOKEN)[2])
    assert root.attrib["size"] == str(len(root.findall("Video")))
    return [t.attrib for t in root.iter("TranscodeSession")]


def plex_clients(root: Path) -> list[Path]:
    return [p for p in (root / "proc").iterdir()
            if p.name.isdigit() and (p / "comm").read_text() == "Plex Transcoder\n"]  # fmt: skip


def test_transcode_switch_registers_a_video_client(
    plex: tuple[int, ps.PlexState], sim_env: Path
) -> None:
    port, state = plex
    assert transcodes(port) == []
    assert request(port, "POST", "/:/cardshare-sim/transcode?state=on")[0] == 200
    [session] = transcodes(port)
    for key in (
        "transcodeHwRequested",
        "transcodeHwDecoding",
        "transcodeHwEncoding",
        "transcodeHwFullPipeline",
    ):
        assert session[key] == "1"  # fmt: skip
    [entry] = plex_clients(sim_env)
    state.clients[0].refresh()
    pairs = parse_fdinfo((entry / "fdinfo" / str(simcard.DRM_FD)).read_text())
    assert pairs["drm-resident-vram0"] == "2048 MiB"
    assert int(pairs["drm-cycles-vcs"]) > 0
    assert pairs["drm-cycles-ccs"] == "0"
    assert request(port, "POST", "/:/cardshare-sim/transcode?state=on&count=2")[0] == 200
    assert len(transcodes(port)) == 2 and len(plex_clients(sim_env)) == 2
    assert request(port, "POST", "/:/cardshare-sim/transcode?state=off")[0] == 200
    assert transcodes(port) == [] and plex_clients(sim_env) == []


def test_flag_file_switches_too(plex: tuple[int, ps.PlexState], sim_env: Path) -> None:
    port, state = plex
    state.flag_path.write_text("on\n")
    state.reconcile()
    assert len(transcodes(port)) == 1
    state.flag_path.write_text("off\n")
    state.reconcile()
    assert plex_clients(sim_env) == []


def test_bad_switch_is_400(plex: tuple[int, ps.PlexState]) -> None:
    status, _, body = request(plex[0], "POST", "/:/cardshare-sim/transcode?state=sideways")
    assert status == 400
    assert b"transcode flag must be on, off or a count" in body
