"""Seeding an exported model repository (plugins/module_utils/_seed_*.py): the pure plan and
checks in tables, then real trees in temporary directories, the order of the system calls,
and a seed killed mid-copy.

The trees are a STAND-IN of the layout OpenVINO Model Server's ``export_model.py`` writes
for one target device (the server's ``config.json`` at the top, per model the IR pair
``openvino_model.xml``/``.bin``, the tokenizer pair ``openvino_tokenizer.xml``/``.bin``, the
model's own ``config.json`` and the ``graph.pbtxt``): NOT real weights.  The ``.bin`` files
are bytes derived from the revision, the ``.xml`` files an IR's outline.  The server config
and the graphs are the fixtures of ``tests/fixtures/ovms`` (see its README for their source).
"""

from __future__ import annotations

import ast
import contextlib
import errno
import fcntl
import hashlib
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.cardshare.gpuhost.plugins.module_utils import _seed_copy
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_bound import (
    bound_method,
    child_argv,
    child_program,
    parse_child_output,
    scope_argv,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_copy import copy_file, seed
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_options import (
    DEFAULT_MARKER,
    MIB,
    DestEntry,
    FileRecord,
    MarkerState,
    SeedError,
    SeedOptions,
    check_tree_relation,
    validate_options,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_plan import (
    RUNTIME_ALLOWANCE,
    copy_order,
    dirty_bytes_bound,
    memory_bound_bytes,
    plan_seed,
)
from ansible_collections.cardshare.gpuhost.plugins.module_utils._seed_trees import (
    marker_document,
    parse_marker,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "ovms"
SEED_PY = Path(_seed_copy.__file__)
EMBED, RERANK = "bge-m3", "bge-reranker-v2-m3"
JOURNAL = DEFAULT_MARKER + ".partial"

# An IR's outline: the shape of an OpenVINO IR .xml, not a model.
IR_XML = """<?xml version="1.0"?>
<!-- STAND-IN for the layout test: the outline of an OpenVINO IR, not a model -->
<net name="{name}" version="11">
\t<layers>
\t\t<layer id="0" name="input_ids" type="Parameter" version="opset1">
\t\t\t<data shape="?,?" element_type="i64"/>
\t\t</layer>
\t</layers>
\t<edges/>
</net>
"""


def _weights(label: str, size: int) -> bytes:
    block = hashlib.sha256(label.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def export_tree(
    root: Path,
    revision: str = "r1",
    device: str = "GPU",
    big: int = 0,
    models: tuple[str, ...] = (),
) -> Path:
    """A STAND-IN of one device's exported repository (see the module docstring): the weight
    bytes change with ``revision``; ``big`` makes the reranker's weights that many bytes."""
    models = models or (EMBED, RERANK)
    graphs = {EMBED: "embeddings-graph.gpu.pbtxt", RERANK: "rerank-graph.gpu.pbtxt"}
    root.mkdir(parents=True)
    config = {"model_config_list": [{"config": {"name": m, "base_path": m}} for m in models]}
    (root / "config.json").write_text(json.dumps(config, indent=4))
    for model in models:
        d = root / model
        d.mkdir()
        graph = (FIXTURES / graphs.get(model, graphs[EMBED])).read_text()
        (d / "graph.pbtxt").write_text(graph.replace('"GPU"', f'"{device}"'))
        (d / "openvino_model.xml").write_text(IR_XML.format(name=model))
        size = big if (model == RERANK and big) else 3000 + len(model)
        (d / "openvino_model.bin").write_bytes(_weights(f"{model}:{revision}", size))
        (d / "openvino_tokenizer.xml").write_text(IR_XML.format(name=f"{model}-tokenizer"))
        (d / "openvino_tokenizer.bin").write_bytes(_weights(f"{model}:tokenizer", 700))
        (d / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    return root


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the marker, by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != DEFAULT_MARKER
    }


def opts(src: Path, dest: Path, revision: str = "r1", **kw: Any) -> SeedOptions:
    return validate_options({"src": str(src), "dest": str(dest), "revision": revision, **kw})


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.rglob("*") if p.name.endswith(".seed-part"))


def marker_of(dest: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((dest / DEFAULT_MARKER).read_text())
    return doc


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    """(src, dest): a stand-in GPU export and a serving directory that does not exist yet."""
    return export_tree(tmp_path / "exports" / "r1" / "gpu"), tmp_path / "serving" / "models"


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param(
            {"revision": ""},
            "revision: got '' (empty); give the revision the repository was exported at (for "
            "example the model image tag or the export's commit): the marker holds it, and a new "
            "revision is what re-seeds",
            id="empty-revision",
        ),
        pytest.param(
            {"revision": "   "},
            "revision: got '   ' (empty); give the revision the repository was exported at (for "
            "example the model image tag or the export's commit): the marker holds it, and a new "
            "revision is what re-seeds",
            id="blank-revision",
        ),
        pytest.param(
            {"revision": None},
            "revision: got None; give the revision of the exported repository as a string "
            "(quote it in YAML)",
            id="no-revision",
        ),
        pytest.param(
            {"revision": "r1 "},
            "revision: got 'r1 ', with blanks around it; remove them (the marker compares the "
            "revision exactly, so a stray blank would re-seed)",
            id="blank-around",
        ),
        pytest.param(
            {"revision": "r1\nr2"},
            "revision: got 'r1\\nr2', which holds a control character; give a single-line "
            "revision string",
            id="newline",
        ),
        pytest.param(
            {"revision": "x" * 201},
            "revision: got 201 characters; at most 200 (a tag, a commit or a date, not a "
            "description)",
            id="long-revision",
        ),
        pytest.param(
            {"src": "exports/gpu"},
            "src: got 'exports/gpu', a relative path; give an absolute path on the host "
            "(relative to what? the module's working directory is not yours)",
            id="relative-src",
        ),
        pytest.param(
            {"dest": ""}, "dest: got ''; give an absolute path on the host", id="empty-dest"
        ),
        pytest.param(
            {"marker": "state/.seed"},
            "marker: got 'state/.seed'; give a file name in dest (no '/', not '.' or '..'), for "
            "example '.cardshare-seed'",
            id="marker-path",
        ),
        pytest.param(
            {"marker": ".."},
            "marker: got '..'; give a file name in dest (no '/', not '.' or '..'), for example "
            "'.cardshare-seed'",
            id="marker-dotdot",
        ),
        pytest.param(
            {"chunk_size": 4096},
            "chunk_size: got 4096; give between 65536 and 268435456 bytes (default 4194304): the "
            "process holds one chunk",
            id="small-chunk",
        ),
        pytest.param(
            {"chunk_size": "4M"}, "chunk_size: got '4M'; give a number of bytes", id="chunk-str"
        ),
        pytest.param(
            {"flush_bytes": 65536},
            "flush_bytes: got 65536; give 0 (flush at the end of each file only) or at least "
            "chunk_size (4194304)",
            id="flush-below-chunk",
        ),
    ],
)
def test_options_refused(changes: dict[str, Any], message: str) -> None:
    params = {"src": "/srv/exports/gpu", "dest": "/srv/models", "revision": "r1", **changes}
    with pytest.raises(SeedError) as caught:
        validate_options(params)
    assert str(caught.value) == message


def test_options_defaults_and_normalised_paths() -> None:
    options = validate_options(
        {"src": "/srv/exports//gpu/", "dest": "/srv/models/", "revision": "2026.2.1-r3"}
    )
    assert options == SeedOptions("/srv/exports/gpu", "/srv/models", "2026.2.1-r3")
    assert (options.marker, options.journal) == (DEFAULT_MARKER, JOURNAL)
    assert (options.chunk_size, options.flush_bytes) == (4 * MIB, 64 * MIB)
    assert validate_options({**options.to_params(), "flush_bytes": 0}).flush_bytes == 0


@pytest.mark.parametrize(
    ("src", "dest", "message"),
    [
        ("/srv/a", "/srv/b", None),
        ("/srv/a", "/srv/ab", None),
        (
            "/srv/a",
            "/srv/a",
            "dest: /srv/a is src; the serving directory must be a directory of its own, outside "
            "the exported repository",
        ),
        (
            "/srv/a",
            "/srv/a/models",
            "dest: /srv/a/models is inside src /srv/a; the seed would copy into the tree it "
            "reads: choose a dest outside the exported repository",
        ),
        (
            "/srv/models/exports/gpu",
            "/srv/models",
            "src: /srv/models/exports/gpu is inside dest /srv/models; a seed removes from dest "
            "what src does not hold, src included: keep the exported repository outside the "
            "serving directory",
        ),
        (
            "/srv/exports/gpu",
            "/",
            "src: /srv/exports/gpu is inside dest /; a seed removes from dest what src does not "
            "hold, src included: keep the exported repository outside the serving directory",
        ),
    ],
)
def test_tree_relation(src: str, dest: str, message: str | None) -> None:
    if message is None:
        check_tree_relation(src, dest)
        return
    with pytest.raises(SeedError) as caught:
        check_tree_relation(src, dest)
    assert str(caught.value) == message


# --- the marker ----------------------------------------------------------------------------

A = FileRecord("config.json", 3, "a" * 64)
B = FileRecord("m/w.bin", 10, "b" * 64)


def test_marker_round_trip() -> None:
    text = marker_document("r1", [B, A]).decode()
    assert json.loads(text) == {
        "format": 1,
        "generator": "cardshare.gpuhost.retrieval_seed",
        "revision": "r1",
        "files": [A.to_dict(), B.to_dict()],
    }
    assert parse_marker(text) == ("r1", (A, B))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("r1\n", "it is not JSON"),
        ("[]", "it is not a JSON object"),
        ('{"format": 2, "revision": "r1", "files": []}', "its format is 2, not 1"),
        ('{"format": 1, "revision": "", "files": []}', "it holds no revision"),
        ('{"format": 1, "revision": "r1"}', "it holds no file list"),
        (
            '{"format": 1, "revision": "r1", "files": [{"path": "a", "size": "3", "sha256": "x"}]}',
            "a file entry is not {path, size, sha256}: {'path': 'a', 'size': '3', 'sha256': 'x'}",
        ),
    ],
)
def test_marker_problems(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_marker(text)
    assert str(caught.value) == problem


# --- the plan (pure) -----------------------------------------------------------------------


def dest_of(*records: FileRecord, extra: tuple[DestEntry, ...] = ()) -> dict[str, DestEntry]:
    entries = {r.path: DestEntry(r.path, "file", r.size, r.sha256) for r in records}
    for record in records:
        parent = os.path.dirname(record.path)
        if parent:
            entries[parent] = DestEntry(parent, "dir")
    entries.update({e.path: e for e in extra})
    return entries


CURRENT = MarkerState(present=True, revision="r1", files=(A, B))
B2 = FileRecord("m/w.bin", 10, "c" * 64)


@pytest.mark.parametrize(
    ("dest", "marker", "journal", "plan", "reasons"),
    [
        pytest.param(
            {},
            MarkerState(present=False),
            False,
            (["config.json", "m/w.bin"], [], []),
            ["dest is empty: a first seed", "2 files are missing from dest"],
            id="first-seed",
        ),
        pytest.param(dest_of(A, B), CURRENT, False, ([], [], []), [], id="current"),
        pytest.param(
            dest_of(A, B),
            MarkerState(present=True, revision="r0", files=(A, B)),
            False,
            ([], [], []),
            ["the marker is at revision 'r0', 'r1' is asked for"],
            id="new-revision-same-files",
        ),
        pytest.param(
            dest_of(A, B2),
            CURRENT,
            False,
            ([], ["m/w.bin"], []),
            ["1 file differs from src (size or sha256)"],
            id="tampered-under-current-marker",
        ),
        pytest.param(
            dest_of(A, DestEntry("m/w.bin", "file", 4)),
            CURRENT,
            False,
            ([], ["m/w.bin"], []),
            ["1 file differs from src (size or sha256)"],
            id="cut-short-under-current-marker",
        ),
        pytest.param(
            dest_of(A),
            MarkerState(present=False),
            True,
            (["m/w.bin"], [], []),
            [
                "a seed of 'r1' was interrupted (.cardshare-seed.partial is there): every file "
                "is verified and the seed completed",
                "1 file is missing from dest",
            ],
            id="interrupted",
        ),
        pytest.param(
            dest_of(
                A,
                B,
                extra=(
                    DestEntry("old", "dir"),
                    DestEntry("old/w.bin", "file", 5),
                    DestEntry("old/.w.bin.x1.seed-part", "file", 2),
                    DestEntry("m/link", "other"),
                ),
            ),
            MarkerState(present=True, revision="r0", files=(A,)),
            False,
            ([], [], ["m/link", "old/.w.bin.x1.seed-part", "old/w.bin", "old/"]),
            [
                "the marker is at revision 'r0', 'r1' is asked for",
                "4 entries in dest not in src",
            ],
            id="stale-entries-deepest-first",
        ),
        pytest.param(
            {"m": DestEntry("m", "file", 1), "config.json": DestEntry("config.json", "dir")},
            MarkerState(present=True, problem="it is not JSON"),
            False,
            (["config.json", "m/w.bin"], [], ["config.json/", "m"]),
            [
                "the marker cannot be used: it is not JSON",
                "2 files are missing from dest",
                "2 entries in dest not in src",
            ],
            id="kinds-swapped-bad-marker",
        ),
        pytest.param(
            dest_of(A, B),
            MarkerState(present=False),
            False,
            ([], [], []),
            ["no marker: dest has not been marked current"],
            id="adopt-a-copy-of-src",
        ),
    ],
)
def test_plan(
    dest: dict[str, DestEntry],
    marker: MarkerState,
    journal: bool,
    plan: tuple[list[str], list[str], list[str]],
    reasons: list[str],
) -> None:
    result = plan_seed([A, B], dest, marker, "r1", journal_present=journal, journal_revision="r1")
    assert (list(result.add), list(result.replace), list(result.remove)) == plan
    assert list(result.reasons) == reasons
    assert result.changed is bool(reasons)
    assert result.warnings == ()


def test_plan_warns_when_src_changed_under_the_same_revision() -> None:
    result = plan_seed([A, B2], dest_of(A, B2), CURRENT, "r1")
    assert result.changed and not (result.add or result.replace or result.remove)
    assert result.reasons == ("the marker's file list differs from src",)
    assert result.warnings == (
        "src differs from the tree marked at revision 'r1', under the same revision: dest is "
        "brought to src and marked again; give every new export a new revision, so that the "
        "marker tells them apart",
    )


def test_plan_refuses_a_dest_it_did_not_seed() -> None:
    foreign = dest_of(A, extra=tuple(DestEntry(f"home/f{i}", "file", 1) for i in range(6)))
    with pytest.raises(SeedError) as caught:
        plan_seed([A, B], foreign, MarkerState(present=False), "r1", dest_path="/srv")
    assert str(caught.value) == (
        "dest: /srv holds 6 entries that src does not (home/f0, home/f1, home/f2, home/f3, "
        "home/f4, ...) and no seed marker (.cardshare-seed): it was not seeded by this module, "
        "and a seed removes what src does not hold; give a directory of its own as dest, or "
        "empty this one"
    )


def test_copy_order_puts_the_server_config_last() -> None:
    assert copy_order(["config.json", "b/config.json", "a/w.bin", "b/graph.pbtxt"]) == [
        "a/w.bin",
        "b/config.json",
        "b/graph.pbtxt",
        "config.json",
    ]


@pytest.mark.parametrize(
    ("largest", "chunk", "flush", "dirty", "bound"),
    [
        # the seed's models (~600 MB), flushed every 64 MiB: the bound no longer grows with them
        (600_000_000, 4 * MIB, 64 * MIB, 68 * MIB, 204 * MIB),
        (6_000_000_000, 4 * MIB, 64 * MIB, 68 * MIB, 204 * MIB),
        # flushed at the end of each file only (the seed's bare sync): one file
        (600_000_000, 4 * MIB, 0, 600_000_000, 1213 * MIB),
        # a file smaller than the flush interval is all the dirty set can be
        (10 * MIB, 4 * MIB, 64 * MIB, 10 * MIB, 88 * MIB),
        (1, 64 * 1024, 64 * 1024, 1, 65 * MIB),
    ],
)
def test_bounds(largest: int, chunk: int, flush: int, dirty: int, bound: int) -> None:
    assert dirty_bytes_bound(largest, chunk, flush) == dirty
    assert memory_bound_bytes(largest, chunk, flush) == bound
    assert bound >= RUNTIME_ALLOWANCE + chunk + 2 * dirty
    assert bound % MIB == 0


# --- running under the bound (the pieces; the module's tests run them together) ----------


@pytest.mark.parametrize(
    ("setting", "booted", "systemd_run", "expected"),
    [
        (
            "off",
            True,
            "/usr/bin/systemd-run",
            (False, "memory_bound=off: the seed ran without a memory bound"),
        ),
        ("auto", True, "/usr/bin/systemd-run", (True, "")),
        ("required", True, "/usr/bin/systemd-run", (True, "")),
        (
            "auto",
            False,
            "/usr/bin/systemd-run",
            (
                False,
                "systemd does not run this host (no {run}): the seed ran without a memory bound",
            ),
        ),
        (
            "auto",
            True,
            None,
            (False, "systemd-run is not installed: the seed ran without a memory bound"),
        ),
        (
            "required",
            False,
            "/usr/bin/systemd-run",
            "memory_bound: required, but systemd does not run this host (no {run}); seed on a "
            "host that systemd runs, or give memory_bound=auto to seed without the bound where "
            "it cannot be set",
        ),
        ("sometimes", True, None, "memory_bound: got 'sometimes'; give one of auto, required, off"),
    ],
)
def test_bound_method(
    tmp_path: Path, setting: str, booted: bool, systemd_run: str | None, expected: Any
) -> None:
    run = tmp_path / "run-systemd-system"
    if booted:
        run.mkdir()
    if isinstance(expected, str):
        with pytest.raises(SeedError) as caught:
            bound_method(setting, systemd_run, str(run))
        assert str(caught.value) == expected.format(run=run)
    else:
        use, why = bound_method(setting, systemd_run, str(run))
        assert (use, why) == (expected[0], expected[1].format(run=run))


def test_scope_and_child_argv() -> None:
    options = SeedOptions("/srv/exports/gpu", "/srv/models", "r1")
    assert scope_argv("/usr/bin/systemd-run", 204 * MIB, "/srv/models") == [
        "/usr/bin/systemd-run",
        "--scope",
        "--quiet",
        "--collect",
        "--description=cardshare.gpuhost.retrieval_seed into /srv/models",
        "-p",
        "MemoryMax=213909504",
        "--",
    ]
    argv = child_argv("/usr/bin/python3", options, diff=True)
    assert argv[:3] == ["/usr/bin/python3", "-I", "-"]
    assert json.loads(argv[3]) == {"options": options.to_params(), "diff": True}


@pytest.mark.parametrize(
    ("rc", "out", "err", "expected"),
    [
        (0, 'noise\n{"failed": false, "result": {"changed": true}}\n', "", {"changed": True}),
        (
            1,
            '{"failed": true, "msg": "src: /x is not a directory"}\n',
            "",
            "src: /x is not a directory",
        ),
        (
            -9,
            "",
            "",
            "the seed was killed (SIGKILL) under MemoryMax=213909504: dest is left without a "
            "marker and the next run completes it; a kill at the bound means the bound is wrong "
            "for this host: lower flush_bytes, or give memory_bound=off, and report it",
        ),
        (
            137,
            "",
            "",
            "the seed was killed (SIGKILL) under MemoryMax=213909504: dest is left without a "
            "marker and the next run completes it; a kill at the bound means the bound is wrong "
            "for this host: lower flush_bytes, or give memory_bound=off, and report it",
        ),
        (
            1,
            "",
            "Traceback (most recent call last):\n  ...\nFailed to start transient scope unit\n",
            "the seed under systemd-run ended with rc 1 and no answer: Traceback (most recent "
            "call last): /   ... / Failed to start transient scope unit; give memory_bound=off "
            "to seed without the bound",
        ),
    ],
)
def test_parse_child_output(rc: int, out: str, err: str, expected: Any) -> None:
    if isinstance(expected, dict):
        assert parse_child_output(rc, out, err, 204 * MIB) == expected
        return
    with pytest.raises(SeedError) as caught:
        parse_child_output(rc, out, err, 204 * MIB)
    assert str(caught.value) == expected


def _carried(program: str) -> dict[str, str]:
    """The modules' sources a child program carries (the argument of its ``json.loads``)."""
    call = next(
        node
        for node in ast.walk(ast.parse(program))
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "json.loads"
    )
    return dict(json.loads(ast.literal_eval(call.args[0])))


def test_the_child_program_from_a_zip_like_ansiballz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AnsiballZ imports module_utils from a zip; the child's program must still be read, the
    same as from the files, with each module's source as it is."""
    from_files = child_program()
    assert from_files is not None
    carried = _carried(from_files)
    assert carried == {name: Path(sys.modules[name].__file__ or "").read_text() for name in carried}
    package = sys.modules[child_program.__module__.rpartition(".")[0]]
    inner = package.__name__.replace(".", "/")
    archive = tmp_path / "payload.zip"
    with zipfile.ZipFile(archive, "w") as payload:
        for path in SEED_PY.parent.glob("_*.py"):
            payload.write(path, f"{inner}/{path.name}")
    monkeypatch.setattr(package, "__path__", [f"{archive}/{inner}"])
    prefix = f"{package.__name__}."
    for name in [name for name in sys.modules if name.startswith(prefix)]:
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(package, name[len(prefix) :], raising=False)
    try:
        zipped = importlib.import_module(child_program.__module__)
        assert ".zip" in (zipped.__file__ or "")
        assert zipped.child_program() == from_files
    finally:
        for name in [name for name in sys.modules if name.startswith(prefix)]:
            del sys.modules[name]


# --- real trees ----------------------------------------------------------------------------


def test_first_seed(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    result = seed(opts(src, dest), diff=True)
    assert tree(dest) == tree(src)
    assert leftovers(dest) == [] and not (dest / JOURNAL).exists()
    files = [f"{m}/{n}" for m in (EMBED, RERANK) for n in sorted(os.listdir(src / m))]
    assert result["plan"] == {"add": [*files, "config.json"], "replace": [], "remove": []}
    assert {k: result[k] for k in ("changed", "revision", "previous_revision")} == {
        "changed": True,
        "revision": "r1",
        "previous_revision": None,
    }
    assert result["interrupted_revision"] is None
    assert result["files_copied"] == result["files_total"] == len(files) + 1
    assert (
        result["bytes_copied"] == result["bytes_total"] == sum(len(b) for b in tree(src).values())
    )
    assert result["files_removed"] == 0
    assert result["marker"] == str(dest / DEFAULT_MARKER)
    assert (result["largest_file"], result["largest_file_bytes"]) == (
        f"{RERANK}/openvino_model.bin",
        3000 + len(RERANK),
    )
    assert result["dirty_bytes_bound"] == 3000 + len(RERANK)
    assert result["memory_bound_bytes"] == 69 * MIB
    marker = marker_of(dest)
    assert marker["revision"] == "r1"
    assert marker["files"] == [
        {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        for p, b in tree(src).items()
    ]
    assert oct((dest / EMBED / "openvino_model.bin").stat().st_mode & 0o777) == "0o644"
    assert oct((dest / EMBED).stat().st_mode & 0o777) == "0o755"
    assert result["diff"]["before"] == ""
    assert result["diff"]["before_header"] == f"{dest} (not marked current)"
    assert result["diff"]["after_header"] == f"{dest} (revision r1)"
    assert result["diff"]["after"].splitlines()[-1] == (
        f"config.json  {len(tree(src)['config.json'])} bytes  sha256:"
        + hashlib.sha256(tree(src)["config.json"]).hexdigest()
    )


def test_same_revision_changes_nothing(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    seed(opts(src, dest))
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dest.rglob("*")}
    result = seed(opts(src, dest))
    assert result["changed"] is False
    assert result["plan"] == {"add": [], "replace": [], "remove": []}
    assert result["reasons"] == [] and result["warnings"] == []
    assert result["previous_revision"] == "r1"
    assert (result["files_copied"], result["bytes_copied"], result["files_removed"]) == (0, 0, 0)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dest.rglob("*")} == before


def test_revision_bump_reseeds_and_removes_stale_files(
    tmp_path: Path, trees: tuple[Path, Path]
) -> None:
    src, dest = trees
    seed(opts(src, dest))
    (dest / EMBED / ".openvino_model.bin.x1.seed-part").write_bytes(b"left by someone")
    new = export_tree(tmp_path / "exports" / "r2" / "gpu", revision="r2", models=(RERANK,))
    result = seed(opts(new, dest, "r2"))
    assert tree(dest) == tree(new)
    assert not (dest / EMBED).exists()
    assert result["plan"] == {
        "add": [],
        "replace": [f"{RERANK}/openvino_model.bin", "config.json"],
        "remove": [
            f"{EMBED}/.openvino_model.bin.x1.seed-part",
            f"{EMBED}/config.json",
            f"{EMBED}/graph.pbtxt",
            f"{EMBED}/openvino_model.bin",
            f"{EMBED}/openvino_model.xml",
            f"{EMBED}/openvino_tokenizer.bin",
            f"{EMBED}/openvino_tokenizer.xml",
            f"{EMBED}/",
        ],
    }
    assert (result["previous_revision"], result["revision"]) == ("r1", "r2")
    assert result["reasons"][0] == "the marker is at revision 'r1', 'r2' is asked for"
    assert (result["files_copied"], result["files_removed"]) == (2, 8)
    assert marker_of(dest)["revision"] == "r2"
    assert seed(opts(new, dest, "r2"))["changed"] is False


def test_revision_bump_with_identical_files_rewrites_only_the_marker(
    tmp_path: Path, trees: tuple[Path, Path]
) -> None:
    src, dest = trees
    seed(opts(src, dest))
    weights = dest / RERANK / "openvino_model.bin"
    inode = weights.stat().st_ino
    result = seed(opts(src, dest, "r1-retagged"))
    assert result["changed"] is True
    assert (result["files_copied"], result["files_removed"]) == (0, 0)
    assert weights.stat().st_ino == inode
    assert marker_of(dest)["revision"] == "r1-retagged"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(b"X" + p.read_bytes()[1:]), id="same-size-byte"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:100]), id="cut-short"),
        pytest.param(lambda p: p.unlink(), id="deleted"),
    ],
)
def test_a_damaged_file_under_a_current_marker_is_repaired(
    trees: tuple[Path, Path], damage: Callable[[Path], Any]
) -> None:
    src, dest = trees
    seed(opts(src, dest))
    victim = dest / RERANK / "openvino_model.bin"
    damage(victim)
    result = seed(opts(src, dest))
    assert result["changed"] is True
    assert result["previous_revision"] == "r1"
    assert result["plan"]["replace"] + result["plan"]["add"] == [f"{RERANK}/openvino_model.bin"]
    assert result["files_copied"] == 1
    assert tree(dest) == tree(src)
    assert seed(opts(src, dest))["changed"] is False


