"""The one standard-library writer of Prometheus text (cardshare.promtext) and its three users:
every output is read back by prometheus_client's parser with the exact label values."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cardshare import promtext
from cardshare.campaign.server import metrics_text
from cardshare.recorder.output import prometheus_text
from cardshare.retrieval import ratchet

# quote, backslash, newline, and the escaped forms themselves (must not be unescaped twice)
HOSTILE = ('a"b', "a\\b", "a\nb", 'a\\"b', "a\\nb", "\\", '"', "\n", "", "é ☃ {},=")


@pytest.mark.parametrize(
    ("value", "escaped"),
    [
        ("plain", "plain"),
        ('a"b', 'a\\"b'),
        ("a\\b", "a\\\\b"),
        ("a\nb", "a\\nb"),
        ("a\\nb", "a\\\\nb"),  # a backslash then n: not a newline
        ('\\"', '\\\\\\"'),
        ("\r\t", "\r\t"),  # only backslash, quote and newline are escaped
    ],
)
def test_escape_label(value: str, escaped: str) -> None:
    assert promtext.escape_label(value) == escaped


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("Bytes (Unix seconds).", "Bytes (Unix seconds)."),
        ('a "quoted" word', 'a "quoted" word'),  # HELP leaves quotes alone
        ("a\\b", "a\\\\b"),
        ("one\ntwo", "one\\ntwo"),
    ],
)
def test_escape_help(text: str, escaped: str) -> None:
    assert promtext.escape_help(text) == escaped


@pytest.mark.parametrize(
    ("value", "places", "text"),
    [
        (0, None, "0"),
        (3, None, "3"),
        (-7, None, "-7"),
        (2**63, None, "9223372036854775808"),
        (True, None, "1"),
        (False, None, "0"),
        (0.5, None, "0.5"),
        (1790424000.0, None, "1790424000.0"),
        (0.1 + 0.2, None, "0.30000000000000004"),  # shortest round trip, no digits lost
        (1e-7, None, "1e-07"),
        (math.inf, None, "+Inf"),
        (-math.inf, None, "-Inf"),
        (math.nan, None, "NaN"),
        (1790424123.98765, 3, "1790424123.988"),
        (17, 3, "17.000"),
        (2.5, 9, "2.500000000"),
        (math.inf, 3, "+Inf"),
        (math.nan, 9, "NaN"),
    ],
)
def test_number(value: float, places: int | None, text: str) -> None:
    assert promtext.number(value, places) == text
    parsed = float(text)  # without places, the value read back is the value written
    if places is None:
        assert parsed == float(value) or (math.isnan(parsed) and math.isnan(value))


def test_render_exact_text() -> None:
    families = [
        ("b_total", "counter", "Second\\first line\nsecond line."),
        ("a_seconds", "gauge", "Given first, written first."),
        ("c", "gauge", "No samples: HELP and TYPE only."),
    ]
    samples: dict[str, list[promtext.Sample]] = {
        "a_seconds": [({}, 1.23456), ({"x": 'q"\\\n'}, math.inf)],
        "b_total": [({"k": "v", "j": "w"}, 4)],
    }
    assert promtext.render(families, samples, {"a_seconds": 2}) == (
        "# HELP b_total Second\\\\first line\\nsecond line.\n"
        "# TYPE b_total counter\n"
        'b_total{k="v",j="w"} 4\n'
        "# HELP a_seconds Given first, written first.\n"
        "# TYPE a_seconds gauge\n"
        "a_seconds 1.23\n"
        'a_seconds{x="q\\"\\\\\\n"} +Inf\n'
        "# HELP c No samples: HELP and TYPE only.\n"
        "# TYPE c gauge\n"
    )


@pytest.mark.parametrize(
    ("families", "labels", "error"),
    [
        ([("a", "gauge", "h"), ("a", "gauge", "h")], {}, "repeated metric family name 'a'"),
        ([("1a", "gauge", "h")], {}, "bad or repeated metric family name '1a'"),
        ([("a", "gauge", "h")], {"bad-name": "v"}, "bad label name 'bad-name'"),
        ([("a", "gauge", "h")], {"__name__": "v"}, "bad label name '__name__'"),
    ],
)
def test_render_refuses_what_is_not_an_exposition(
    families: list[tuple[str, str, str]], labels: dict[str, str], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        promtext.render(families, {"a": [(labels, 1)]})


def _labels_of(text: str, name: str, key: str) -> list[str]:
    """The values of label ``key`` on the samples ``name``, as prometheus_client reads them."""
    return [
        sample.labels[key]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def test_render_round_trips_hostile_label_values() -> None:
    samples: dict[str, list[promtext.Sample]] = {"a": [({"v": v}, 1) for v in HOSTILE]}
    assert _labels_of(promtext.render([("a", "gauge", "h")], samples), "a", "v") == list(HOSTILE)


def test_recorder_client_names_round_trip() -> None:
    clients: list[dict[str, Any]] = [
        {"name": name, "engines": {"ccs": 0.5}, "drm_client_ids": [i]}
        for i, name in enumerate(HOSTILE)
    ]
    snapshot = {
        "timestamp_unix": 1.0,
        "cards": {"0000:03:00.0": {"vram_used_bytes": 0, "clients": clients}},
    }
    state = {"clients": {f"0000:03:00.0/{i}": {"cycles": {"ccs": 5}} for i in range(len(HOSTILE))}}
    text = prometheus_text(snapshot, state)
    assert _labels_of(text, "cardshare_client_vram_bytes", "client") == list(HOSTILE)
    assert _labels_of(text, "cardshare_client_engine_busy_ratio", "client") == list(HOSTILE)
    assert _labels_of(text, "cardshare_drm_client_engine_cycles_total", "client") == list(HOSTILE)


@pytest.mark.parametrize("source", HOSTILE)
def test_ratchet_source_round_trips(source: str) -> None:
    state = {"restarts_total": 0, "deferrals_total": {r: 0 for r in ratchet.DEFER_REASONS}}
    text = ratchet.render_metrics(
        state,
        now=1.0,
        up=True,
        bound=1,
        source=source,
        resident=1,
        memory_stat={},
        in_flight=None,
    )
    assert _labels_of(text, "cardshare_retrieval_resident_bytes", "source") == [source]


def test_campaign_alert_names_round_trip() -> None:
    """The campaign wrote alert names unescaped: a quote, backslash or newline broke /metrics."""
    status = {
        "counts": {'odd"state': 1},
        "saved_bytes": 0,
        "held_bytes": 0,
        "queued_bytes": 0,
        "phase": "running",
        "arbiter_pause_until": None,
        "alerts": [{"name": name} for name in HOSTILE],
    }
    text = metrics_text(status)
    assert _labels_of(text, "cardshare_campaign_alert", "name") == list(HOSTILE)
    assert _labels_of(text, "cardshare_campaign_files", "state") == ['odd"state']
