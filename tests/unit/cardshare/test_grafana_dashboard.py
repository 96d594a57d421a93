"""The collection's Grafana dashboard (extras/grafana/cardshare.json) asks only for series the
box really exports, with labels those series really carry.

Every PromQL expression of the dashboard (the panels' queries and the ``card`` variable's
``label_values``) is read by a small PromQL tokenizer (:func:`promql_refs`) for the metric
names it selects, the labels of its matchers and the labels of its ``by``/``without``/``on``
lists. The exposition they are checked against is written by the project's own writers: the
recorder's textfile after two scans of a synthetic ``/proc`` and ``/sys`` (the recorder tests'
``rec_tree``: a simulation of the card's driver files), the retrieval watchdog's textfile, the
arbiter's and the proxy's metric families in a registry of their own rendered by
``prometheus_client``'s ``generate_latest`` (as their ``/metrics`` do), and the re-encode
campaign's ``/metrics`` text. Each is read back with ``prometheus_client``'s text parser.
Sample names are matched as Prometheus stores them: a counter as ``<name>_total``, a
histogram only as ``_bucket``, ``_sum`` and ``_count`` (a bare histogram name selects nothing).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cardshare import exposition
from cardshare.arbiter.common import ALERT_NAMES
from cardshare.arbiter.metrics import families as arbiter_families
from cardshare.arbiter.states import Mode
from cardshare.arbiter.store import PhaseTiming, SwapRecord
from cardshare.campaign.server import metrics_text as campaign_metrics
from cardshare.naming import DEFAULT_RULES
from cardshare.proxy.metrics import Counters, Gauges
from cardshare.proxy.metrics import families as proxy_families
from cardshare.recorder import ScanConfig, run_scan
from cardshare.retrieval import ratchet

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "extras" / "grafana" / "cardshare.json"

# -- a PromQL tokenizer ----------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
    |(?P<var>\$\{[A-Za-z_]\w*(?::\w+)?\}|\$[A-Za-z_]\w*|\[\[[A-Za-z_]\w*\]\])
    |(?P<duration>(?:[0-9]+(?:ms|[smhdwy]))+(?![A-Za-z0-9_]))
    |(?P<number>(?:0[xX][0-9a-fA-F]+|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(?![A-Za-z_:]))
    |(?P<ident>[A-Za-z_][A-Za-z0-9_:]*)
    |(?P<matchop>=~|!~|!=|==|<=|>=|=|<|>)
    |(?P<punct>[{}()\[\],])
    |(?P<op>[-+*/%^@:])
    """,
    re.VERBOSE,
)

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
FUNCTIONS = frozenset(
    {
        "abs",
        "absent",
        "absent_over_time",
        "avg_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "count_over_time",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "delta",
        "deriv",
        "exp",
        "floor",
        "histogram_avg",
        "histogram_count",
        "histogram_fraction",
        "histogram_quantile",
        "histogram_stddev",
        "histogram_stdvar",
        "histogram_sum",
        "holt_winters",
        "hour",
        "idelta",
        "increase",
        "irate",
        "label_join",
        "label_replace",
        "last_over_time",
        "ln",
        "log10",
        "log2",
        "mad_over_time",
        "max_over_time",
        "min_over_time",
        "minute",
        "month",
        "predict_linear",
        "present_over_time",
        "quantile_over_time",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sort",
        "sort_by_label",
        "sort_by_label_desc",
        "sort_desc",
        "sqrt",
        "stddev_over_time",
        "stdvar_over_time",
        "sum_over_time",
        "time",
        "timestamp",
        "vector",
        "year",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "cos",
        "cosh",
        "deg",
        "pi",
        "rad",
        "sin",
        "sinh",
        "tan",
        "tanh",
        "start",
        "end",
    }
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"})
#: Labels Prometheus gives every series it scrapes (its target's), whatever the exposition.
TARGET_LABELS = frozenset({"instance", "job"})


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]  # the labels its matchers name
    position: int  # its token's index


@dataclass(frozen=True)
class Grouping:
    keyword: str
    labels: frozenset[str]
    metrics: frozenset[str]  # the metrics the labels must be on


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None or match.lastgroup is None:
            raise ValueError(f"cannot read {expr[pos:]!r} in {expr!r}")
        if match.lastgroup != "ws":
            out.append((match.lastgroup, match.group()))
        pos = match.end()
    return out


