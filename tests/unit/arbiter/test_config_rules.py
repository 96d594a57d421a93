"""Config validation, the pure swap/handback rules, metrics and card-data parsing."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import make_config
from hypothesis import given, settings
from hypothesis import strategies as st

from cardshare.arbiter.cardview import CardClient, CardDataError, CardView, parse_card_view
from cardshare.arbiter.config import ConfigError, ContainerRef, load_config, parse_config
from cardshare.arbiter.rules import (
    HandbackObservations,
    LlmActivity,
    MetricsError,
    ProxyState,
    SwapObservations,
    VllmMetrics,
    llm_retry_delay,
    parse_vllm_metrics,
    should_hand_back,
    should_swap_to_image,
    update_activity,
)
from cardshare.arbiter.states import TRANSITIONS, Outcome, Phase, TransitionError, next_phase

BASE: dict[str, Any] = {
    "data_dir": "/var/lib/cardshare/arbiter",
    "vllm_url": "http://127.0.0.1:8000/",
    "served_model_name": "qwen",
    "comfyui_url": "http://127.0.0.1:8188",
    "card_current_json": "/var/lib/cardshare/current.json",
    "token_file": "/etc/cardshare/arbiter.token",
}


def test_config_defaults() -> None:
    config = parse_config(BASE)
    assert config.vllm_url == "http://127.0.0.1:8000"
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 8090)
    assert (config.idle_seconds, config.max_image_seconds, config.job_max_attempts) == (60, 900, 3)
    assert config.llm_container == ContainerRef("vllm", "vllm")
    assert config.llm_names == ("vllm/vllm",)
    assert config.max_payload_bytes == 32 * 2**20
    assert config.handback_on_waiting_agent is True
    assert config.recorder_current_json is None
    read = parse_config({**BASE, "recorder_current_json": "/srv/cardshare-recorder/current.json"})
    assert read.recorder_current_json == Path("/srv/cardshare-recorder/current.json")
    assert config.card_pdev is None
    assert parse_config({**BASE, "card_pdev": "0000:03:00.0"}).card_pdev == "0000:03:00.0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"idle_seconds": 0},
            "config key 'idle_seconds' has value 0: set it to a finite number greater than 0",
        ),
        (
            {"idle_seconds": True},
            "config key 'idle_seconds' has value True: set it to a finite number greater than 0",
        ),
        (
            {"idle_seconds": float("nan")},
            "config key 'idle_seconds' has value nan: set it to a finite number greater than 0",
        ),
        (
            {"job_timeout_seconds": float("inf")},
            "config key 'job_timeout_seconds' has value inf: "
            "set it to a finite number greater than 0",
        ),
        (
            {"listen_port": 70000},
            "config key 'listen_port' has value 70000: set it to a TCP port between 1 and 65535",
        ),
        (
            {"vllm_url": "127.0.0.1:8000"},
            "config key 'vllm_url' has value '127.0.0.1:8000': "
            "set it to an http:// or https:// base URL",
        ),
        (
            {"llm_container": {"project": "vllm"}},
            "config key 'llm_container' has value {'project': 'vllm'}: "
            'set it to {"project": "<compose project>", "service": "<service>"}',
        ),
        (
            {"card_scan_argv": "cardshare scan"},
            "config key 'card_scan_argv' has value 'cardshare scan': "
            "set it to a list of non-empty strings",
        ),
        (
            {"job_max_attempts": 1.5},
            "config key 'job_max_attempts' has value 1.5: set it to a whole number greater than 0",
        ),
        (
            {"handback_on_waiting_agent": "yes"},
            "config key 'handback_on_waiting_agent' has value 'yes': use true or false",
        ),
        (
            {"recorder_current_json": "recorder/current.json"},
            "config key 'recorder_current_json' has value 'recorder/current.json': "
            "set it to the recorder's current.json (absolute), or leave it out",
        ),
        (
            {"card_pdev": "0000:03:00.0:render"},
            "config key 'card_pdev' has value '0000:03:00.0:render': set it to the card's PCI "
            "address as sysfs prints it (such as '0000:03:00.0'), or leave it out on a host "
            "with one GPU",
        ),
        (
            {"card_pdev": "0000:0A:00.0"},
            "config key 'card_pdev' has value '0000:0A:00.0': set it to the card's PCI "
            "address as sysfs prints it (such as '0000:03:00.0'), or leave it out on a host "
            "with one GPU",
        ),
        (
            {"proxy_box": "box-a"},
            "config key 'proxy_box' has value 'box-a': set it to this box's name in the "
            "proxy's boxes (with proxy_url the fleet proxy's URL), or \"\" for a proxy of one box",
        ),
        (
            {"proxy_url": "http://127.0.0.1:8080", "proxy_box": 7},
            "config key 'proxy_box' has value 7: set it to this box's name in the proxy's "
            'boxes (with proxy_url the fleet proxy\'s URL), or "" for a proxy of one box',
        ),
        (
            {"idle_secs": 60},
            "config key 'idle_secs' has value 60: remove it (unknown key; check its spelling)",
        ),
        (
            {"llm_retry_backoff_seconds": 20, "llm_retry_backoff_max_seconds": 10},
            "config key 'llm_retry_backoff_max_seconds' has value 10: "
            "set it at least as large as llm_retry_backoff_seconds",
        ),
    ],
)
def test_config_errors_name_key_value_fix(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **change})
    assert str(info.value) == message


def test_config_missing_key_and_bad_file(tmp_path: Path) -> None:
    raw = dict(BASE)
    del raw["served_model_name"]
    with pytest.raises(ConfigError, match=r"^config key 'served_model_name' is missing: set it$"):
        parse_config(raw)
    bad = tmp_path / "c.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=r"^config file .*c\.json is not valid JSON: "):
        load_config(bad)
    good = tmp_path / "g.json"
    good.write_text(json.dumps(BASE))
    assert load_config(good).served_model_name == "qwen"


def test_transitions_table_is_closed() -> None:
    for (_, _), target in TRANSITIONS.items():
        assert isinstance(target, Phase)
    assert next_phase(Phase.WAIT_LLM_READY, Outcome.TIMEOUT) is Phase.START_LLM
    with pytest.raises(
        TransitionError, match=r"^no transition from phase serve_llm on outcome ok$"
    ):
        next_phase(Phase.SERVE_LLM, Outcome.OK)


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 0.0
vllm:num_requests_waiting{engine="0",model_name="qwen"} 2.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="qwen"} 10.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="qwen"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="qwen"} 1.0
"""


