"""Bad inventory values for the re-encode campaign, refused before anything changes.

Each case runs the transcode_campaign role's preflight (or the arbiter's, for the yielding
tenants the campaign publishes) with ``ansible-playbook`` on localhost, one run for the whole
table, against a media root made in the test's directory. Preflight reads and asserts only; each
refusal must name the variable, its value and the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
from role_playbook import WRITE_OUTCOMES, run_cases

PLAYBOOK = (
    """\
---
- name: Run a role's preflight and write what it decided
  hosts: all
  gather_facts: false
  tasks:
    - name: Run the preflight and keep the outcome
      block:
        - name: Include the role's preflight
          ansible.builtin.include_role:
            name: "cardshare.gpuhost.{{ case_role }}"
            tasks_from: preflight

        - name: Keep the success
          ansible.builtin.set_fact:
            case_outcome: {passed: true}
      rescue:
        # a looped assert fails with "One or more items failed": its items' messages are
        # what the user reads
        - name: Keep the failure
          ansible.builtin.set_fact:
            case_outcome:
              failed: >-
                {{ ansible_failed_result.results | selectattr('failed', 'defined')
                   | selectattr('failed') | map(attribute='msg') | join(' ')
                   if ansible_failed_result.results is defined else ansible_failed_result.msg }}

