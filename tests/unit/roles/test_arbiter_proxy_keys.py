"""The arbiter role's API keys for the patient proxy: the preflight refuses a proxy reachable
beyond the host without a key file (naming the variable, the value and the fix), and the role
renders the key file and vLLM's key file into the proxy's config and volumes.

One ``ansible-playbook`` run on localhost for the table: each case runs the role's preflight
(nothing changes) and keeps what it rendered, or the message it failed with.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

from cardshare.proxy.config import build_config

PLAYBOOK = (
    """\
---
- name: Run the arbiter's preflight and keep what the role renders for the proxy
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the preflight and keep the outcome
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: cardshare.gpuhost.arbiter
            tasks_from: preflight
            public: true

        - name: Keep what the proxy gets
          ansible.builtin.set_fact:
            case_outcome:
              config: "{{ __arbiter_proxy_config }}"
              volumes: "{{ __arbiter_proxy_volumes }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{ ansible_failed_result.msg }}"

"""
    + WRITE_OUTCOMES
)

KEYS = "/etc/cardshare/proxy-keys/keys"
VLLM_KEY = "/etc/cardshare/vllm-key/key"

# (case id, variables, strings the failure must contain; [] when the case must pass)
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("loopback-without-keys", {}, []),
    ("loopback-127-0-0-2-without-keys", {"arbiter_proxy_listen_address": "127.0.0.2"}, []),
    ("localhost-without-keys", {"arbiter_proxy_listen_address": "localhost"}, []),
    (
        "all-addresses-without-keys",
        {"arbiter_proxy_listen_address": "0.0.0.0"},
        [
            "arbiter_proxy_listen_address is '0.0.0.0', arbiter_proxy_keys_file ''",
            "must take API keys",
            "set arbiter_proxy_keys_file to an absolute file path",
            "cardshare proxy key add NAME --file PATH",
            "or listen on 127.0.0.1",
        ],
    ),
    (
        "lan-address-without-keys",
        {"arbiter_proxy_listen_address": "192.168.1.20"},
        ["arbiter_proxy_listen_address is '192.168.1.20'", "must take API keys"],
    ),
    (
        "ipv6-any-without-keys",
        {"arbiter_proxy_listen_address": "::"},
        ["arbiter_proxy_listen_address is '::'", "must take API keys"],
    ),
    (
        "relative-key-file",
        {"arbiter_proxy_listen_address": "0.0.0.0", "arbiter_proxy_keys_file": "keys"},
        ["arbiter_proxy_keys_file 'keys'", "absolute paths of files"],
    ),
    (
        "key-file-is-a-directory-path",
        {"arbiter_proxy_listen_address": "0.0.0.0", "arbiter_proxy_keys_file": "/etc/keys/"},
        ["arbiter_proxy_keys_file '/etc/keys/'", "absolute paths of files"],
    ),
    (
        "relative-vllm-key-file",
        {"arbiter_proxy_upstream_key_file": "vllm.key"},
        ["arbiter_proxy_upstream_key_file 'vllm.key'", "absolute paths of files"],
    ),
    (
        "no-request-per-key",
        {"arbiter_proxy_key_max_requests": 0},
        ["arbiter_proxy_key_max_requests 0", "at least 1 request"],
    ),
    (
        "managed-key-in-the-extra-config",
        {"arbiter_proxy_extra_config": {"keys_file": ""}},
        ["arbiter_proxy_extra_config sets ['keys_file']"],
    ),
    (
        "all-addresses-with-keys",
        {
            "arbiter_proxy_listen_address": "0.0.0.0",
            "arbiter_proxy_keys_file": KEYS,
            "arbiter_proxy_key_max_requests": 4,
            "arbiter_proxy_upstream_key_file": VLLM_KEY,
        },
        [],
    ),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("arbiter-proxy-keys")
    return run_cases(work, PLAYBOOK, {name: changes for name, changes, _ in CASES})


@pytest.mark.parametrize(("name", "changes", "expected"), CASES, ids=[c[0] for c in CASES])
def test_preflight(
    outcomes: dict[str, Any], name: str, changes: dict[str, Any], expected: list[str]
) -> None:
    outcome = outcomes[name]
    if not expected:
        assert "failed" not in outcome, outcome
        return
    message = " ".join(outcome.get("failed", "").split())  # folded over lines in the role
    assert [e for e in expected if e not in message] == [], message


def test_the_proxy_gets_the_key_files_by_their_directories(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["all-addresses-with-keys"]
    config = outcome["config"]
    assert (
        config["keys_file"],
        config["key_max_requests"],
        config["upstream_api_key_file"],
    ) == ("/run/secrets/cardshare-proxy-keys/keys", 4, "/run/secrets/cardshare-vllm-key/key")
    # a directory, not the file: a file replaced by a rename shows inside the container
    assert outcome["volumes"] == [
        "./proxy.json:/etc/cardshare/proxy.json:ro",
        "/etc/cardshare/proxy-keys:/run/secrets/cardshare-proxy-keys:ro",
        "/etc/cardshare/vllm-key:/run/secrets/cardshare-vllm-key:ro",
    ]
    # the package accepts what the role renders
    assert build_config(json.loads(json.dumps(config))).keys_file == config["keys_file"]


def test_without_keys_the_proxy_config_is_as_before(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["loopback-without-keys"]
    assert (outcome["config"]["keys_file"], outcome["config"]["upstream_api_key_file"]) == ("", "")
    assert outcome["volumes"] == ["./proxy.json:/etc/cardshare/proxy.json:ro"]
    build_config(outcome["config"])