def test_parse_vllm_metrics() -> None:
    assert parse_vllm_metrics(METRICS) == VllmMetrics(running=0.0, waiting=2.0, success_total=14.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # as vLLM's prometheus_client writes it: counters with _total and _created samples
        (
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 4.0\n'
            'vllm:request_success_created{finished_reason="stop",model_name="m"} 1.7e9\n'
            'vllm:num_requests_running{model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m"} 0.0\n',
            VllmMetrics(running=1.0, waiting=0.0, success_total=4.0),
        ),
        # two engines: summed; no success counter yet: 0; a NaN sample is left out
        (
            'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
            'vllm:num_requests_waiting{engine="0"} NaN\nvllm:num_requests_waiting{engine="1"} 3\n',
            VllmMetrics(running=3.0, waiting=3.0, success_total=0.0),
        ),
        # comments other than HELP and TYPE (the lab's stand-in writes one), a timestamp
        (
            "# SIMULATION: a stand-in\nvllm:num_requests_running 0 1700000000000\n"
            "vllm:num_requests_waiting 0\n",
            VllmMetrics(running=0.0, waiting=0.0, success_total=0.0),
        ),
    ],
)
def test_parse_vllm_metrics_readings(text: str, expected: VllmMetrics) -> None:
    assert parse_vllm_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm:num_requests_running 0\n", "vLLM /metrics lacks vllm:num_requests_waiting"),
        ("", "vLLM /metrics lacks vllm:num_requests_running, vllm:num_requests_waiting"),
        (
            "vllm:num_requests_waiting 0\n# EOF\n",
            "vLLM /metrics lacks vllm:num_requests_running",
        ),
        # an answer that is not an exposition: JSON, an error page, a body cut off mid-line
        (
            '{"truncated": [1, 2',
            'vLLM /metrics is not a Prometheus exposition (Invalid labels: "truncated": [1, )',
        ),
        (
            "<html><body>502 Bad Gateway</body></html>\n",
            "vLLM /metrics is not a Prometheus exposition "
            "(invalid metric name:<html><body>502 Bad Gateway</body></html>)",
        ),
        (
            METRICS + 'vllm:num_requests_waiting{engine="0",model_na',
            "vLLM /metrics is not a Prometheus exposition",
        ),
        (
            "vllm:num_requests_running zero\nvllm:num_requests_waiting 0\n",
            "vLLM /metrics is not a Prometheus exposition",
        ),
    ],
)
def test_parse_vllm_metrics_errors(text: str, message: str) -> None:
    with pytest.raises(MetricsError) as caught:
        parse_vllm_metrics(text)
    assert str(caught.value).startswith(message)


