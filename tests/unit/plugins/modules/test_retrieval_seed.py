"""``retrieval_seed`` through AnsibleModule: documentation against the argument spec, check
mode and diff, refusals as ``fail_json``, warnings, and the memory bound's three settings,
with a stand-in ``systemd-run`` where systemd would run the copy in a bounded scope.

The logic and the crash cases are tested in ``tests/unit/plugins/module_utils/test_seed.py``;
the trees here are a smaller STAND-IN of one device's exported repository (no real weights).

The stand-in ``systemd-run`` checks the options the module gives and runs the command after
``--`` in its own process: it proves the child's command, its source on standard input and
its answer, not the cgroup.  Nothing here sets a real ``MemoryMax=`` (this machine's init is
not systemd); the lab's hosts run systemd, where the molecule scenario can.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from ansible.module_utils import basic  # type: ignore[import-untyped]
from ansible.utils.plugin_docs import add_fragments  # type: ignore[import-untyped]
from ansible_collections.cardshare.gpuhost.plugins.doc_fragments import attributes
from ansible_collections.cardshare.gpuhost.plugins.module_utils import _seed_bound
from ansible_collections.cardshare.gpuhost.plugins.modules import retrieval_seed
from gpuhost_sim import FailJson

MIB = 1024 * 1024
MARKER = ".cardshare-seed"

# A smaller STAND-IN of an export for one device: the server's config.json, one model with a
# graph, an IR pair and a tokenizer. Bytes, not weights.
LAYOUT = {
    "config.json": b'{"model_config_list": [{"config": {"name": "bge-m3", "base_path": "m"}}]}',
    "bge-m3/graph.pbtxt": b'node { calculator: "EmbeddingsCalculatorOV" }\n',
    "bge-m3/openvino_model.xml": b'<?xml version="1.0"?>\n<net name="stand-in" version="11"/>\n',
    "bge-m3/openvino_tokenizer.xml": b'<?xml version="1.0"?>\n<net name="tok" version="11"/>\n',
    "bge-m3/openvino_tokenizer.bin": b"\x01" * 512,
}


def export(root: Path, revision: str = "r1") -> Path:
    for rel, data in {**LAYOUT, "bge-m3/openvino_model.bin": revision.encode() * 1000}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


@pytest.fixture
def no_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host systemd does not run, whatever runs these tests."""
    monkeypatch.setattr(_seed_bound, "SYSTEMD_RUNTIME_DIR", str(tmp_path / "no-run-systemd-system"))


@pytest.fixture
def warnings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(basic.AnsibleModule, "warn", lambda _self, w: said.append(w))
    return said


def args(src: Path, dest: Path, revision: str = "r1", **extra: Any) -> dict[str, Any]:
    return {"src": str(src), "dest": str(dest), "revision": revision, **extra}


# --- documentation -------------------------------------------------------------------------


class _Fragments:
    def get(self, name: str) -> SimpleNamespace | None:
        if name != "cardshare.gpuhost.attributes":
            return None
        fragment = attributes.ModuleDocFragment
        return SimpleNamespace(
            ansible_name=name, **{k: v for k, v in vars(fragment).items() if k.isupper()}
        )


def test_documentation_matches_argument_spec() -> None:
    doc = yaml.safe_load(retrieval_seed.DOCUMENTATION)
    add_fragments(doc, retrieval_seed.__file__, _Fragments(), is_module=True)
    yaml.safe_load(retrieval_seed.EXAMPLES)
    returns = yaml.safe_load(retrieval_seed.RETURN)
    spec = retrieval_seed.ARGUMENT_SPEC
    assert sorted(doc["options"]) == sorted(spec)
    for name, option in doc["options"].items():
        for key in ("type", "default", "choices"):
            assert option.get(key) == spec[name].get(key), (name, key)
        assert bool(option.get("required")) == bool(spec[name].get("required")), name
    assert {a: v["support"] for a, v in doc["attributes"].items()} == {
        "check_mode": "full",
        "diff_mode": "full",
        "idempotent": "full",
    }
    assert all(v["description"] for v in doc["attributes"].values())
    for key in (
        "changed",
        "revision",
        "previous_revision",
        "files_copied",
        "bytes_copied",
        "files_removed",
        "largest_file_bytes",
        "marker",
        "dirty_bytes_bound",
        "memory_bound_bytes",
    ):
        assert key == "changed" or key in returns, key


# --- seeding through the module ------------------------------------------------------------


