"""Tests of the ``cardshare`` command line and of the zipapp build."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cardshare.cli import main
from cardshare.cli.recorder import ENGINES_UNKNOWN_LEGEND, format_clients

ROOT = Path(__file__).resolve().parents[3]
CID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


def _lab_like(tree: Any, make: Callable[..., str]) -> None:
    tree.card("0000:03:00.0")
    tree.boot_id("b1")
    tree.process(100001, comm="python3", cgroup=f"0::/system.slice/docker-{CID}.scope\n")
    tree.drm_fd(100001, 7, make(3, vram="20 GiB", cycles={"ccs": (10, 100)}))


def test_scan_then_clients_then_report(
    rec_tree: Any,
    rec_make_fdinfo: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not rec_tree.real_node:
        pytest.skip("mknod of a character device is not permitted here (needs CAP_MKNOD)")
    _lab_like(rec_tree, rec_make_fdinfo)
    data = tmp_path / "data"
    rules = tmp_path / "rules.json"
    rules.write_text('[{"pattern": "^python3$", "name": "llm", "match": "comm"}]')
    code = main(
        [
            "scan",
            "--root",
            str(rec_tree.root),
            "--data-dir",
            str(data),
            "--rules",
            str(rules),
            "--docker-socket",
            "",
            "--textfile",
            str(tmp_path / "c.prom"),
        ]
    )
    out = capsys.readouterr()
    assert (code, out.err) == (0, "")
    assert out.out == f"1 clients on 1 cards; wrote {data / 'current.json'}\n"
    current = json.loads((data / "current.json").read_text())
    assert current["cards"]["0000:03:00.0"]["clients"][0]["name"] == "llm"
    assert current["cards"]["0000:03:00.0"]["clients"][0]["containers"] == [CID]

    assert main(["clients", "--data-dir", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == current

    assert main(["clients", "--data-dir", str(data)]) == 0
    table = capsys.readouterr().out
    assert "llm     20.00 GiB" in table
    # the first scan has no earlier sample: the share is unknown, and the table says why
    assert "ccs=?" in table
    assert table.endswith(ENGINES_UNKNOWN_LEGEND + "\n")

    month = current["timestamp"][:7]
    assert main(["report", "--month", month, "--data-dir", str(data), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["vram_peak_bytes"]) for c in report["clients"]] == [("llm", 20 * 1024**3)]


def test_clients_two_samples(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    if not rec_tree.real_node:
        pytest.skip("mknod of a character device is not permitted here (needs CAP_MKNOD)")
    _lab_like(rec_tree, rec_make_fdinfo)
    code = main(
        [
            "clients",
            "--root",
            str(rec_tree.root),
            "--interval",
            "0.01",
            "--json",
            "--docker-socket",
            "",
            "--podman-socket",
            "",
        ]
    )
    assert code == 0
    snapshot = json.loads(capsys.readouterr().out)
    client = snapshot["cards"]["0000:03:00.0"]["clients"][0]
    # no engine socket: an unresolved container is named by its short id, never merged
    assert client["name"] == "docker:0123456789ab"
    assert client["engines"] == {"ccs": None}  # counters did not move between the samples


def test_format_clients() -> None:
    snapshot = {
        "timestamp": "2026-09-26T12:00:00Z",
        "host": "h",
        "cards": {
            "0000:03:00.0": {
                "driver": "xe",
                "vram_used_bytes": 1024**3,
                "vram_total_bytes": 32 * 1024**3,
                "clients": [
                    {
                        "name": "plex",
                        "vram_bytes": 1024**3,
                        "gtt_bytes": 0,
                        "system_bytes": 0,
                        "engines": {"vcs": 0.5, "vecs": None},
                        "pids": [7, 9],
                    }
                ],
            },
            "0000:04:00.0": {
                "driver": None,
                "vram_used_bytes": 0,
                "vram_total_bytes": None,
                "clients": [],
            },
        },
    }
    assert format_clients(snapshot) == (
        "scan 2026-09-26T12:00:00Z on h\n"
        "card 0000:03:00.0 (xe): VRAM used 1.00 GiB of 32.00 GiB\n"
        "  CLIENT  VRAM      GTT       SYSTEM    ENGINES         PIDS\n"
        "  plex    1.00 GiB  0.00 GiB  0.00 GiB  vcs=50% vecs=?  7,9\n"
        "card 0000:04:00.0 (?): VRAM used 0.00 GiB of ?\n"
        "  no clients\n"
        "ENGINES ? = no busy share yet: no earlier sample of this client to compare with (a new or "
        "restarted client, the first scan after a boot) or no time counted since it; the next scan "
        "compares with this one\n"
    )
    assert format_clients({"cards": {}}) == "scan None on None\nno DRM cards or clients found\n"


def _one_client(engines: dict[str, float | None]) -> dict[str, Any]:
    client = {"name": "vllm/vllm", "vram_bytes": 0, "gtt_bytes": 0, "system_bytes": 0}
    card: dict[str, Any] = {"driver": "xe", "vram_used_bytes": 0, "vram_total_bytes": 0}
    card["clients"] = [{**client, "engines": engines, "pids": [7]}]
    return {"timestamp": "t", "host": "h", "cards": {"0000:03:00.0": card}}


@pytest.mark.parametrize(
    ("engines", "shown", "legend"),
    [
        # right after a restart: no earlier sample, every share unknown
        ({"ccs": None, "rcs": None}, "ccs=? rcs=?", True),
        # one class without an earlier value is enough for the legend
        ({"ccs": 0.25, "vcs": None}, "ccs=25% vcs=?", True),
        # every share known (0 is a share, not an unknown): no legend
        ({"ccs": 0.25, "vcs": 0.0}, "ccs=25% vcs=0%", False),
        # no engine counters at all: no share to explain
        ({}, "-", False),
    ],
)
def test_format_clients_explains_unknown_shares(
    engines: dict[str, float | None], shown: str, legend: bool
) -> None:
    lines = format_clients(_one_client(engines)).splitlines()
    assert lines[3] == f"  vllm/vllm  0.00 GiB  0.00 GiB  0.00 GiB  {shown:<7}  7"
    assert lines[4:] == ([ENGINES_UNKNOWN_LEGEND] if legend else [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--month", "2026-13"], "argument --month: expected YYYY-MM, got '2026-13'"),
        (["report"], "the following arguments are required: --month"),
        (["scan", "--retention-months", "-1"], "argument --retention-months: expected 0 or more"),
        (["clients", "--interval", "0"], "argument --interval: expected a number above 0, got 0"),
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_runtime_errors_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "data"
    blocker.write_text("")
    cases = [
        (
            ["scan", "--root", str(tmp_path), "--data-dir", str(blocker)],
            f"cardshare: error: cannot create directory {blocker}: File exists\n",
        ),
        (
            ["scan", "--root", str(tmp_path), "--data-dir", str(tmp_path / "d")],
            f"cardshare: error: cannot scan {tmp_path / 'proc'}: No such file or directory\n",
        ),
        (
            ["scan", "--rules", str(tmp_path / "r.json"), "--data-dir", str(tmp_path / "d")],
            f"cardshare: error: cannot read rules file {tmp_path / 'r.json'}: "
            "No such file or directory\n",
        ),
        (
            ["report", "--month", "2026-09", "--data-dir", str(tmp_path)],
            "cardshare: error: no history for 2026-09: "
            f"{tmp_path / 'history' / '2026-09.jsonl'} does not exist\n",
        ),
        (
            ["clients", "--data-dir", str(tmp_path)],
            f"cardshare: error: cannot read {tmp_path / 'current.json'}: "
            "No such file or directory\n",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert (captured.err, captured.out) == (message, "")


def test_module_entry_point_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cardshare", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    assert result.returncode == 0
    assert "a month of history per client" in result.stdout


def test_the_scan_leaves_urllib_request_unimported(tmp_path: Path) -> None:
    """The timer's scan stays light: only the verbs that talk HTTP import urllib.request."""
    (tmp_path / "root" / "proc").mkdir(parents=True)
    code = (
        "import sys\n"
        "from cardshare.cli import main\n"
        "code = main(['scan', '--root', sys.argv[1], '--data-dir', sys.argv[2], '--quiet',\n"
        "             '--docker-socket', '', '--podman-socket', ''])\n"
        "print(code, 'urllib.request' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "root"), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src")},
    )
    assert (result.stdout, result.stderr) == ("0 False\n", "")