@settings(max_examples=300, deadline=None)
@given(st.text() | st.integers(0, len(METRICS)).map(lambda n: METRICS[:n]))
def test_parse_vllm_metrics_never_crashes(text: str) -> None:
    """Any answer, a cut-off one included, is a reading or a MetricsError (which the engine
    handles by holding the swap), never another exception."""
    with contextlib.suppress(MetricsError):
        parse_vllm_metrics(text)


@pytest.mark.parametrize(
    ("prev_total", "metrics", "active"),
    [
        (None, VllmMetrics(0, 0, 5), False),  # first poll: the counter has no past
        (5.0, VllmMetrics(0, 0, 5), False),
        (5.0, VllmMetrics(0, 0, 6), True),
        (5.0, VllmMetrics(1, 0, 5), True),
        (5.0, VllmMetrics(0, 1, 5), True),
        (5.0, VllmMetrics(0, 0, 0), True),  # restarted vLLM
    ],
)
def test_update_activity(prev_total: float | None, metrics: VllmMetrics, active: bool) -> None:
    new = update_activity(LlmActivity(100.0, prev_total), metrics, 200.0)
    assert new.last_active_at == (200.0 if active else 100.0)
    assert new.last_success_total == metrics.success_total


NOW = 10_000.0
IDLE = LlmActivity(NOW - 120, 3.0)
FRESH_CARD = CardView(NOW - 5, (CardClient("vllm/vllm", 27 * 2**30, ("ccs",)),))
QUIET_PROXY = ProxyState(0, 0)


def obs(**kw: Any) -> SwapObservations:
    base: dict[str, Any] = {
        "queue_length": 1,
        "activity": IDLE,
        "proxy": QUIET_PROXY,
        "card": FRESH_CARD,
    }
    base.update(kw)
    return SwapObservations(**base)


@pytest.mark.parametrize(
    ("observations", "go", "reasons"),
    [
        (obs(), True, ("1 job(s) queued", "vLLM idle for 120 s", "no other client on the card")),
        (obs(queue_length=0), False, ("the job queue is empty",)),
        (
            obs(activity=LlmActivity(NOW - 30)),
            False,
            ("vLLM was active 30 s ago (needs 60 s idle)",),
        ),
        (
            obs(activity=None, metrics_error="connection refused"),
            False,
            ("vLLM metrics unavailable (connection refused)",),
        ),
        (obs(proxy=ProxyState(1, 0)), False, ("the proxy has 1 request(s) in flight and 0 held",)),
        (
            obs(proxy=ProxyState(0, 0, None, NOW - 10, NOW - 9)),
            False,
            ("vLLM was active 9 s ago (needs 60 s idle)",),
        ),
        (obs(proxy=None, proxy_error="refused"), False, ("proxy state unavailable (refused)",)),
        (
            obs(card=CardView(NOW - 500, FRESH_CARD.clients)),
            False,
            ("card data is 500 s old (max 120 s) even after a fresh scan",),
        ),
        (obs(card=None, card_error="cannot read"), False, ("card data unavailable (cannot read)",)),
        (
            obs(card=CardView(NOW, (*FRESH_CARD.clients, CardClient("plex", 0, ("vcs", "vecs"))))),
            False,
            ("another client is on the card: plex keeps vcs, vecs busy",),
        ),
        (
            obs(card=CardView(NOW, (CardClient("plex", 0, ()),))),
            True,
            ("1 job(s) queued", "vLLM idle for 120 s", "no other client on the card"),
        ),
    ],
)
def test_should_swap_to_image(
    observations: SwapObservations, go: bool, reasons: tuple[str, ...]
) -> None:
    config = make_config(Path("/nonexistent"), card_data_max_age_seconds=120.0)
    decision = should_swap_to_image(observations, config, NOW)
    assert (decision.go, decision.reasons) == (go, reasons)


