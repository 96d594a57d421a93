"""Issue 9: the raw engine counters in the Prometheus textfile, so Prometheus can rate() them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.naming import DEFAULT_RULES
from cardshare.recorder import ScanConfig, run_scan
from cardshare.recorder.output import prometheus_text

S = 1_000_000_000
SEPT = 1_790_424_000 * S

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_SAMPLE_RE = re.compile(rf"^({_NAME})(\{{(?:{_LABEL}(?:,{_LABEL})*)?\}})? (\S+)$")
_HELP_RE = re.compile(rf"^# HELP ({_NAME}) \S.*$")
_TYPE_RE = re.compile(rf"^# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)$")


def check_exposition(text: str) -> dict[tuple[str, str], float]:
    """A strict check of the Prometheus text format (0.0.4), as a textfile collector needs it.

    Every family has HELP then TYPE before its samples, once; families are not interleaved;
    counters end in ``_total``; values are floats; no series twice; a final newline.  Returns
    ``{(name, labels): value}``.
    """
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: set[str] = set()
    series: dict[tuple[str, str], float] = {}
    closed: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            match = _HELP_RE.match(line)
            assert match, line
            assert match.group(1) not in helps, f"HELP twice: {line}"
            helps.add(match.group(1))
            continue
        if line.startswith("# TYPE "):
            match = _TYPE_RE.match(line)
            assert match, line
            name, kind = match.groups()
            assert name in helps and name not in types, line
            types[name] = kind
            if current is not None:
                closed.add(current)
            current = name
            if kind == "counter":
                assert name.endswith("_total"), line
            continue
        match = _SAMPLE_RE.match(line)
        assert match, f"not a sample: {line!r}"
        name, labels, value = match.groups()
        assert name == current and name not in closed, f"sample outside its family: {line}"
        number = float(value)
        assert not math.isnan(number)
        if types[name] == "counter":
            assert number >= 0, line
        key = (name, labels or "")
        assert key not in series, f"series twice: {line}"
        series[key] = number
    return series


def _xe(busy: int, total: int, client_id: int = 8) -> str:
    return (
        "drm-driver:\txe\n"
        f"drm-client-id:\t{client_id}\n"
        "drm-pdev:\t0000:03:00.0\n"
        f"drm-cycles-ccs:\t{busy}\n"
        f"drm-total-cycles-ccs:\t{total}\n"
        "drm-engine-capacity-ccs:\t4\n"
        f"drm-cycles-rcs:\t{busy // 2}\n"
        f"drm-total-cycles-rcs:\t{total}\n"
    )


def _i915(ns: int) -> str:
    return (
        "drm-driver:\ti915\ndrm-client-id:\t3\ndrm-pdev:\t0000:04:00.0\n"
        f"drm-engine-video:\t{ns} ns\ndrm-engine-capacity-video:\t2\n"
    )


def test_textfile_has_counters_per_drm_client(rec_tree: Any, tmp_path: Path) -> None:
    rec_tree.card("0000:03:00.0")
    rec_tree.boot_id("b1")
    rec_tree.process(100, comm="python3")
    rec_tree.drm_fd(100, 3, _xe(1000, 10_000))
    rec_tree.process(200, comm="Plex Transcoder")
    rec_tree.drm_fd(200, 3, _i915(2_500_000_000))
    textfile = tmp_path / "cardshare.prom"
    config = ScanConfig(
        root=str(rec_tree.root),
        data_dir=tmp_path / "data",
        textfile=textfile,
        rules=DEFAULT_RULES,
        is_drm=rec_tree.is_drm,
    )
    run_scan(config, SEPT)
    # a counter read lower than before (driver quirk) keeps the larger value: never a reset
    (rec_tree.root / "proc/100/fdinfo/3").write_text(_xe(900, 20_000))
    run_scan(config, SEPT + 60 * S)
    series = check_exposition(textfile.read_text())
    xe = 'card="0000:03:00.0",client="python3",drm_client_id="8"'
    plex = 'card="0000:04:00.0",client="plex",drm_client_id="3"'
    got = {k: v for k, v in series.items() if k[0].startswith("cardshare_drm_client_")}
    assert got == {
        ("cardshare_drm_client_engine_cycles_total", f'{{{xe},engine="ccs"}}'): 1000,
        ("cardshare_drm_client_engine_cycles_total", f'{{{xe},engine="rcs"}}'): 500,
        ("cardshare_drm_client_engine_total_cycles_total", f'{{{xe},engine="ccs"}}'): 20_000,
        ("cardshare_drm_client_engine_total_cycles_total", f'{{{xe},engine="rcs"}}'): 20_000,
        ("cardshare_drm_client_engine_busy_seconds_total", f'{{{plex},engine="video"}}'): 2.5,
        ("cardshare_drm_client_engine_capacity", f'{{{xe},engine="ccs"}}'): 4,
        ("cardshare_drm_client_engine_capacity", f'{{{xe},engine="rcs"}}'): 1,
        ("cardshare_drm_client_engine_capacity", f'{{{plex},engine="video"}}'): 2,
    }
    assert "# TYPE cardshare_drm_client_engine_cycles_total counter" in textfile.read_text()


def test_prometheus_text_without_state_has_no_counter_samples() -> None:
    snapshot = {
        "timestamp_unix": 1.0,
        "stats": {},
        "cards": {
            "0000:03:00.0": {
                "driver": "xe",
                "vram_total_bytes": None,
                "vram_used_bytes": 0,
                "clients": [
                    {
                        "name": "a",
                        "vram_bytes": 0,
                        "system_bytes": 0,
                        "gtt_bytes": 0,
                        "engines": {},
                        "drm_client_ids": [1],
                    }
                ],
            }
        },
    }
    series = check_exposition(prometheus_text(snapshot))
    assert not [k for k in series if k[0].endswith("_total")]
    # a damaged state is ignored, not an error
    bad_state = {"clients": {"0000:03:00.0/1": {"cycles": {"ccs": "x"}, "capacity": []}}}
    assert check_exposition(prometheus_text(snapshot, bad_state)) == series


@pytest.mark.parametrize(
    "text",
    [
        "x 1",  # no final newline
        "# HELP x h\n# TYPE x counter\nx 1\n",  # counter without _total
        "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",  # series twice
        "# HELP x h\n# TYPE x gauge\nx{a=1} 1\n",  # unquoted label
        "# HELP x h\n# TYPE x gauge\ny 1\n",  # sample outside its family
    ],
)
def test_the_checker_is_strict(text: str) -> None:
    with pytest.raises(AssertionError):
        check_exposition(text)


def test_existing_textfile_passes_the_checker(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    rec_tree.process(1)
    rec_tree.drm_fd(1, 3, rec_make_fdinfo(1, cycles={"vcs": (0, 10)}))
    textfile = tmp_path / "t.prom"
    config = ScanConfig(
        root=str(rec_tree.root), data_dir=tmp_path / "d", textfile=textfile, is_drm=rec_tree.is_drm
    )
    run_scan(config, SEPT)
    check_exposition(textfile.read_text())


def test_malformed_fdinfo_lines_reach_the_textfile(rec_tree: Any, tmp_path: Path) -> None:
    """Issue 30: the scan counted malformed fdinfo lines (stats) but the textfile left them out.
    The file is read back by prometheus_client's own parser, as a scraper would."""
    from prometheus_client.parser import text_string_to_metric_families

    rec_tree.process(100, comm="python3")
    # a line without a colon and a size that is not one: both ignored, both counted
    rec_tree.drm_fd(100, 3, _xe(1000, 10_000) + "garbage line\ndrm-resident-vram0:\tlots\n")
    textfile = tmp_path / "cardshare.prom"
    config = ScanConfig(
        root=str(rec_tree.root), data_dir=tmp_path / "d", textfile=textfile, is_drm=rec_tree.is_drm
    )
    run_scan(config, SEPT)
    text = textfile.read_text()
    check_exposition(text)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["cardshare_scan_fdinfo_malformed_lines"]
    assert family.type == "gauge"
    assert "not key: value" in family.documentation
    assert [(s.labels, s.value) for s in family.samples] == [({}, 2.0)]