def _pairs(tokens: list[tuple[str, str]], expr: str) -> dict[int, int]:
    """The index of each bracket's partner (both ways); unbalanced raises ValueError."""
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, (kind, text) in enumerate(tokens):
        if kind != "punct" or text == ",":
            continue
        if text in "([{":
            stack.append(i)
        elif not stack or tokens[stack[-1]][1] != closing[text]:
            raise ValueError(f"unbalanced {text!r} in {expr!r}")
        else:
            opened = stack.pop()
            pairs[opened], pairs[i] = i, opened
    if stack:
        raise ValueError(f"unclosed {tokens[stack[-1]][1]!r} in {expr!r}")
    return pairs


def _label_list(tokens: list[tuple[str, str]], start: int, end: int, expr: str) -> frozenset[str]:
    """The label names between the parentheses at ``start`` and ``end``."""
    inner = tokens[start + 1 : end]
    names = [text for kind, text in inner[0::2]]
    if any(kind != "ident" for kind, _ in inner[0::2]) or any(t != "," for _, t in inner[1::2]):
        raise ValueError(f"not a list of labels: {inner!r} in {expr!r}")
    return frozenset(names)


def promql_refs(expr: str) -> tuple[list[Selector], list[Grouping]]:
    """The metric selectors of ``expr`` (names with their matchers' labels) and its label lists
    (``by``, ``without``, ``on``, ``ignoring``, ``group_left``, ``group_right``). Raises
    ``ValueError`` on what it cannot read: an unknown function, a selector without a metric
    name, a malformed matcher or label list, an unbalanced bracket, a stray character."""
    tokens = _tokens(expr)
    pairs = _pairs(tokens, expr)
    selectors: list[Selector] = []
    scopes: list[tuple[str, frozenset[str], int, int]] = []  # keyword, labels, arg start, end
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if (kind, text) == ("punct", "["):  # a range or subquery: durations and variables
            inner = tokens[i + 1 : pairs[i]]
            if not inner or any(k not in {"duration", "var", "op"} for k, _ in inner):
                raise ValueError(f"not a range: {inner!r} in {expr!r}")
            i = pairs[i] + 1
            continue
        if (kind, text) == ("punct", "{"):
            raise ValueError(f"a selector without a metric name in {expr!r}")
        if kind != "ident":
            i += 1
            continue
        word = text.lower()
        if word in {"group_left", "group_right"} and following != ("punct", "("):
            scopes.append((word, frozenset(), -1, len(tokens)))  # no labels of its own
            i += 1
            continue
        if word in GROUPING:
            if following != ("punct", "("):
                raise ValueError(f"{text} without its labels in {expr!r}")
            close = pairs[i + 1]
            labels = _label_list(tokens, i + 1, close, expr)
            if word in {"by", "without"}:
                before = tokens[i - 1] if i > 0 else ("", "")
                if before[0] == "ident" and before[1] in AGGREGATIONS:  # sum by (x) (arg)
                    if close + 1 >= len(tokens) or tokens[close + 1] != ("punct", "("):
                        raise ValueError(f"{text} ({', '.join(labels)}) without its argument")
                    scopes.append((word, labels, close + 1, pairs[close + 1]))
                elif before == ("punct", ")") and tokens[pairs[i - 1] - 1][1] in AGGREGATIONS:
                    scopes.append((word, labels, pairs[i - 1], i - 1))  # sum (arg) by (x)
                else:
                    raise ValueError(f"{text} outside an aggregation in {expr!r}")
            else:  # on/ignoring/group_*: the labels of both sides, the whole expression here
                scopes.append((word, labels, -1, len(tokens)))
            i = close + 1
            continue
        if following == ("punct", "(") or (word in AGGREGATIONS and following[1] in GROUPING):
            if text not in FUNCTIONS and text not in AGGREGATIONS:
                raise ValueError(f"unknown function {text!r} in {expr!r}")
            i += 1
            continue
        if word in KEYWORDS:
            i += 1
            continue
        labels = frozenset[str]()
        if following == ("punct", "{"):
            close = pairs[i + 1]
            inner = tokens[i + 2 : close]
            while inner and inner[-1] == ("punct", ","):
                inner = inner[:-1]
            matchers = [inner[n : n + 3] for n in range(0, len(inner), 4)]
            commas = inner[3::4]
            if any(
                len(m) != 3
                or m[0][0] != "ident"
                or m[1] not in {("matchop", o) for o in ("=", "!=", "=~", "!~")}
                or m[2][0] != "string"
                for m in matchers
            ) or any(c != ("punct", ",") for c in commas):
                raise ValueError(f"malformed matchers {inner!r} in {expr!r}")
            labels = frozenset(m[0][1] for m in matchers)
            if "__name__" in labels:
                raise ValueError(f"a metric name in a matcher in {expr!r}: name it instead")
            selectors.append(Selector(text, labels, i))
            i = close + 1
            continue
        selectors.append(Selector(text, labels, i))
        i += 1
    groupings = [
        Grouping(word, labels, frozenset(s.metric for s in selectors if start < s.position < end))
        for word, labels, start, end in scopes
    ]
    return selectors, groupings


