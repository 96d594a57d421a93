"""The lab host's bytecode cache for Ansible's per-task payloads (LAB ONLY, not a simulation).

Each case runs a fresh interpreter that loads the hook the way the image's .pth file does,
with the cache directory moved under tmp_path, and imports from a real zip.
"""

from __future__ import annotations

import json
import marshal
import subprocess
import sys
import zipfile
from pathlib import Path

HOOK = (
    Path(__file__).parents[3]
    / "lab/images/rhel10-sim/rootfs/usr/local/lib/python3.11/dist-packages/cardshare_lab_pyc.py"
)

RUNNER = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cardshare_lab_pyc", sys.argv[1])
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
hook._DIR = sys.argv[2]
sys.path.insert(0, sys.argv[3])
import payload_mod
try:
    payload_mod.boom()
except ZeroDivisionError as exc:
    tb = exc.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename
print(json.dumps({"value": payload_mod.VALUE, "file": payload_mod.__file__, "where": where}))
"""


def make_zip(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("payload_mod.py", f"VALUE = {value}\n\ndef boom():\n    return 1 / 0\n")
    return path


def run(cache: Path, archive: Path) -> dict[str, str | int]:
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(HOOK), str(cache), str(archive)],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, str | int] = json.loads(out.stdout)
    return result


def test_a_payload_is_compiled_once_and_reported_at_its_own_path(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = make_zip(tmp_path / "a" / "ansible_stat_payload.zip", 1)
    assert run(cache, first)["value"] == 1
    entries = list(cache.iterdir())
    assert len(entries) == 1
    # the next task sends the same source in a zip at another temporary path
    second = make_zip(tmp_path / "b" / "ansible_stat_payload.zip", 1)
    result = run(cache, second)
    assert result["value"] == 1
    assert list(cache.iterdir()) == entries
    assert str(second) in str(result["file"])
    # a traceback names the zip this run imported, not the one that filled the cache
    assert str(result["where"]).startswith(str(second))


def test_changed_source_is_compiled_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert run(cache, make_zip(tmp_path / "a" / "ansible_stat_payload.zip", 1))["value"] == 1
    assert run(cache, make_zip(tmp_path / "b" / "ansible_stat_payload.zip", 2))["value"] == 2
    assert len(list(cache.iterdir())) == 2


def test_a_damaged_entry_is_compiled_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run(cache, make_zip(tmp_path / "a" / "ansible_stat_payload.zip", 1))
    (entry,) = cache.iterdir()
    entry.write_bytes(b"\x00garbage")
    assert run(cache, make_zip(tmp_path / "b" / "ansible_stat_payload.zip", 1))["value"] == 1


def test_other_zips_are_not_cached(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert run(cache, make_zip(tmp_path / "cardshare.pyz", 3))["value"] == 3
    assert not cache.exists()


def test_an_unwritable_cache_falls_back_to_compiling(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be\n")
    result = run(blocker / "cache", make_zip(tmp_path / "a" / "ansible_stat_payload.zip", 4))
    assert result["value"] == 4


def test_the_cached_code_is_what_runs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run(cache, make_zip(tmp_path / "a" / "ansible_stat_payload.zip", 1))
    (entry,) = cache.iterdir()
    # put other code under the entry's key: a run that reads the cache runs it
    source = "VALUE = 99\n\ndef boom():\n    return 1 / 0\n"
    entry.write_bytes(marshal.dumps(compile(source, "elsewhere", "exec")))
    assert run(cache, make_zip(tmp_path / "b" / "ansible_stat_payload.zip", 1))["value"] == 99
