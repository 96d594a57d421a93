"""The vllm role's own key (``vllm_api_key_file``): created once when absent, handed to vLLM as
VLLM_API_KEY through an env file beside it (never on the command line), carried by the role's
probes; refused beyond loopback without it; a keyless role renders as before.

Each case runs the role's preflight and configure with ``ansible-playbook`` on localhost (the
files under a temporary directory), one run for the whole table.
"""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

PLAYBOOK = (
    """\
---
- name: Run the vllm role's preflight and configure, and write what it rendered
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the role's first phases and keep the outcome
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.vllm
            tasks_from: preflight
            public: true

        - name: Include the role's configure
          ansible.builtin.include_role:
            name: cardshare.gpuhost.vllm
            tasks_from: configure
            public: true

        - name: Keep what the role rendered
          ansible.builtin.set_fact:
            case_outcome:
              definition: "{{ __vllm_definition }}"
              ladder: "{{ __vllm_ladder_definition }}"
              headers: "{{ __vllm_probe_headers }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome: {failed: "{{ ansible_failed_result.msg }}"}

"""
    + WRITE_OUTCOMES
)

GIB = 1024**3
# the role's service keys without a key: what it rendered before vllm_api_key_file existed
KEYLESS_SERVICE = {
    "image", "network_mode", "devices", "group_add", "shm_size", "mem_limit", "environment",
    "volumes", "healthcheck", "restart", "command",
}  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-api-key")


@pytest.fixture(scope="module")
def outcomes(work: Path) -> dict[str, Any]:
    models = work / "models"
    (models / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    (models / "Qwen2.5-7B-Instruct" / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1e6})
    )
    given = work / "given" / "key"
    given.parent.mkdir()
    given.write_text("given-key_1.x\nanother line\n")
    spaced = work / "spaced" / "key"
    spaced.parent.mkdir()
    spaced.write_text("two words\n")
    common = {
        "docker_engine_render_gid": 105,
        "vllm_model_dir": str(models),
        "vllm_hf_cache_dir": str(work / "hf"),
        "xe_driver_cards": [{"bdf": "0000:03:00.0", "vram_bytes": 32 * GIB}],
    }
    cases: dict[str, dict[str, Any]] = {
        "keyless": common,
        "created": {**common, "vllm_api_key_file": str(work / "created" / "key"),
                    "vllm_listen_address": "0.0.0.0"},
        "given": {**common, "vllm_api_key_file": str(given)},
        "spaced": {**common, "vllm_api_key_file": str(spaced)},
        "beyond-loopback-keyless": {**common, "vllm_listen_address": "0.0.0.0"},
        "lan-keyless": {**common, "vllm_listen_address": "192.168.1.20"},
        "relative": {**common, "vllm_api_key_file": "key"},
        "in-the-environment": {**common, "vllm_environment": {"VLLM_API_KEY": "x"}},
        "on-the-command-line": {**common, "vllm_extra_args": ["--api-key", "x"]},
    }  # fmt: skip
    return run_cases(work, PLAYBOOK, cases)


def _failed(outcome: dict[str, Any]) -> str:
    return " ".join(outcome.get("failed", "").split())


def test_a_keyless_box_renders_as_before(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["keyless"]
    assert set(outcome["definition"]["services"]["vllm"]) == KEYLESS_SERVICE
    assert all("env_file" not in s for s in outcome["ladder"]["services"].values())
    assert outcome["headers"] == {}


def test_an_absent_key_is_created_once_and_reaches_vllm_through_an_env_file(
    outcomes: dict[str, Any], work: Path
) -> None:
    key_file = work / "created" / "key"
    key = key_file.read_text().strip()
    assert len(key) == 48 and key.isalnum()
    env_file = Path(str(key_file) + ".env")
    assert env_file.read_text() == f"VLLM_API_KEY={key}\n"
    for path in (key_file, env_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    outcome = outcomes["created"]
    services = {"vllm": outcome["definition"]["services"]["vllm"], **outcome["ladder"]["services"]}
    assert len(services) == 3  # the full plan and two smaller ones, each with the key
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    for name, service in services.items():
        assert service["env_file"] == [str(env_file)], name
        assert service["labels"] == {"cardshare.vllm-api-key-sha256": digest}, name
        assert "VLLM_API_KEY" not in service["environment"], name
        assert key not in json.dumps(service.get("command", [])), name
    assert outcome["headers"] == {"Authorization": f"Bearer {key}"}


def test_a_given_key_is_its_first_line_and_never_replaced(
    outcomes: dict[str, Any], work: Path
) -> None:
    assert outcomes["given"]["headers"] == {"Authorization": "Bearer given-key_1.x"}
    assert (work / "given" / "key").read_text() == "given-key_1.x\nanother line\n"
    assert (work / "given" / "key.env").read_text() == "VLLM_API_KEY=given-key_1.x\n"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "spaced",
            ["vllm_api_key_file '", "spaced/key' does not hold a key on its first line",
             "or remove the file"],
        ),
        (
            "beyond-loopback-keyless",
            ["vllm_listen_address is '0.0.0.0', vllm_api_key_file ''",
             "must take a key", "set vllm_api_key_file to an absolute file path",
             "or listen on 127.0.0.1"],
        ),
        ("lan-keyless", ["vllm_listen_address is '192.168.1.20'", "must take a key"]),
        ("relative", ["vllm_api_key_file 'key'", "absolute path of a file"]),
        ("in-the-environment", ["vllm_environment sets VLLM_API_KEY", "not vllm_environment"]),
        ("on-the-command-line", ["--api-key", "set vllm_api_key_file instead"]),
    ],
)  # fmt: skip
def test_refusals(outcomes: dict[str, Any], name: str, expected: list[str]) -> None:
    message = _failed(outcomes[name])
    assert [e for e in expected if e not in message] == [], message