def test_a_resident_tenant_never_holds_a_swap_and_a_foreign_one_still_does() -> None:
    """The retrieval tier stays on the card through every swap (its memory is one of the
    card's reservations): with it holding VRAM and busy, the swap goes; with the same client
    not named resident, it is foreign and holds the swap."""
    retrieval = CardClient("retrieval/ovms", 2 * 1024**3, ("ccs",))
    card = CardView(NOW, (*FRESH_CARD.clients, retrieval))
    resident = make_config(
        Path("/nonexistent"),
        card_data_max_age_seconds=120.0,
        resident_client_names=("retrieval/ovms",),
    )
    decision = should_swap_to_image(obs(card=card), resident, NOW)
    assert decision.go, decision.reasons
    foreign = make_config(Path("/nonexistent"), card_data_max_age_seconds=120.0)
    decision = should_swap_to_image(obs(card=card), foreign, NOW)
    assert not decision.go
    assert decision.reasons[0].startswith("another client is on the card: retrieval/ovms")


def test_resident_client_names_are_read_and_checked() -> None:
    base = {
        "data_dir": "/d",
        "card_current_json": "/c.json",
        "token_file": "/t",
        "vllm_url": "http://127.0.0.1:8000",
        "comfyui_url": "http://127.0.0.1:8188",
        "served_model_name": "m",
    }
    assert parse_config(base).resident_client_names == ()
    config = parse_config({**base, "resident_client_names": ["retrieval/ovms"]})
    assert config.resident_client_names == ("retrieval/ovms",)
    with pytest.raises(ConfigError, match="resident_client_names"):
        parse_config({**base, "resident_client_names": "retrieval/ovms"})


@pytest.mark.parametrize(
    ("queue", "since", "running", "proxy", "policy", "go", "reasons"),
    [
        (0, NOW - 10, False, None, True, True, ("the job queue is empty",)),
        (2, NOW - 10, False, None, True, False, ("2 job(s) queued",)),
        (
            2,
            NOW - 900,
            False,
            None,
            True,
            True,
            ("image mode has lasted 900 s (max_image_seconds 900)",),
        ),
        (
            2,
            NOW - 10,
            False,
            ProxyState(0, 3),
            True,
            True,
            ("3 agent request(s) held at the proxy",),
        ),
        (2, NOW - 10, False, ProxyState(0, 3), False, False, ("2 job(s) queued",)),
        (
            2,
            NOW - 901,
            True,
            None,
            True,
            False,
            (
                "a job is running: never cut it",
                "image mode has lasted 901 s (max_image_seconds 900)",
            ),
        ),
    ],
)
def test_should_hand_back(
    queue: int,
    since: float,
    running: bool,
    proxy: ProxyState | None,
    policy: bool,
    go: bool,
    reasons: tuple[str, ...],
) -> None:
    config = make_config(Path("/nonexistent"), handback_on_waiting_agent=policy)
    decision = should_hand_back(HandbackObservations(queue, since, running, proxy), config, NOW)
    assert (decision.go, decision.reasons) == (go, reasons)


@pytest.mark.parametrize(
    ("failures", "delay"), [(0, 0.0), (1, 10.0), (2, 20.0), (3, 40.0), (9, 300.0)]
)
def test_llm_retry_delay(failures: int, delay: float) -> None:
    assert llm_retry_delay(failures, 10.0, 300.0) == delay


# The recorder's snapshot layout (cardshare.recorder's build_snapshot), trimmed to the keys read.
RECORDER_SNAPSHOT: dict[str, Any] = {
    "schema": 1,
    "timestamp": "2026-05-09T07:35:25Z",
    "timestamp_unix": 1778312125.0,
    "cards": {
        "0000:03:00.0": {
            "driver": "xe",
            "clients": [
                {
                    "name": "plex",
                    "vram_bytes": 2147483648,
                    "engines": {"vcs": 0.4, "vecs": 0.1, "rcs": 0.0},
                },
                {"name": "vllm/vllm", "vram_bytes": 29 * 2**30, "engines": {"ccs": None}},
            ],
        }
    },
}