def test_a_marker_that_lies_is_rewritten(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    seed(opts(src, dest))
    doc = marker_of(dest)
    doc["files"][0]["sha256"] = "0" * 64
    (dest / DEFAULT_MARKER).write_text(json.dumps(doc))
    result = seed(opts(src, dest))
    assert result["changed"] is True and result["files_copied"] == 0
    assert result["reasons"] == ["the marker's file list differs from src"]
    assert len(result["warnings"]) == 1
    assert marker_of(dest)["files"][0]["sha256"] != "0" * 64
    assert seed(opts(src, dest))["changed"] is False


def test_check_mode_writes_nothing(tmp_path: Path, trees: tuple[Path, Path]) -> None:
    src, dest = trees
    result = seed(opts(src, dest), check_mode=True, diff=True)
    assert result["changed"] is True and len(result["plan"]["add"]) == result["files_total"]
    assert result["files_copied"] == 0
    assert not dest.exists() and not dest.parent.exists()

    seed(opts(src, dest))
    new = export_tree(tmp_path / "exports" / "r2" / "gpu", revision="r2")
    (dest / "stale.bin").write_bytes(b"old")
    snapshot = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    result = seed(opts(new, dest, "r2"), check_mode=True, diff=True)
    assert result["plan"] == {
        "add": [],
        "replace": [f"{m}/openvino_model.bin" for m in (EMBED, RERANK)],
        "remove": ["stale.bin"],
    }
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == snapshot
    assert result["diff"]["before_header"] == f"{dest} (revision r1)"
    assert "stale.bin  3 bytes\n" in result["diff"]["before"]
    assert "stale.bin" not in result["diff"]["after"]


def refusal(src: Path, dest: Path, **kw: Any) -> str:
    with pytest.raises(SeedError) as caught:
        seed(opts(src, dest, **kw))
    return str(caught.value)


def test_a_link_escaping_src_is_refused(trees: tuple[Path, Path], tmp_path: Path) -> None:
    src, dest = trees
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"not from the export")
    link = src / RERANK / "openvino_model.bin"
    link.unlink()
    link.symlink_to(outside)
    assert refusal(src, dest) == (
        f"src: {link} is a symbolic link (to {outside}, outside src {src}); the seed copies "
        "regular files only, so that nothing it serves can come from outside the exported "
        "repository: replace the link with the file it names (cp --dereference) or export again"
    )
    assert not dest.exists()