# -- the extractor itself --------------------------------------------------------------------


def test_the_extractor_reads_selectors_matchers_and_groupings() -> None:
    selectors, groupings = promql_refs(
        'histogram_quantile(0.95, sum by (le, job) (rate(a_seconds_bucket{card=~"$card",'
        ' outcome!="x"}[$__rate_interval])))'
        ' / on (instance) group_left max(rate(b_total{x="sum(c)"}[5m])[1h:1m] offset 1h)'
        " by (x) > bool 2"
    )
    assert selectors == [
        Selector("a_seconds_bucket", frozenset({"card", "outcome"}), 14),
        Selector("b_total", frozenset({"x"}), 40),
    ]
    assert groupings == [
        Grouping("by", frozenset({"le", "job"}), frozenset({"a_seconds_bucket"})),
        Grouping("on", frozenset({"instance"}), frozenset({"a_seconds_bucket", "b_total"})),
        Grouping("group_left", frozenset(), frozenset({"a_seconds_bucket", "b_total"})),
        Grouping("by", frozenset({"x"}), frozenset({"b_total"})),
    ]


def test_the_extractor_skips_strings_functions_keywords_and_numbers() -> None:
    selectors, _ = promql_refs(
        'label_replace(up{job="cardshare_fake"}, "dst", "$1", "src", "(.*)") and time() - 1e3'
        " or vector(inf) unless c:recorded:rate5m offset 5m"
    )
    assert [s.metric for s in selectors] == ["up", "c:recorded:rate5m"]


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("rat(x[5m])", "unknown function 'rat'"),
        ('sum(x{a="b"}', "unclosed"),
        ("sum(x))", "unbalanced"),
        ('{__name__="x"}', "without a metric name"),
        ('x{__name__="y"}', "a metric name in a matcher"),
        ('x{a="b" c="d"}', "malformed matchers"),
        ("x{a=b}", "malformed matchers"),
        ("rate(x[5 m])", "not a range"),
        ("sum by (a b) (x)", "not a list of labels"),
        ("x by (a)", "outside an aggregation"),
        ("x # comment", "cannot read"),
    ],
)
def test_the_extractor_refuses_what_it_cannot_read(expr: str, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        promql_refs(expr)


# -- the exposition the box writes -----------------------------------------------------------

S = 1_000_000_000
T0 = 1_790_424_000 * S
CARD = "0000:03:00.0"


def _scan_textfile(rec_tree: Any, fdinfo: Callable[..., str], tmp_path: Path) -> str:
    """The recorder's textfile after two scans (engine ratios need two) of two clients."""
    rec_tree.card(CARD)
    rec_tree.boot_id("b1")
    rec_tree.process(100, comm="python3", cmdline=("python3", "-m", "vllm"))
    rec_tree.process(200, comm="Plex Transcoder")
    textfile = tmp_path / "cardshare.prom"
    config = ScanConfig(
        root=str(rec_tree.root),
        data_dir=tmp_path / "data",
        textfile=textfile,
        rules=DEFAULT_RULES,
        is_drm=rec_tree.is_drm,
    )
    for n, scan in enumerate((T0, T0 + 60 * S)):
        busy = {"ccs": (1000 * (n + 1), 10_000 * (n + 1)), "vcs": (50 * (n + 1), 10_000 * (n + 1))}
        for pid, client_id, vram in ((100, 8, "20 GiB"), (200, 9, "512 MiB")):
            base = rec_tree.root / "proc" / str(pid)
            text = fdinfo(client_id, CARD, vram, busy, {"ccs": 4})
            if (base / "fd" / "3").exists():
                (base / "fdinfo" / "3").write_text(text)
            else:
                rec_tree.drm_fd(pid, 3, text)
        run_scan(config, scan)
    return textfile.read_text()


def _arbiter_text() -> str:
    last = SwapRecord(
        id=3,
        direction="to_llm",
        started=100.0,
        finished=160.0,
        ok=True,
        phases=(
            PhaseTiming("stop_comfyui", 4.0, 3.5, "ok"),
            PhaseTiming("start_llm", 50.0, 48.0, "ok"),
        ),
    )
    fams = arbiter_families(
        Mode.LLM,
        1,
        {"queued": 1, "running": 0, "done": 5, "failed": 1, "cancelled": 0},
        last,
        {"to_image": 2, "to_llm": 3},
        {ALERT_NAMES[0]: "the reason"},
        ALERT_NAMES,
        faults={ALERT_NAMES[0]: 1},
        heartbeat_age=1.5,
        plan={"index": 1, "max_model_len": 49152},
        tenants=[("vllm/vllm", "owner", 20 << 30), ("plex/plex", "foreign", 512 << 20)],
    )
    return generate_latest(exposition.registry_of(lambda: fams)).decode()


def _proxy_text() -> str:
    counters = Counters()
    counters.count("forwarded")
    counters.hold_seconds.observe(12.0)
    gauges = Gauges(
        held=2, in_flight=1, oldest_held_seconds=30.0, mode="image", mode_source="arbiter"
    )
    fams = proxy_families(counters, gauges)
    return generate_latest(exposition.registry_of(lambda: fams)).decode()


def _campaign_text() -> str:
    return campaign_metrics(
        {
            "counts": {"queued": 3, "done": 2},
            "saved_bytes": 1 << 30,
            "held_bytes": 2 << 30,
            "queued_bytes": 3 << 30,
            "phase": "paused",
            "arbiter_pause_until": 1_790_424_100.0,
            "alerts": [{"name": "disk_low"}],
        }
    )


def _ratchet_text(state_dir: Path) -> str:
    state, _ = ratchet.load_state(state_dir / "ratchet.json")  # none yet: a fresh state
    state["restarts_total"] = 1
    state["last_restart"] = 1_790_424_000.0
    return ratchet.render_metrics(
        state,
        now=1_790_424_060.0,
        up=True,
        bound=8 << 30,
        source="cgroup",
        resident=6 << 30,
        memory_stat={"shmem": 6 << 30, "unevictable": 0, "anon": 1 << 30},
        in_flight=0.0,
    )


def series_labels(texts: dict[str, str]) -> dict[str, frozenset[str]]:
    """Every sample name of the expositions with the union of its label names."""
    labels: dict[str, set[str]] = {}
    owner: dict[str, str] = {}
    for source, text in texts.items():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert owner.setdefault(sample.name, source) == source, sample.name
                labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


@pytest.fixture
def exported(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> dict[str, frozenset[str]]:
    texts = {
        "recorder": _scan_textfile(rec_tree, rec_make_fdinfo, tmp_path),
        "arbiter": _arbiter_text(),
        "proxy": _proxy_text(),
        "campaign": _campaign_text(),
        "ratchet": _ratchet_text(tmp_path),
    }
    found = series_labels(texts)
    # the writers wrote what the dashboard is checked against (a scan that found no client,
    # an arbiter without its last swap would leave series out and the check vacuous)
    for name in (
        "cardshare_client_vram_bytes",
        "cardshare_client_engine_busy_ratio",
        "cardshare_arbiter_swap_phase_seconds",
        "cardshare_arbiter_tenant_vram_bytes",
        "cardshare_proxy_hold_seconds_bucket",
        "cardshare_campaign_alert",
        "cardshare_retrieval_last_restart_timestamp_seconds",
    ):
        assert name in found, name
    assert found["cardshare_client_vram_bytes"] >= {"card", "client", "kind"}
    return found


# -- the dashboard ---------------------------------------------------------------------------


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row keeps its panels


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every query of the dashboard: the panels' targets and the query
    variables' ``label_values(selector, label)`` (as the selector plus a ``by`` list)."""
    out: list[tuple[str, str]] = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_]\w*)\)", query)
        assert match, f"variable {var['name']}: {query!r} is not label_values(selector, label)"
        out.append((f"variable {var['name']}", f"group by ({match[2]}) ({match[1]})"))
    return out