def test_seed_then_nothing_to_do(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    no_systemd: None,
    warnings: list[str],
) -> None:
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    first = run_module(retrieval_seed.main, args(src, dest))
    assert first["changed"] is True
    assert files(dest) == files(src)
    assert (first["files_copied"], first["bytes_copied"]) == (6, sum(map(len, files(src).values())))
    assert first["memory_bound_enforced"] is False
    assert first["memory_bound_detail"] == (
        f"systemd does not run this host (no {_seed_bound.SYSTEMD_RUNTIME_DIR}): the seed ran "
        "without a memory bound"
    )
    assert first["marker"] == str(dest / MARKER)
    assert "warnings" not in first and warnings == []

    second = run_module(retrieval_seed.main, args(src, dest))
    assert second["changed"] is False
    assert second["previous_revision"] == "r1"
    assert second["plan"] == {"add": [], "replace": [], "remove": []}


def test_check_mode_and_diff(
    tmp_path: Path, run_module: Callable[..., dict[str, Any]], no_systemd: None
) -> None:
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    run_module(retrieval_seed.main, args(src, dest))
    new = export(tmp_path / "gpu-r2", "r2")
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    result = run_module(
        retrieval_seed.main,
        {**args(new, dest, "r2"), "_ansible_check_mode": True, "_ansible_diff": True},
    )
    assert result["changed"] is True
    assert result["plan"] == {"add": [], "replace": ["bge-m3/openvino_model.bin"], "remove": []}
    assert (result["files_copied"], result["previous_revision"]) == (0, "r1")
    assert result["memory_bound_detail"] == "check mode: nothing was copied, so nothing was bounded"
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before
    diff = result["diff"]
    assert (diff["before_header"], diff["after_header"]) == (
        f"{dest} (revision r1)",
        f"{dest} (revision r2)",
    )
    changed = [
        (b, a)
        for b, a in zip(diff["before"].splitlines(), diff["after"].splitlines(), strict=True)
        if a != b
    ]
    assert [a.split()[0] for _, a in changed] == ["bge-m3/openvino_model.bin"]

    result = run_module(
        retrieval_seed.main,
        {**args(src, tmp_path / "fresh"), "_ansible_check_mode": True, "_ansible_diff": True},
    )
    assert result["changed"] is True and not (tmp_path / "fresh").exists()
    assert result["diff"]["before"] == ""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"revision": ""},
            "revision: got '' (empty); give the revision the repository was exported at (for "
            "example the model image tag or the export's commit): the marker holds it, and a new "
            "revision is what re-seeds",
            id="empty-revision",
        ),
        pytest.param(
            {"dest": "{src}/serving"},
            "dest: {src}/serving is inside src {src}; the seed would copy into the tree it "
            "reads: choose a dest outside the exported repository",
            id="dest-inside-src",
        ),
        pytest.param(
            {"link": True},
            "src: {src}/bge-m3/openvino_model.bin is a symbolic link (to /etc/hostname, outside "
            "src {src}); the seed copies regular files only, so that nothing it serves can come "
            "from outside the exported repository: replace the link with the file it names (cp "
            "--dereference) or export again",
            id="link-escaping-src",
        ),
        pytest.param(
            {"memory_bound": "required"},
            "memory_bound: required, but systemd does not run this host (no {run}); seed on a "
            "host that systemd runs, or give memory_bound=auto to seed without the bound where "
            "it cannot be set",
            id="bound-required",
        ),
    ],
)
def test_refusals_change_nothing(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    no_systemd: None,
    change: dict[str, Any],
    message: str,
) -> None:
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    if change.pop("link", False):
        (src / "bge-m3" / "openvino_model.bin").unlink()
        (src / "bge-m3" / "openvino_model.bin").symlink_to("/etc/hostname")
    given = {k: v.format(src=src) for k, v in change.items()}
    before = files(src)
    with pytest.raises(FailJson) as caught:
        run_module(retrieval_seed.main, {**args(src, dest), **given})
    assert caught.value.result["msg"] == message.format(
        src=src, run=_seed_bound.SYSTEMD_RUNTIME_DIR
    )
    assert not dest.exists()
    assert files(src) == before


def test_a_warning_reaches_the_play(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    no_systemd: None,
    warnings: list[str],
) -> None:
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    run_module(retrieval_seed.main, args(src, dest))
    (src / "bge-m3" / "graph.pbtxt").write_text("re-exported, same revision\n")
    result = run_module(retrieval_seed.main, args(src, dest))
    assert result["changed"] is True and result["files_copied"] == 1
    assert warnings == [
        "src differs from the tree marked at revision 'r1', under the same revision: dest is "
        "brought to src and marked again; give every new export a new revision, so that the "
        "marker tells them apart"
    ]


# --- under systemd-run (a stand-in) ---------------------------------------------------------