def test_a_link_inside_src_and_a_fifo_are_refused(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    link = src / EMBED / "tokenizer.xml"
    link.symlink_to("openvino_tokenizer.xml")
    assert refusal(src, dest).startswith(
        f"src: {link} is a symbolic link (to openvino_tokenizer.xml, inside src {src}); "
    )
    link.unlink()
    fifo = src / EMBED / "pipe"
    os.mkfifo(fifo)
    assert refusal(src, dest) == (
        f"src: {fifo} is a FIFO; an exported repository holds regular files only: remove it "
        "from src"
    )


def test_dest_inside_src_and_src_inside_dest_are_refused(tmp_path: Path) -> None:
    src = export_tree(tmp_path / "gpu")
    assert refusal(src, src / "serving") == (
        f"dest: {src / 'serving'} is inside src {src}; the seed would copy into the tree it "
        "reads: choose a dest outside the exported repository"
    )
    assert refusal(src, tmp_path) == (
        f"src: {src} is inside dest {tmp_path}; a seed removes from dest what src does not "
        "hold, src included: keep the exported repository outside the serving directory"
    )
    # through a link to src, too: the paths are compared resolved
    (tmp_path / "alias").symlink_to(src)
    assert refusal(src, tmp_path / "alias").startswith(f"dest: {src} is src; ")
    assert not (src / "serving").exists()


def test_the_parent_of_the_device_trees_is_refused(tmp_path: Path) -> None:
    export_tree(tmp_path / "export" / "gpu")
    export_tree(tmp_path / "export" / "cpu", device="CPU")
    assert refusal(tmp_path / "export", tmp_path / "models") == (
        f"src: {tmp_path / 'export'} has no config.json at its top; it holds cpu/config.json, "
        "gpu/config.json: point src at one device's tree (for example "
        f"{tmp_path / 'export' / 'cpu'})"
    )
    # a model's own directory has a config.json too, the model's, not the server's
    model_dir = tmp_path / "export" / "gpu" / EMBED
    assert refusal(model_dir, tmp_path / "models") == (
        f"src: {model_dir / 'config.json'} is not the server's config (no model_config_list); "
        "src must be one device's exported tree, whose config.json lists the models (a model's "
        "own directory holds a config.json too: point src at the directory above it)"
    )
    assert refusal(tmp_path / "nowhere", tmp_path / "models") == (
        f"src: {tmp_path / 'nowhere'} is not a directory; give the exported repository for one "
        "device (the tree holding config.json and one directory per model)"
    )


def test_a_marker_name_in_src_is_refused(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    (src / JOURNAL).write_text("{}")
    assert refusal(src, dest) == (
        f"marker: src holds {src / JOURNAL}, a name the seed keeps for itself in dest; give "
        "marker another name"
    )


def test_a_directory_it_did_not_seed_is_refused_and_kept(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("mine")
    message = refusal(src, dest)
    assert message.startswith(f"dest: {dest} holds 1 entry that src does not (notes.txt) and no ")
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


def test_a_subset_of_src_is_adopted(trees: tuple[Path, Path]) -> None:
    """A volume an earlier per-file ``cp`` half-filled: verified and completed."""
    src, dest = trees
    (dest / EMBED).mkdir(parents=True)
    (dest / EMBED / "graph.pbtxt").write_bytes((src / EMBED / "graph.pbtxt").read_bytes())
    result = seed(opts(src, dest))
    assert f"{EMBED}/graph.pbtxt" not in result["plan"]["add"]
    assert result["files_copied"] == result["files_total"] - 1
    assert tree(dest) == tree(src)


def test_another_seed_holding_dest_is_refused(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    dest.mkdir(parents=True)
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert refusal(src, dest) == (
            f"dest: another seed is writing into {dest} (it holds the directory's lock); wait "
            "for it to finish, then run again"
        )
    finally:
        os.close(fd)
    assert list(dest.iterdir()) == []


def test_a_src_that_changes_while_copied_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(b"new bytes")
    target = tmp_path / "out"
    target.mkdir()
    claimed = FileRecord("w.bin", 9, hashlib.sha256(b"old bytes").hexdigest())
    with pytest.raises(SeedError) as caught:
        copy_file(str(src), str(target), "w.bin", claimed, bytearray(65536), 0)
    assert str(caught.value) == (
        f"src: {src} changed while the seed ran (now 9 bytes, sha256 "
        f"{hashlib.sha256(b'new bytes').hexdigest()}; read as 9 bytes, {claimed.sha256}): dest is "
        "left without a marker; run the seed again once the export is complete"
    )
    assert list(target.iterdir()) == []


def test_a_full_volume_leaves_no_marker_and_the_next_run_completes(
    tmp_path: Path, trees: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dest = trees
    seed(opts(src, dest))
    new = export_tree(tmp_path / "exports" / "r2" / "gpu", revision="r2")
    real = _seed_copy._write_all

    def full(fd: int, data: memoryview) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if f"/{RERANK}/.openvino_model.bin." in path:  # the volume fills during that file
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(_seed_copy, "_write_all", full)
    assert refusal(new, dest, revision="r2") == (
        f"dest: cannot seed {dest}: No space left on device; dest is left without a marker and "
        "the next run verifies it and completes the seed"
    )
    assert not (dest / DEFAULT_MARKER).exists()
    assert json.loads((dest / JOURNAL).read_text())["revision"] == "r2"
    assert leftovers(dest) == []
    monkeypatch.setattr(_seed_copy, "_write_all", real)
    result = seed(opts(new, dest, "r2"))
    assert result["interrupted_revision"] == "r2" and result["previous_revision"] is None
    assert result["plan"]["replace"] == [f"{RERANK}/openvino_model.bin"]  # bge-m3's was done
    assert tree(dest) == tree(new) and not (dest / JOURNAL).exists()


# --- the order of the system calls ----------------------------------------------------------


@pytest.fixture
def syscalls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Record open, fsync, fdatasync, posix_fadvise, replace and unlink, by path."""
    events: list[tuple[Any, ...]] = []

    def path_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    real = {
        n: getattr(os, n)
        for n in ("open", "fsync", "fdatasync", "posix_fadvise", "replace", "unlink")
    }

    def spy_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd: int = real["open"](path, flags, *args, **kw)
        events.append(("open", path_of(fd)))
        return fd

    def spy_sync(name: str) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            events.append((name, path_of(fd)))
            real[name](fd)

        return sync

    def spy_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        events.append(("fadvise", path_of(fd), offset, length, advice))
        real["posix_fadvise"](fd, offset, length, advice)

    def spy_replace(a: Any, b: Any) -> None:
        events.append(("replace", str(a), str(b)))
        real["replace"](a, b)

    def spy_unlink(path: Any) -> None:
        events.append(("unlink", str(path)))
        real["unlink"](path)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_sync("fsync"))
    monkeypatch.setattr(os, "fdatasync", spy_sync("fdatasync"))
    monkeypatch.setattr(os, "posix_fadvise", spy_fadvise)
    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(os, "unlink", spy_unlink)
    yield events


def test_each_file_is_synced_and_dropped_before_the_next_and_the_marker_is_last(
    tmp_path: Path, trees: tuple[Path, Path], syscalls: list[tuple[Any, ...]]
) -> None:
    src, dest = trees
    seed(opts(src, dest))
    big = 3 * 65536 + 5
    new = export_tree(tmp_path / "exports" / "r2" / "gpu", revision="r2", big=big)
    (new / "config.json").write_text((new / "config.json").read_text() + "\n")
    syscalls.clear()
    result = seed(opts(new, dest, "r2", chunk_size=65536, flush_bytes=65536))
    events = syscalls
    dontneed = os.POSIX_FADV_DONTNEED

    def at(event: tuple[Any, ...]) -> int:
        return events.index(event)

    journal_in = next(
        i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith(JOURNAL)
    )
    marker_gone = at(("unlink", str(dest / DEFAULT_MARKER)))
    assert journal_in < marker_gone
    first_write = next(
        i
        for i, e in enumerate(events)
        if e[0] == "open" and e[1].endswith(".seed-part") and JOURNAL not in e[1]
    )
    assert marker_gone < first_write  # nothing says "current" while files change

    copied = copy_order(result["plan"]["add"] + result["plan"]["replace"])
    assert copied[-1] == "config.json"
    windows = []
    for rel in copied:
        # hashing opened it too: the copy's open is the last
        start = max(i for i, e in enumerate(events) if e == ("open", str(new / rel)))
        tmp = events[start + 1][1]
        assert tmp.endswith(".seed-part") and os.path.dirname(tmp) == str(
            dest / os.path.dirname(rel)
        )
        synced = at(("fsync", tmp))
        dropped = at(("fadvise", tmp, 0, 0, dontneed))
        src_dropped = max(
            i for i, e in enumerate(events) if e == ("fadvise", str(new / rel), 0, 0, dontneed)
        )
        renamed = at(("replace", tmp, str(dest / rel)))
        dir_synced = next(
            i
            for i, e in enumerate(events)
            if i > renamed and e == ("fsync", str(dest / os.path.dirname(rel)).rstrip("/"))
        )
        assert start < synced < dropped < renamed < dir_synced
        assert synced < src_dropped < renamed
        windows.append((start, dir_synced))
    for (_, end), (next_start, _) in itertools.pairwise(windows):
        assert end < next_start  # a file is synced, dropped and renamed before the next begins

    # within the large file: synced and dropped every flush_bytes, both sides
    weights = str(new / RERANK / "openvino_model.bin")
    start, end = windows[copied.index(f"{RERANK}/openvino_model.bin")]
    inside = events[start:end]
    tmp = inside[1][1]
    assert [e for e in inside if e[0] == "fdatasync"] == [("fdatasync", tmp)] * 3
    assert [e[2:4] for e in inside if e[0] == "fadvise" and e[1] == weights] == [
        (0, 65536),
        (65536, 65536),
        (131072, 65536),
        (0, 0),
    ]

    marker_tmp = next(
        e[1] for e in events if e[0] == "replace" and e[2] == str(dest / DEFAULT_MARKER)
    )
    marker_synced = at(("fsync", marker_tmp))
    assert all(end < marker_synced for _, end in windows)
    after = events[at(("replace", marker_tmp, str(dest / DEFAULT_MARKER))) + 1 :]
    assert [e for e in after if e[0] in ("open", "fsync", "replace", "unlink")] == [
        ("open", str(dest)),
        ("fsync", str(dest)),
        ("unlink", str(dest / JOURNAL)),
        ("open", str(dest)),
        ("fsync", str(dest)),
    ]


# --- killed mid-copy -------------------------------------------------------------------------


def _kill_mid_copy(options: SeedOptions, part_dir: Path, full_size: int) -> tuple[int, int]:
    """Run the seed as the module's child runs it (its program on the interpreter's
    standard input) and SIGKILL it while it writes the large file; (returncode, bytes of the
    large file's temporary copy at the kill), or (returncode, -1) if the copy won the race."""
    source = child_program()
    assert source is not None
    proc = subprocess.Popen(
        child_argv(sys.executable, options),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    proc.stdin.write(source.encode())
    proc.stdin.close()
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            parts = list(part_dir.glob(".openvino_model.bin.*.seed-part"))
            with contextlib.suppress(OSError):
                if parts and 0 < parts[0].stat().st_size < full_size // 2:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return proc.returncode, parts[0].stat().st_size
            time.sleep(0.001)
        return proc.wait(), -1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_seed_killed_mid_copy_is_never_marked_and_the_next_run_completes(tmp_path: Path) -> None:
    big = 64 * MIB
    for attempt in range(3):
        base = tmp_path / f"attempt{attempt}"
        old = export_tree(base / "exports" / "r1" / "gpu")
        dest = base / "serving" / "models"
        seed(opts(old, dest))
        new = export_tree(base / "exports" / "r2" / "gpu", revision="r2", big=big)
        options = opts(new, dest, "r2", chunk_size=65536, flush_bytes=65536)
        rc, written = _kill_mid_copy(options, dest / RERANK, big)
        if written > 0:
            break
    assert rc == -signal.SIGKILL
    assert 0 < written < big
    # the killed seed left its temporary copy, the journal, and no marker: the old marker does
    # not claim r1 for a tree that is half r2, and nothing claims r2
    assert len(leftovers(dest)) == 1
    assert not (dest / DEFAULT_MARKER).exists()
    assert json.loads((dest / JOURNAL).read_text())["revision"] == "r2"
    parts = [p.relative_to(dest).as_posix() for p in dest.rglob("*.seed-part")]

    result = seed(opts(new, dest, "r2"))
    assert result["changed"] is True
    assert (result["interrupted_revision"], result["previous_revision"]) == ("r2", None)
    assert result["reasons"][0] == (
        "a seed of 'r2' was interrupted (.cardshare-seed.partial is there): every file is "
        "verified and the seed completed"
    )
    assert f"{RERANK}/openvino_model.bin" in result["plan"]["replace"]
    assert result["plan"]["remove"] == parts  # the killed copy's temporary file
    assert leftovers(dest) == [] and not (dest / JOURNAL).exists()
    assert tree(dest) == tree(new)
    assert marker_of(dest)["revision"] == "r2"
    assert seed(opts(new, dest, "r2"))["changed"] is False


def test_the_child_holds_one_chunk_not_the_file(tmp_path: Path) -> None:
    """Peak RSS of a child seeding a 64 MiB file: inside RUNTIME_ALLOWANCE + one chunk (page
    cache is not RSS; this measures what the bound's fixed part must hold)."""
    src = export_tree(tmp_path / "gpu", big=64 * MIB)
    options = opts(src, tmp_path / "models")
    source = child_program()
    assert source is not None
    probe = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], input=sys.stdin.buffer.read(), capture_output=True)\n"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *child_argv(sys.executable, options)],
        input=source.encode(),
        capture_output=True,
        check=True,
    ).stdout.split()
    rc, peak_kib = int(out[0]), int(out[1])
    assert rc == 0
    assert tree(tmp_path / "models") == tree(src)
    assert peak_kib * 1024 < RUNTIME_ALLOWANCE + options.chunk_size


# --- overrides (a rerank graph with its guards) ---------------------------------------------


def test_an_override_is_written_instead_and_marked_with_its_own_hash(
    trees: tuple[Path, Path],
) -> None:
    src, dest = trees
    graph = f"{RERANK}/graph.pbtxt"
    guarded = (src / graph).read_text() + "# guarded\n"
    result = seed(opts(src, dest, overrides={graph: guarded}))
    assert result["changed"] is True
    assert (dest / graph).read_text() == guarded
    assert (src / graph).read_text() != guarded  # src is never written
    files = {f["path"]: f for f in marker_of(dest)["files"]}
    assert files[graph]["sha256"] == hashlib.sha256(guarded.encode()).hexdigest()
    assert files[graph]["size"] == len(guarded.encode())

    again = seed(opts(src, dest, overrides={graph: guarded}))
    assert again["changed"] is False

    # another guard value rewrites that file alone, at the same revision
    changed = seed(opts(src, dest, overrides={graph: guarded + "# 32\n"}))
    assert changed["plan"] == {"add": [], "replace": [graph], "remove": []}
    assert (dest / graph).read_text() == guarded + "# 32\n"

    # without the override the export's own graph comes back
    plain = seed(opts(src, dest))
    assert plain["plan"]["replace"] == [graph]
    assert (dest / graph).read_bytes() == (src / graph).read_bytes()


def test_a_tampered_override_is_repaired(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    graph = f"{RERANK}/graph.pbtxt"
    seed(opts(src, dest, overrides={graph: "guarded\n"}))
    (dest / graph).write_text("someone's edit\n")
    result = seed(opts(src, dest, overrides={graph: "guarded\n"}))
    assert result["plan"]["replace"] == [graph]
    assert (dest / graph).read_text() == "guarded\n"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nope/graph.pbtxt": "x"}, "src holds no file nope/graph.pbtxt"),
        ({"../graph.pbtxt": "x"}, "is not a file's relative path"),
        ({"/abs/graph.pbtxt": "x"}, "is not a file's relative path"),
        ({DEFAULT_MARKER: "x"}, "is not a file's relative path"),
        ({f"{RERANK}/graph.pbtxt": 3}, "give text"),
        (["graph.pbtxt"], "give a mapping"),
    ],
)
def test_bad_overrides_are_refused_before_anything_changes(
    trees: tuple[Path, Path], overrides: Any, message: str
) -> None:
    src, dest = trees
    with pytest.raises(SeedError, match=message.replace(".", r"\.").replace("(", r"\(")):
        seed(opts(src, dest, overrides=overrides))
    assert not dest.exists()


def test_overrides_reach_the_bounded_child(trees: tuple[Path, Path]) -> None:
    src, dest = trees
    graph = f"{RERANK}/graph.pbtxt"
    argv = child_argv(sys.executable, opts(src, dest, overrides={graph: "g\n"}))
    assert json.loads(argv[-1])["options"]["overrides"] == {graph: "g\n"}
