"""The collection's Prometheus alert rules (extras/prometheus/cardshare.rules.yml): valid for
``promtool check rules``, each alert tested by ``promtool test rules`` on made-up series
(tests/unit/prometheus/), and written against the metrics the recorder, the arbiter and the
proxy really export (a renamed metric would leave a rule that never fires).

promtool is Debian's (``tools/promtool.sh`` unpacks the prometheus package under .cache).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]

from cardshare.arbiter.common import ALERT_NAMES
from cardshare.arbiter.metrics import families as arbiter_families
from cardshare.arbiter.states import Mode
from cardshare.proxy.metrics import OUTCOMES, Counters, Gauges
from cardshare.proxy.metrics import families as proxy_families
from cardshare.recorder.output import _METRICS as RECORDER_METRICS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "extras" / "prometheus" / "cardshare.rules.yml"
RULE_TESTS = ROOT / "tests" / "unit" / "prometheus" / "cardshare.rules.test.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = subprocess.run(
        [str(ROOT / "tools" / "promtool.sh")], capture_output=True, text=True, check=False
    )
    if found.returncode != 0:
        if os.environ.get("CI"):  # CI installs what it needs: a missing promtool fails there
            pytest.fail(f"no promtool: {found.stderr.strip()}")
        pytest.skip(f"no promtool: {found.stderr.strip()}")
    return found.stdout.strip()


def test_promtool_checks_the_rules(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_promtool_unit_tests_every_alert(promtool: str) -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tested = yaml.safe_load(RULE_TESTS.read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == alerts  # each alert is shown firing (and, beside it, quiet)
    result = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        check=False,
        cwd=RULE_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def exported() -> set[str]:
    """Every metric name the three services export (counters with their ``_total``)."""
    names = {name for name, _kind, _help in RECORDER_METRICS}
    arbiter = arbiter_families(
        Mode.LLM,
        0,
        {},
        None,
        {},
        {},
        ALERT_NAMES,
        plan={"index": 0, "max_model_len": 65536},
        tenants=[("plex/plex", "foreign", 1)],
    )
    gauges = Gauges(
        held=0, in_flight=0, oldest_held_seconds=None, mode="llm", mode_source="arbiter"
    )
    for family in [*arbiter, *proxy_families(Counters(), gauges)]:
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_the_rules_use_exported_metrics_and_real_labels() -> None:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\bcardshare_[a-z_]+", e)}
    assert used and used <= exported(), used - exported()
    outcomes = re.search(r'outcome=~"([^"]+)"', " ".join(exprs))
    assert outcomes is not None
    assert set(outcomes.group(1).split("|")) <= set(OUTCOMES)
    modes = set(re.findall(r'mode="([a-z]+)"', " ".join(exprs)))
    assert modes <= {m.value for m in Mode}