def fake_systemd_run(tmp_path: Path, then: str = "exec") -> tuple[Path, Path]:
    """A ``systemd-run`` that logs its arguments, refuses anything but ``--scope`` with a
    ``MemoryMax=``, and runs the command (``exec``) or is killed as at the bound (``kill``)."""
    log = tmp_path / "systemd-run.log"
    script = tmp_path / "bin" / "systemd-run"
    script.parent.mkdir()
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, signal, sys\n"
        "argv = sys.argv[1:]\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps(argv) + '\\n')\n"
        "cut = argv.index('--')\n"
        "if '--scope' not in argv[:cut] or not any(a.startswith('MemoryMax=') for a in argv):\n"
        "    sys.exit('Failed to start transient scope unit: not a bounded scope')\n"
        f"if {then!r} == 'kill':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.execv(argv[cut + 1], argv[cut + 1:])\n"
    )
    script.chmod(0o755)
    return script, log


@pytest.fixture
def systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[str], tuple[Path, Path]]:
    """A host systemd runs (its runtime directory exists), with a stand-in systemd-run."""
    run = tmp_path / "run-systemd-system"
    run.mkdir()
    monkeypatch.setattr(_seed_bound, "SYSTEMD_RUNTIME_DIR", str(run))

    def install(then: str = "exec") -> tuple[Path, Path]:
        script, log = fake_systemd_run(tmp_path, then)
        monkeypatch.setattr(
            basic.AnsibleModule,
            "get_bin_path",
            lambda _self, name, *a, **kw: str(script) if name == "systemd-run" else None,
        )
        return script, log

    return install


def test_auto_seeds_in_a_bounded_scope(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    systemd: Callable[[str], tuple[Path, Path]],
) -> None:
    _script, log = systemd("exec")
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    result = run_module(retrieval_seed.main, {**args(src, dest), "_ansible_diff": True})
    assert result["changed"] is True and files(dest) == files(src)
    bound = result["memory_bound_bytes"]
    assert bound == 69 * MIB  # 64 MiB + one 4 MiB chunk + twice the 3 KB largest file
    assert result["memory_bound_enforced"] is True
    assert result["memory_bound_detail"] == (
        f"the copy ran in a transient systemd scope with MemoryMax={bound}"
    )
    assert result["diff"]["after_header"] == f"{dest} (revision r1)"
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    cut = call.index("--")
    assert call[:cut] == [
        "--scope",
        "--quiet",
        "--collect",
        f"--description=cardshare.gpuhost.retrieval_seed into {dest}",
        "-p",
        f"MemoryMax={bound}",
    ]
    assert call[cut + 1 : cut + 4] == [sys.executable, "-I", "-"]
    assert json.loads(call[cut + 4])["options"]["revision"] == "r1"

    again = run_module(retrieval_seed.main, args(src, dest, memory_bound="required"))
    assert again["changed"] is False and again["memory_bound_enforced"] is True


def test_a_refusal_in_the_scope_is_the_modules_refusal(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    systemd: Callable[[str], tuple[Path, Path]],
) -> None:
    systemd("exec")
    src = export(tmp_path / "gpu")
    with pytest.raises(FailJson) as caught:
        run_module(retrieval_seed.main, args(src, src / "models"))
    assert caught.value.result["msg"] == (
        f"dest: {src / 'models'} is inside src {src}; the seed would copy into the tree it "
        "reads: choose a dest outside the exported repository"
    )


def test_a_kill_in_the_scope_leaves_no_marker(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    systemd: Callable[[str], tuple[Path, Path]],
) -> None:
    systemd("kill")
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    with pytest.raises(FailJson) as caught:
        run_module(retrieval_seed.main, args(src, dest))
    assert caught.value.result["msg"] == (
        f"the seed was killed (SIGKILL) under MemoryMax={69 * MIB}: dest is left without a "
        "marker and the next run completes it; a kill at the bound means the bound is wrong "
        "for this host: lower flush_bytes, or give memory_bound=off, and report it"
    )
    assert not (dest / MARKER).exists()


def test_off_copies_in_process_even_where_systemd_runs(
    tmp_path: Path,
    run_module: Callable[..., dict[str, Any]],
    systemd: Callable[[str], tuple[Path, Path]],
) -> None:
    _script, log = systemd("exec")
    src, dest = export(tmp_path / "gpu"), tmp_path / "models"
    result = run_module(retrieval_seed.main, args(src, dest, memory_bound="off"))
    assert result["changed"] is True and files(dest) == files(src)
    assert (result["memory_bound_enforced"], result["memory_bound_detail"]) == (
        False,
        "memory_bound=off: the seed ran without a memory bound",
    )
    assert not log.exists()
    assert os.listdir(dest).count(MARKER) == 1