"""
    + WRITE_OUTCOMES
)

# (case id, variables over a good campaign ("{media}" is the media root made by the test),
#  strings the failure must contain; [] when the case must pass)
CAMPAIGN_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("good", {}, []),
    ("good-in-the-check-play-before-docker", {"__cardshare_check_play": True}, []),
    (
        "no-media-root",
        {"transcode_campaign_media_root": ""},
        ["transcode_campaign_media_root is ''", "set an absolute media root"],
    ),
    (
        "media-root-with-a-trailing-slash",
        {"transcode_campaign_media_root": "{media}/"},
        ["transcode_campaign_media_root is '{media}/'", "without a trailing /"],
    ),
    (
        "a-library-outside-the-media-root",
        {"transcode_campaign_libraries": ["/srv/elsewhere/Films"]},
        [
            "transcode_campaign_libraries has '/srv/elsewhere/Films'",
            "under transcode_campaign_media_root",
        ],
    ),
    (
        "the-holding-folder-inside-a-library",
        {"transcode_campaign_hold_dir": "{media}/Films/.held"},
        [
            "must not contain transcode_campaign_hold_dir '{media}/Films/.held'",
            "pick up the originals",
        ],
    ),
    (
        "the-holding-folder-outside-the-media-root",
        {"transcode_campaign_hold_dir": "/var/tmp/held"},
        [
            "transcode_campaign_hold_dir is '/var/tmp/held'",
            "put it under transcode_campaign_media_root",
        ],
    ),
    (
        "an-encoder-that-is-not-vaapi",
        {"transcode_campaign_encoders": ["h264_vaapi"]},
        ["transcode_campaign_encoders is ['h264_vaapi']", "av1_vaapi and hevc_vaapi"],
    ),
    (
        "an-unknown-software-encoder",
        {"transcode_campaign_software_encoder": "libx264"},
        ["transcode_campaign_software_encoder 'libx264'", "libx265 or libsvtav1"],
    ),
    (
        "no-encoder-at-all",
        {"transcode_campaign_encoders": []},
        ["transcode_campaign_encoders is []", "list VAAPI encoders"],
    ),
    (
        "quality-out-of-range",
        {"transcode_campaign_quality": 70},
        ["transcode_campaign_quality is 70 (0 to 63)", "bring the one out of range back"],
    ),
    (
        "a-saving-of-everything",
        {"transcode_campaign_min_saving": 1},
        ["min_saving 1 (0 to 0.95)"],
    ),
    (
        "hours-not-a-window",
        {"transcode_campaign_hours": ["7-9"]},
        ["transcode_campaign_hours is ['7-9']", '"HH:MM-HH:MM"'],
    ),
    (
        "plex-url-without-its-token",
        {"transcode_campaign_plex_url": "http://127.0.0.1:32400"},
        [
            "transcode_campaign_plex_url is 'http://127.0.0.1:32400'",
            "together with transcode_campaign_plex_token",
        ],
    ),
    (
        "a-library-that-does-not-exist",
        {"transcode_campaign_libraries": ["{media}/Films", "{media}/Series"]},
        ["Not a directory on the host: ['{media}/Series']", "Create the libraries"],
    ),
    (
        "no-render-group-outside-the-check-play",
        {"docker_engine_render_gid": None},
        ["docker_engine_render_gid is", "run the cardshare.gpuhost.docker_engine role"],
    ),
]

# (case id, arbiter_yielding_tenants, strings the failure must contain; [] to pass)
TENANT_CASES: list[tuple[str, Any, list[str]]] = [
    ("none", [], []),
    (
        "the-campaigns",
        [{"name": "campaign/encoder", "url": "http://127.0.0.1:8097", "ack_seconds": 8.0}],
        [],
    ),
    ("without-a-bound", [{"name": "campaign/encoder", "url": "http://127.0.0.1:8097"}], []),
    (
        "not-a-list",
        "campaign/encoder",
        ["arbiter_yielding_tenants is campaign/encoder", "a list of mappings"],
    ),
    ("a-name-only", ["campaign/encoder"], ["arbiter_yielding_tenants is ['campaign/encoder']"]),
    (
        "a-key-the-arbiter-does-not-know",
        [{"name": "campaign/encoder", "url": "http://127.0.0.1:8097", "port": 8097}],
        ["'port': 8097", "optionally ack_seconds"],
    ),
    (
        "a-name-that-is-not-project-service",
        [{"name": "campaign", "url": "http://127.0.0.1:8097"}],
        ["'name': 'campaign'", "project/service, such as campaign/encoder"],
    ),
    (
        "a-url-with-a-path",
        [{"name": "campaign/encoder", "url": "127.0.0.1:8097/v1"}],
        ["'url': '127.0.0.1:8097/v1'", "its base URL"],
    ),
    (
        "a-bound-given-as-text",
        [{"name": "campaign/encoder", "url": "http://127.0.0.1:8097", "ack_seconds": "10"}],
        ["'ack_seconds': '10'", "a number above 0, at most 300"],
    ),
    (
        "a-bound-out-of-range",
        [{"name": "campaign/encoder", "url": "http://127.0.0.1:8097", "ack_seconds": 600}],
        ["'ack_seconds': 600", "a number above 0, at most 300"],
    ),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("campaign-preflight")
    media = work / "media"
    (media / "Films").mkdir(parents=True)
    good = {
        "case_role": "transcode_campaign",
        "transcode_campaign_media_root": str(media),
        "transcode_campaign_libraries": [str(media / "Films")],
        "transcode_campaign_hold_dir": str(media / ".cardshare-held"),
        "docker_engine_render_gid": 105,
    }

    def filled(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{media}", str(media))
        if isinstance(value, list):
            return [filled(v) for v in value]
        return value

    cases: dict[str, dict[str, Any]] = {}
    for name, changes, _ in CAMPAIGN_CASES:
        case = good | {k: filled(v) for k, v in changes.items()}
        cases["campaign-" + name] = {k: v for k, v in case.items() if v is not None}
    for name, tenants, _ in TENANT_CASES:
        cases["tenants-" + name] = {"case_role": "arbiter", "arbiter_yielding_tenants": tenants}
    found = run_cases(work, PLAYBOOK, cases)
    return {"media": str(media), **found}


@pytest.mark.parametrize(
    ("name", "changes", "expected"), CAMPAIGN_CASES, ids=[c[0] for c in CAMPAIGN_CASES]
)
def test_the_campaigns_values(
    outcomes: dict[str, Any], name: str, changes: dict[str, Any], expected: list[str]
) -> None:
    outcome = outcomes["campaign-" + name]
    if not expected:
        assert outcome == {"passed": True}
        return
    message = " ".join(outcome.get("failed", "").split())  # folded over lines in the role
    missing = [e.replace("{media}", outcomes["media"]) for e in expected]
    assert [e for e in missing if e not in message] == [], message


@pytest.mark.parametrize(
    ("name", "tenants", "expected"), TENANT_CASES, ids=[c[0] for c in TENANT_CASES]
)
def test_the_arbiters_yielding_tenants(
    outcomes: dict[str, Any], name: str, tenants: Any, expected: list[str]
) -> None:
    outcome = outcomes["tenants-" + name]
    if not expected:
        assert outcome == {"passed": True}, outcome
        return
    message = " ".join(outcome.get("failed", "").split())
    assert [e for e in expected if e not in message] == [], message