def test_zipapp_runs_scan(
    rec_tree: Any, rec_make_fdinfo: Callable[..., str], tmp_path: Path
) -> None:
    if not rec_tree.real_node:
        pytest.skip("mknod of a character device is not permitted here (needs CAP_MKNOD)")
    _lab_like(rec_tree, rec_make_fdinfo)
    pyz = tmp_path / "cardshare.pyz"
    build = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_zipapp.py"), str(pyz)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (build.returncode, build.stderr) == (0, "")
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    data = tmp_path / "data"
    run = subprocess.run(
        [
            sys.executable,
            "-I",
            str(pyz),
            "scan",
            "--root",
            str(rec_tree.root),
            "--data-dir",
            str(data),
            "--docker-socket",
            "",
            "--podman-socket",
            "",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={},
    )
    assert (run.returncode, run.stderr) == (0, "")
    current = json.loads((data / "current.json").read_text())
    assert [c["name"] for c in current["cards"]["0000:03:00.0"]["clients"]] == [
        "docker:0123456789ab"
    ]


def test_zipapp_build_usage() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_zipapp.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (result.returncode, result.stderr) == (
        2,
        "usage: python tools/build_zipapp.py OUTPUT\n",
    )


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("import json\nfrom os import path\n", []),
        ("import httpx\n", ["httpx"]),
        ("from cardshare.arbiter import states\n", ["cardshare.arbiter"]),
        ("from cardshare.recorder.output import x\nimport cardshare.fdinfo\n", []),
        ("from __future__ import annotations\n", []),
    ],
)
def test_zipapp_rejects_foreign_imports(source: str, bad: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_zipapp
    finally:
        sys.path.pop(0)
    assert build_zipapp.foreign_imports(source, "m.py") == bad


def _builder() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_zipapp
    finally:
        sys.path.pop(0)
    return build_zipapp


def test_zipapp_is_reproducible(tmp_path: Path) -> None:
    builder = _builder()
    first = builder.build(tmp_path / "a.pyz")
    os.utime(ROOT / "src" / "cardshare" / "cli" / "__init__.py")  # a newer mtime must not matter
    second = builder.build(tmp_path / "b.pyz")
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert stat.S_IMODE(first.stat().st_mode) == 0o755


def test_zipapp_exits_with_mains_status(tmp_path: Path) -> None:
    pyz = _builder().build(tmp_path / "cardshare.pyz")
    # a month that cannot be parsed is a usage error (2); a missing data dir a runtime error (1)
    usage = subprocess.run(
        [sys.executable, str(pyz), "report", "--month", "not-a-month"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert usage.returncode == 2, usage
    missing = subprocess.run(
        [
            sys.executable,
            str(pyz),
            "report",
            "--month",
            "2026-11",
            "--data-dir",
            str(tmp_path / "absent"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 1, missing
    assert missing.stderr.strip()