@pytest.mark.parametrize(
    ("doc", "view"),
    [
        (
            RECORDER_SNAPSHOT,
            CardView(
                1778312125.0,
                (
                    CardClient("plex", 2 * 2**30, ("vcs", "vecs")),
                    CardClient("vllm/vllm", 29 * 2**30, ()),
                ),
            ),
        ),
        ({"timestamp": "2026-05-09T07:35:25Z", "clients": []}, CardView(1778311925.0 + 200, ())),
        (
            {"scanned_at": 5, "clients": [{"name": "x", "engines": ["ccs"]}]},
            CardView(5.0, (CardClient("x", 0, ("ccs",)),)),
        ),
    ],
)
def test_parse_card_view(doc: dict[str, Any], view: CardView) -> None:
    assert parse_card_view(doc) == view


# A host with an iGPU beside the Arc card: the recorder sees both (cards keyed by drm-pdev).
TWO_CARDS: dict[str, Any] = {
    "timestamp_unix": 1778312125.0,
    "cards": {
        "0000:00:02.0": {  # the iGPU: the desktop's compositor, busy, no device memory
            "driver": "xe",
            "vram_total_bytes": None,
            "clients": [{"name": "gnome-shell", "vram_bytes": 0, "engines": {"rcs": 0.3}}],
        },
        "0000:03:00.0": {
            "driver": "xe",
            "vram_total_bytes": 32 * 2**30,
            "clients": [{"name": "vllm/vllm", "vram_bytes": 29 * 2**30, "engines": {}}],
        },
    },
}


def test_the_arbiters_card_is_the_one_named() -> None:
    """Every card's clients count when no card is named (a host with one GPU); with the
    Arc card named, the iGPU's busy compositor is not someone on the card."""
    merged = parse_card_view(TWO_CARDS)
    assert [c.name for c in merged.others(["vllm/vllm"])] == ["gnome-shell"]
    arc = parse_card_view(TWO_CARDS, "0000:03:00.0")
    assert arc == CardView(
        1778312125.0, (CardClient("vllm/vllm", 29 * 2**30, ()),), vram_total_bytes=32 * 2**30
    )
    assert arc.others(["vllm/vllm"]) == ()
    igpu = parse_card_view(TWO_CARDS, "0000:00:02.0")
    assert (igpu.vram_total_bytes, [c.name for c in igpu.clients]) == (None, ["gnome-shell"])
    with pytest.raises(CardDataError) as info:
        parse_card_view(TWO_CARDS, "0000:04:00.0")
    assert str(info.value) == (
        "card data has no card 0000:04:00.0 (cards: 0000:00:02.0, 0000:03:00.0): "
        "set card_pdev to the card's PCI address"
    )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "card data must be a JSON object, got list"),
        ({"clients": []}, "card data has no scan time (timestamp_unix or timestamp)"),
        (
            {"timestamp_unix": 1, "clients": [{"name": "x", "vram_bytes": "1"}]},
            "card data client x has vram_bytes '1'",
        ),
    ],
)
def test_parse_card_view_errors(doc: Any, message: str) -> None:
    with pytest.raises(CardDataError) as info:
        parse_card_view(doc)
    assert str(info.value) == message


GIB = 1024**3


@pytest.mark.parametrize(
    ("policy", "peak", "plex", "go"),
    [
        (False, 20 * GIB, 2 * GIB, False),  # the default: the veto stands
        (True, None, 2 * GIB, False),  # a workflow never run: no proof, the veto stands
        # 20 + 2 (plex) + 4 (retrieval) + 4 (reserve) + 1 (headroom) = 31 <= 32
        (True, 20 * GIB, 2 * GIB, True),
        # one GiB more of Plex: 32 + 1 > 32
        (True, 20 * GIB, 3 * GIB + 1, False),
    ],
)
def test_image_beside_a_foreign_client_only_when_it_provably_fits(
    policy: bool, peak: int | None, plex: int, go: bool
) -> None:
    card = CardView(
        NOW,
        (CardClient("plex/plex", plex, ("vcs",)), CardClient("retrieval/ovms", 4 * GIB, ())),
        32 * GIB,
    )
    config = make_config(
        Path("/nonexistent"),
        card_data_max_age_seconds=120.0,
        resident_client_names=("retrieval/ovms",),
        image_beside_foreign=policy,
        foreign_reserve_bytes=4 * GIB,
        vram_headroom_bytes=GIB,
    )
    decision = should_swap_to_image(obs(card=card, next_job_peak=peak), config, NOW)
    assert decision.go is go, decision.reasons
    if go:
        assert "image_beside_foreign" in decision.reasons[-1]
    else:
        assert any("plex/plex" in r for r in decision.reasons)
