"""Tests of cardshare.naming: cgroup paths, command rules, the engine API resolver."""

from __future__ import annotations

import http.server
import json
import re
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cardshare.naming import (
    DEFAULT_RULES,
    CommandRule,
    ContainerRef,
    EngineApiResolver,
    NamingError,
    client_name,
    container_from_cgroup,
    default_sockets,
    load_rules,
    name_from_inspect,
    read_rules_file,
)
from cardshare.naming import (
    _inspect_over_socket as inspect_over_socket,
)

CID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("docker-systemd-v2.txt", ContainerRef("docker", CID)),
        ("docker-cgroupfs-v1.txt", ContainerRef("docker", CID)),
        ("docker-cgroupfs-v2.txt", ContainerRef("docker", CID)),
        ("podman-rootful.txt", ContainerRef("podman", CID)),
        ("podman-rootless.txt", ContainerRef("podman", CID, uid=1000)),
        ("docker-rootless.txt", ContainerRef("docker", CID, uid=1001)),
        ("podman-conmon.txt", None),
        ("host-service.txt", None),
        ("user-session.txt", None),
    ],
)
def test_container_from_cgroup_fixtures(
    rec_fixtures: Path, fixture: str, expected: ContainerRef | None
) -> None:
    text = (rec_fixtures / "cgroup" / fixture).read_text()
    assert container_from_cgroup(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("garbage\n", None),
        (f"0::/system.slice/docker-{CID[:-1]}.scope\n", None),  # 63 hex digits
        (f"0::/system.slice/docker-{CID.upper()}.scope\n", None),
        (f"0::/system.slice/docker-{CID}.scope/init\n", ContainerRef("docker", CID)),
        (f"0::/docker/{CID}x\n", None),
        # v2 line wins over a v1 line naming another container
        (
            f"5:memory:/docker/{'f' * 64}\n0::/system.slice/docker-{CID}.scope\n",
            ContainerRef("docker", CID),
        ),
    ],
)
def test_container_from_cgroup_edges(text: str, expected: ContainerRef | None) -> None:
    assert container_from_cgroup(text) == expected


def _resolver(names: dict[str, str | None]) -> EngineApiResolver:
    def fetch(socket_path: str, cid: str, timeout: float) -> object | None:
        name = names.get(cid)
        return None if name is None else {"Name": "/" + name}

    return EngineApiResolver({"docker": "/d.sock"}, fetch=fetch)


@pytest.mark.parametrize(
    ("container", "comm", "cmdline", "names", "expected"),
    [
        (ContainerRef("docker", CID), "python3", "python3 -m vllm", {CID: "vllm-1"}, "vllm-1"),
        (ContainerRef("docker", CID), "Plex Transcoder", "", {}, "plex"),
        (None, "Plex Transcoder", "/usr/lib/plexmediaserver/Plex Transcoder -i x", {}, "plex"),
        (None, "python3", "python3 main.py", {}, "python3"),
        (None, "", "", {}, "unknown"),
        (ContainerRef("docker", CID), "", "", {}, "docker:0123456789ab"),
        # an unresolved container is named by its id, never by its command (issue 9)
        (ContainerRef("docker", CID), "python3", "python3 -m vllm", {}, "docker:0123456789ab"),
    ],
)
def test_client_name_order(
    container: ContainerRef | None,
    comm: str,
    cmdline: str,
    names: dict[str, str | None],
    expected: str,
) -> None:
    assert client_name(container, comm, cmdline, DEFAULT_RULES, _resolver(names)) == expected


def test_client_name_without_resolver_uses_rules() -> None:
    rules = (CommandRule(re.compile(r"comfy"), "comfyui", "cmdline"),)
    ref = ContainerRef("docker", CID)
    assert client_name(ref, "python", "python /app/comfy/main.py", rules, None) == "comfyui"


@pytest.mark.parametrize(
    ("rule", "comm", "cmdline", "matches"),
    [
        (CommandRule(re.compile("x"), "n", "comm"), "x", "", True),
        (CommandRule(re.compile("x"), "n", "comm"), "", "x", False),
        (CommandRule(re.compile("x"), "n", "cmdline"), "x", "", False),
        (CommandRule(re.compile("x"), "n", "cmdline"), "", "x", True),
        (CommandRule(re.compile("x"), "n", "any"), "", "x", True),
        (CommandRule(re.compile("^x$"), "n", "any"), "xy", "yx", False),
    ],
)
def test_rule_fields(rule: CommandRule, comm: str, cmdline: str, matches: bool) -> None:
    assert rule.matches(comm, cmdline) is matches


