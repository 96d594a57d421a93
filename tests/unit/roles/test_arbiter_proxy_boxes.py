"""The arbiter role's boxes for the patient proxy (``arbiter_proxy_boxes``,
``arbiter_proxy_fleet_group``): rendered into the proxy's ``boxes`` with each key file by its
directory, from a list or from an inventory group whose hosts published their boxes; the
preflight refuses, naming the variable, the value and the fix, a box listed twice, two boxes
with one address, a box without models, both sources at once, a missing group, and another box
whose vLLM or arbiter listens on loopback. Without boxes the proxy's config is as before.

One ``ansible-playbook`` run on localhost for the table: each case is an inventory host that
runs the role's preflight (nothing changes); the fleet's hosts are cases too, in groups.
"""

from __future__ import annotations

from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

from cardshare.arbiter.config import parse_config
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
              boxes: "{{ __arbiter_boxes }}"
              arbiter_config: "{{ __arbiter_config }}"
      rescue:
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: "{{ ansible_failed_result.msg }}"

"""
    + WRITE_OUTCOMES
)

A_KEY = "/etc/cardshare/vllm/key"
B = {
    "name": "b",
    "upstream_url": "http://box-b.lan:8000",
    "arbiter_url": "http://box-b.lan:8090",
    "models": ["qwen"],
    "api_key_file": "/etc/cardshare/box-keys/b",
}
C = {
    "name": "c",
    "upstream_url": "http://box-c.lan:8000/",
    "arbiter_url": "http://box-c.lan:8090",
    "models": ["qwen", "coder"],
    "weight": 2,
}
# a box of a fleet: its vLLM and its arbiter beyond loopback, its own key
BOX = {
    "vllm_plan": {
        "model": {"served_name": "qwen"},
        "listen_address": "0.0.0.0",
        "api_key_file": "/etc/cardshare/vllm/key",
    },
    "arbiter_listen_address": "0.0.0.0",
}

# (case id, variables, strings the failure must contain; [] when the case must pass)
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("single", {}, []),
    (
        "listed",
        {"arbiter_proxy_upstream_key_file": A_KEY, "arbiter_proxy_boxes": [B, C]},
        [],
    ),
    # the fleet: the proxy on fleet-a, fleet-b a box beyond it
    (
        "fleet-a",
        {
            **BOX,
            "arbiter_proxy_fleet_group": "fleet",
            "arbiter_box_weight": 3,
            "arbiter_proxy_listen_address": "0.0.0.0",
            "arbiter_proxy_keys_file": "/etc/cardshare/proxy-keys/keys",
        },
        [],
    ),
    ("fleet-b", {**BOX, "arbiter_box_address": "10.0.0.2"}, []),
    (
        "twice",
        {"arbiter_proxy_boxes": [B, C, {**B, "upstream_url": "http://other:8000"}]},
        ["arbiter_proxy_boxes lists the box 'b' twice (boxes 0 and 2)", "give each box once"],
    ),
    (
        "one-address",
        {"arbiter_proxy_boxes": [B, {**C, "upstream_url": "http://BOX-B.lan:8000/v1"}]},
        [
            "arbiter_proxy_boxes: the boxes 'b' and 'c' have one address",
            "upstream_url 'http://BOX-B.lan:8000/v1'",
            "give each box its own address",
        ],
    ),
    (
        "one-arbiter",
        {"arbiter_proxy_boxes": [B, {**C, "arbiter_url": "http://box-b.lan:8090"}]},
        ["the boxes 'b' and 'c' have one address, arbiter_url 'http://box-b.lan:8090'"],
    ),
    (
        "no-models",
        {"arbiter_proxy_boxes": [{**B, "models": []}]},
        ["arbiter_proxy_boxes[0] ('b') serves no model (models is [])"],
    ),
    (
        "malformed",
        {"arbiter_proxy_boxes": [{"name": "b", "upstream_url": "http://b:8000"}]},
        ["arbiter_proxy_boxes[0] is", "give each box as {name: box2"],
    ),
    (
        "relative-key",
        {"arbiter_proxy_boxes": [{**B, "api_key_file": "key"}]},
        ["arbiter_proxy_boxes[0].api_key_file is 'key'", "give the absolute path"],
    ),
    (
        "both",
        {"arbiter_proxy_boxes": [B], "arbiter_proxy_fleet_group": "other"},
        [
            "arbiter_proxy_boxes lists 1 boxes and arbiter_proxy_fleet_group is 'other'",
            "give the boxes one way",
        ],
    ),
    (
        "no-group",
        {"arbiter_proxy_fleet_group": "nowhere"},
        ["arbiter_proxy_fleet_group is 'nowhere', which is no group of the inventory"],
    ),
    # the proxy of the group "loopy", whose other host keeps its vLLM on loopback
    ("loopy-a", {**BOX, "arbiter_proxy_fleet_group": "loopy"}, ["the host 'loopy-b'"]),
    ("loopy-b", {"arbiter_listen_address": "0.0.0.0"}, []),
    # the proxy of the group "shut", whose other host keeps its arbiter on loopback
    (
        "shut-a",
        {**BOX, "arbiter_proxy_fleet_group": "shut"},
        ["arbiter_listen_address on 'shut-b'"],
    ),
    ("shut-b", {"vllm_plan": BOX["vllm_plan"]}, []),
    # the status page's link to the fleet view
    ("fleet-view", {"arbiter_fleet_view_url": "http://box-a.lan:8080/proxy/fleet"}, []),
    (
        "fleet-view-no-url",
        {"arbiter_fleet_view_url": "box-a.lan:8080/proxy/fleet"},
        [
            "arbiter_fleet_view_url 'box-a.lan:8080/proxy/fleet'",
            "the fleet view as the proxy's http:// URL",
        ],
    ),
]
GROUPS = {
    "fleet": ["fleet-a", "fleet-b"],
    "loopy": ["loopy-a", "loopy-b"],
    "shut": ["shut-a", "shut-b"],
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("arbiter-proxy-boxes")
    return run_cases(work, PLAYBOOK, {name: changes for name, changes, _ in CASES}, groups=GROUPS)


@pytest.mark.parametrize(("name", "changes", "expected"), CASES, ids=[c[0] for c in CASES])
def test_preflight(
    outcomes: dict[str, Any], name: str, changes: dict[str, Any], expected: list[str]
) -> None:
    outcome = outcomes[name]
    if not expected:
        assert "failed" not in outcome, outcome
        return
    message = " ".join(outcome.get("failed", "").split())
    assert [e for e in expected if e not in message] == [], message


def test_loopback_refusals_say_what_to_set(outcomes: dict[str, Any]) -> None:
    message = " ".join(outcomes["loopy-a"]["failed"].split())
    assert message == (
        "arbiter_proxy_fleet_group 'loopy': the host 'loopy-b' has its vLLM listening on "
        "'127.0.0.1' (vllm_listen_address on 'loopy-b'), which the proxy on 'loopy-a' cannot "
        "reach: set vllm_listen_address on 'loopy-b' to its address or 0.0.0.0 (vLLM then with "
        "vllm_api_key_file)"
    )


def test_a_single_box_has_no_boxes(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["single"]
    assert "boxes" not in outcome["config"]
    assert (outcome["config"]["upstream_url"], outcome["config"]["arbiter_url"]) == (
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8090",
    )
    assert outcome["volumes"] == ["./proxy.json:/etc/cardshare/proxy.json:ro"]
    assert build_config(outcome["config"]).boxes == ()


def test_listed_boxes_get_their_keys_by_directory(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["listed"]
    assert outcome["config"]["boxes"] == [
        {
            "name": "b",
            "upstream_url": "http://box-b.lan:8000",
            "arbiter_url": "http://box-b.lan:8090",
            "models": ["qwen"],
            "weight": 1,
            "api_key_file": "/run/secrets/cardshare-box-keys-0/b",
        },
        {
            "name": "c",
            "upstream_url": "http://box-c.lan:8000",
            "arbiter_url": "http://box-c.lan:8090",
            "models": ["qwen", "coder"],
            "weight": 2,
            "api_key_file": "",
        },
    ]
    assert outcome["volumes"] == [
        "./proxy.json:/etc/cardshare/proxy.json:ro",
        "/etc/cardshare/vllm:/run/secrets/cardshare-vllm-key:ro",
        "/etc/cardshare/box-keys:/run/secrets/cardshare-box-keys-0:ro",
    ]
    # with boxes, each names its URLs (the proxy refuses the single box's beside them); the
    # proxy accepts what the role renders, a box's "" key file as no key
    assert "upstream_url" not in outcome["config"] and "arbiter_url" not in outcome["config"]
    boxes = build_config(outcome["config"]).boxes
    assert [(b.name, b.api_key_file) for b in boxes] == [
        ("b", "/run/secrets/cardshare-box-keys-0/b"),
        ("c", ""),
    ]


def test_the_fleet_group_renders_each_host_as_its_box(outcomes: dict[str, Any]) -> None:
    outcome = outcomes["fleet-a"]
    assert outcome["config"]["boxes"] == [
        # the proxy's own box: its local URLs and its own key file
        {
            "name": "fleet-a",
            "upstream_url": "http://127.0.0.1:8000",
            "arbiter_url": "http://127.0.0.1:8090",
            "models": ["qwen"],
            "weight": 3,
            "api_key_file": "/run/secrets/cardshare-box-keys-0/key",
        },
        # the other box: by its address, its key copied to this host
        {
            "name": "fleet-b",
            "upstream_url": "http://10.0.0.2:8000",
            "arbiter_url": "http://10.0.0.2:8090",
            "models": ["qwen"],
            "weight": 1,
            "api_key_file": "/run/secrets/cardshare-box-keys-1/fleet-b",
        },
    ]
    assert [b["key_source"] for b in outcome["boxes"]] == [
        None,
        {"host": "fleet-b", "path": "/etc/cardshare/vllm/key"},
    ]
    assert outcome["volumes"][-2:] == [
        "/etc/cardshare/vllm:/run/secrets/cardshare-box-keys-0:ro",
        "/etc/cardshare/fleet-keys:/run/secrets/cardshare-box-keys-1:ro",
    ]
    assert [b.weight for b in build_config(outcome["config"]).boxes] == [3, 1]
    # a box that is no proxy of a fleet renders none
    assert "boxes" not in outcomes["fleet-b"]["config"]


def test_the_status_page_links_to_the_fleet_view(outcomes: dict[str, Any]) -> None:
    url = "http://box-a.lan:8080/proxy/fleet"
    assert outcomes["fleet-view"]["arbiter_config"]["fleet_view_url"] == url
    assert parse_config(outcomes["fleet-view"]["arbiter_config"]).fleet_view_url == url
    # no link, no key: a single box's config as before
    assert "fleet_view_url" not in outcomes["single"]["arbiter_config"]


def test_each_box_of_the_group_judges_its_own_requests_at_the_fleet_proxy(
    outcomes: dict[str, Any],
) -> None:
    # the proxy's host: its own proxy, its own entry
    own = outcomes["fleet-a"]["arbiter_config"]
    assert (own["proxy_url"], own["proxy_box"]) == ("http://127.0.0.1:8080", "fleet-a")
    # another box: the fleet's proxy by its host's address, its own entry
    other = outcomes["fleet-b"]["arbiter_config"]
    assert (other["proxy_url"], other["proxy_box"]) == ("http://fleet-a:8080", "fleet-b")
    assert parse_config(other).proxy_box == "fleet-b"
    # the group whose proxy listens on loopback only: the other box keeps its own proxy
    assert "proxy_box" not in outcomes["loopy-b"]["arbiter_config"]
    assert "proxy_box" not in outcomes["single"]["arbiter_config"]