def problems(dashboard: dict[str, Any], exported: dict[str, frozenset[str]]) -> list[str]:
    """What in the dashboard's queries the box does not export (empty when all is)."""
    found: list[str] = []
    for where, expr in expressions(dashboard):
        selectors, groupings = promql_refs(expr)
        if not selectors:
            found.append(f"{where}: no metric in {expr!r}")
        for sel in selectors:
            if sel.metric not in exported:
                found.append(f"{where}: {sel.metric} is not exported")
            elif missing := sel.labels - exported[sel.metric] - TARGET_LABELS:
                found.append(f"{where}: {sel.metric} has no label {sorted(missing)}")
        for group in groupings:
            for metric in sorted(group.metrics & exported.keys()):
                if missing := group.labels - exported[metric] - TARGET_LABELS:
                    found.append(f"{where}: {group.keyword} {sorted(missing)} not on {metric}")
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def test_every_query_names_exported_series_and_labels(
    dashboard: dict[str, Any], exported: dict[str, frozenset[str]]
) -> None:
    assert problems(dashboard, exported) == []
    used = {s.metric for _, e in expressions(dashboard) for s in promql_refs(e)[0]}
    # the panels the issue asks for, by what they read
    assert {
        "cardshare_client_vram_bytes",  # VRAM by client per card
        "cardshare_client_engine_busy_ratio",  # engines busy
        "cardshare_arbiter_mode",  # mode over time
        "cardshare_arbiter_swaps_total",  # swaps
        "cardshare_arbiter_swap_phase_seconds",  # and their duration
        "cardshare_proxy_held",  # held requests
        "cardshare_arbiter_queue_jobs",  # queue
        "cardshare_arbiter_alert",  # alerts
    } <= used


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("cardshare_proxy_held)", "cardshare_proxy_holding)", "cardshare_proxy_holding is not"),
        ("cardshare_arbiter_swaps_total", "cardshare_arbiter_swaps", "swaps is not exported"),
        ("cardshare_proxy_hold_seconds_bucket", "cardshare_proxy_hold_seconds", "seconds is not"),
        ('{card=~"$card"}', '{gpu=~"$card"}', "has no label ['gpu']"),
        ("by (client, engine)", "by (client, class)", "by ['class'] not on"),
        ("cardshare_card_vram_total_bytes, card)", "cardshare_card_vram_total_bytes, gpu)", "gpu"),
    ],
)
def test_a_query_of_a_series_not_exported_is_found(
    dashboard: dict[str, Any], exported: dict[str, frozenset[str]], old: str, new: str, problem: str
) -> None:
    mutated = copy.deepcopy(dashboard)
    queries = [t for p in _panels(mutated["panels"]) for t in p.get("targets", [])]
    queries += [v["query"] for v in mutated["templating"]["list"] if v["type"] == "query"]
    first = next(q for q in queries if old in q.get("expr", q.get("query", "")))
    key = "expr" if "expr" in first else "query"
    first[key] = first[key].replace(old, new, 1)
    found = problems(mutated, exported)
    assert found and any(problem in p for p in found), found


def test_it_imports_into_any_grafana(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert "__inputs" not in dashboard  # file provisioning does not fill ${DS_...} inputs
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["card"]["multi"] and variables["card"]["includeAll"]
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard["panels"]):
        for holder in [panel, *panel.get("targets", [])]:
            if panel["type"] != "row":
                assert holder["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # a panel per card reads only that card's series
    for panel in _panels(dashboard["panels"]):
        if panel.get("repeat") == "card":
            for target in panel["targets"]:
                assert 'card=~"$card"' in target["expr"], target["expr"]
    # no outside assets: nothing is loaded from an address
    assert not re.search(r"https?://", json.dumps(dashboard))