def test_load_rules() -> None:
    rules = load_rules('[{"pattern": "^ffmpeg", "name": "transcode", "match": "comm"}]')
    assert rules == (CommandRule(re.compile("^ffmpeg"), "transcode", "comm"),)
    assert load_rules("[]") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "r.json: not JSON: Expecting property name enclosed in double quotes at line 1"),
        ("{}", "r.json: expected a list of rules, got dict"),
        ("[1]", "r.json: rule 0: expected an object, got int"),
        ('[{"name": "a"}]', "r.json: rule 0: 'pattern' must be a non-empty string"),
        ('[{"pattern": "a"}]', "r.json: rule 0: 'name' must be a non-empty string"),
        (
            '[{"pattern": "a", "name": "b", "match": "exe"}]',
            "r.json: rule 0: 'match' must be comm, cmdline or any, got 'exe'",
        ),
        (
            '[{"pattern": "a", "name": "b", "regex": 1}]',
            "r.json: rule 0: unknown keys regex",
        ),
        (
            '[{"pattern": "a", "name": "b"}, {"pattern": "(", "name": "c"}]',
            "r.json: rule 1: bad pattern '(': missing ), unterminated subpattern at position 0",
        ),
    ],
)
def test_load_rules_rejects(text: str, message: str) -> None:
    with pytest.raises(NamingError) as info:
        load_rules(text, "r.json")
    assert str(info.value) == message


def test_read_rules_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(NamingError) as info:
        read_rules_file(path)
    assert str(info.value) == f"cannot read rules file {path}: No such file or directory"


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            {
                "Name": "/llm-vllm-1",
                "Config": {
                    "Labels": {
                        "com.docker.compose.project": "llm",
                        "com.docker.compose.service": "vllm",
                    }
                },
            },
            "llm/vllm",
        ),
        ({"Name": "/plex", "Config": {"Labels": {"com.docker.compose.project": "x"}}}, "plex"),
        ({"Name": "/plex", "Config": {"Labels": None}}, "plex"),
        ({"Name": "/"}, None),
        ({}, None),
    ],
)
def test_name_from_inspect(doc: dict[str, object], expected: str | None) -> None:
    assert name_from_inspect(doc) == expected


def test_resolver_caches_and_tolerates_errors() -> None:
    calls: list[tuple[str, str]] = []

    def fetch(socket_path: str, cid: str, timeout: float) -> object | None:
        calls.append((socket_path, cid))
        if cid.startswith("e"):
            raise ConnectionRefusedError(111, "Connection refused")
        return {"Name": "/web"}

    resolver = EngineApiResolver(default_sockets("/d.sock", "/p.sock"), fetch=fetch)
    ok = ContainerRef("docker", CID)
    bad = ContainerRef("docker", "e" * 64)
    rootless = ContainerRef("podman", CID, uid=1000)
    assert [resolver(ok), resolver(ok), resolver(bad), resolver(bad)] == ["web", "web", None, None]
    assert resolver(rootless) == "web"
    assert calls == [
        ("/d.sock", CID),
        ("/d.sock", "e" * 64),
        ("/run/user/1000/podman/podman.sock", CID),
    ]
    assert resolver.errors == 1


def test_resolver_without_socket_for_engine() -> None:
    resolver = EngineApiResolver(default_sockets("/d.sock", None), fetch=lambda *a: {"Name": "/x"})
    assert resolver(ContainerRef("podman", CID)) is None
    assert resolver(ContainerRef("docker", CID)) == "x"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        # the client speaks a versioned API path, as the Docker CLI does
        if self.path == f"/v1.41/containers/{CID}/json":
            body = json.dumps(
                {
                    "Name": "/img-comfyui-1",
                    "Config": {
                        "Labels": {
                            "com.docker.compose.project": "img",
                            "com.docker.compose.service": "comfyui",
                        }
                    },
                }
            ).encode()
            self.send_response(200)
        else:
            body = b'{"message": "No such container"}'
            self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return

    def address_string(self) -> str:
        return "unix"


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def rec_engine_socket(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "engine.sock")
    server = _UnixServer(path, _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()


def test_engine_api_over_unix_socket(rec_engine_socket: str) -> None:
    resolver = EngineApiResolver({"docker": rec_engine_socket})
    assert resolver(ContainerRef("docker", CID)) == "img/comfyui"
    assert resolver(ContainerRef("docker", "a" * 64)) is None
    assert inspect_over_socket(rec_engine_socket, "b" * 64, 2.0) is None


def test_engine_api_missing_socket(tmp_path: Path) -> None:
    resolver = EngineApiResolver({"docker": str(tmp_path / "absent.sock")})
    assert resolver(ContainerRef("docker", CID)) is None
    assert resolver.errors == 1
