"""The retrieval role's proof that each model is served (``tasks/available.yml``, run by
verify), by ``ansible-playbook`` against an HTTP server that answers ``/v2/models/<name>/ready``
and ``/v1/config`` with the real server's bodies (``tests/fixtures/ovms``, see its README).

A model whose version 1 is ``END`` and version 2 ``AVAILABLE`` is served (by version 2: the
server serves the highest AVAILABLE version); a graph the server refused is named with its state.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "ovms"
MODELS = ("bge-m3", "bge-reranker-v2-m3")

PLAYBOOK = (
    """\
---
- name: Prove the models are served
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the role's proof, keeping its outcome or its failure
      block:
        - name: Run available.yml
          ansible.builtin.include_role:
            name: cardshare.gpuhost.retrieval
            tasks_from: available

        - name: Keep the outcome
          ansible.builtin.set_fact:
            case_outcome:
              served: "{{ __retrieval_states.servables | dict2items
                          | items2dict(key_name='key', value_name='value') }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{ ansible_failed_result.msg | default(ansible_failed_result) }}"

"""
    + WRITE_OUTCOMES
)


class Answers(http.server.BaseHTTPRequestHandler):
    """OVMS's answers: readiness per model (200, or 404 with the server's error), the
    ``/v1/config`` body of a fixture."""

    bodies: ClassVar[dict[int, tuple[str, set[str]]]] = {}

    def do_GET(self) -> None:
        fixture, ready = self.bodies[self.server.server_address[1]]
        for model in MODELS:
            if self.path == f"/v2/models/{model}/ready":
                if model in ready:
                    self._send(200, b"")
                else:
                    self._send(404, b'{"error": "Model with requested version is not loaded yet"}')
                return
        if self.path == "/v1/config":
            self._send(200, (FIXTURES / fixture).read_bytes())
            return
        self._send(400, b'{"error": "Invalid request URL"}')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


CASES = {
    "two_versions": ("v1-config.two-versions.json", set(MODELS)),
    "rerank_failed": ("v1-config.rerank-failed.json", {"bge-m3"}),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    servers = []
    hosts: dict[str, dict[str, Any]] = {}
    for case, answer in CASES.items():
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
        Answers.bodies[server.server_address[1]] = answer
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        hosts[case] = {"retrieval_port": server.server_address[1]}
    try:
        yield run_cases(tmp_path_factory.mktemp("retrieval-served"), PLAYBOOK, hosts)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_a_model_served_by_its_second_version_is_served(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["two_versions"]
    assert "failed" not in outcome, outcome
    assert outcome["served"]["bge-m3"]["served_version"] == 2
    assert outcome["served"]["bge-m3"]["text"] == (
        "bge-m3: serves version 2 (the highest AVAILABLE); version 1 END (OK)"
    )


def test_a_refused_graph_is_named_with_its_state(outcomes: dict[str, Any]) -> None:
    failed = outcomes["rerank_failed"].get("failed", "")
    assert "Not every model is ready: ['bge-reranker-v2-m3']" in failed
    assert (
        "bge-reranker-v2-m3: no version AVAILABLE; version 1 LOADING (FAILED_PRECONDITION)"
        in failed
    )
