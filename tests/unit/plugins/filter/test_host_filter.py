"""The host_path filter: the one rule for paths under cardshare_host_root."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.host import FilterModule

ROOT = Path(__file__).resolve().parents[4]
FILTERS: dict[str, Callable[..., Any]] = FilterModule().filters()
host_path = FILTERS["host_path"]

ROOT_FIX = (
    "set it (cardshare_host_root, or the role's *_host_root) to / on a real host, or to the "
    "simulated tree's absolute directory in the lab"
)
PATH_FIX = "give it as the host itself sees it, from its root (e.g. '/dev/dri')"


def test_filter_names() -> None:
    assert sorted(FILTERS) == ["host_path"]


def test_doc() -> None:
    with (ROOT / "plugins" / "filter" / "host_path.yml").open(encoding="utf-8") as handle:
        doc = yaml.safe_load(handle)
    assert doc["DOCUMENTATION"]["name"] == "host_path"
    assert doc["DOCUMENTATION"]["options"]["_input"]["required"] is True
    assert "cardshare.gpuhost.host_path" in doc["EXAMPLES"]
    assert "_value" in doc["RETURN"]


# (case id, root, path or None for no path, expected)
CASES: list[tuple[str, Any, Any, Any]] = [
    ("real host", "/", "/dev/dri", "/dev/dri"),
    ("real host, slashes", "//", "/dev/dri", "/dev/dri"),
    ("lab", "/lab/root", "/dev/dri", "/lab/root/dev/dri"),
    ("lab, one trailing slash", "/lab/root/", "/dev/dri", "/lab/root/dev/dri"),
    ("lab, trailing slashes", "/lab/root//", "/dev/dri", "/lab/root/dev/dri"),
    ("path as given", "/lab/root", "/dev/dri/", "/lab/root/dev/dri/"),
    ("root alone, real host", "/", None, "/"),
    ("root alone, slashes", "///", None, "/"),
    ("root alone, lab", "/lab/root/", None, "/lab/root"),
    ("root alone, lab as given", "/lab/root", None, "/lab/root"),
    ("path / is the root, lab", "/lab/root/", "/", "/lab/root"),
    ("path / is the root, real host", "/", "/", "/"),
    (
        "list of paths, lab",
        "/lab/root",
        ["/dev/dri", "/dev/kfd"],
        ["/lab/root/dev/dri", "/lab/root/dev/kfd"],
    ),
    ("list of paths, real host", "/", ["/dev/dri", "/dev/kfd"], ["/dev/dri", "/dev/kfd"]),
    ("tuple of paths", "/lab/", ("/dev/dri",), ["/lab/dev/dri"]),
    ("empty list", "/lab", [], []),
]


@pytest.mark.parametrize(
    ("root", "path", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_host_path(root: Any, path: Any, expected: Any) -> None:
    if path is None:
        assert host_path(root) == expected
    else:
        assert host_path(root, path) == expected


# (case id, root, path or None for no path, message)
FAILURES: list[tuple[str, Any, Any, str]] = [
    ("root None", None, None, f"host_path: the host root is empty (None); {ROOT_FIX}"),
    (
        "root None with a path",
        None,
        "/dev/dri",
        f"host_path: the host root is empty (None); {ROOT_FIX}",
    ),
    ("root empty", "", "/dev/dri", f"host_path: the host root is empty (''); {ROOT_FIX}"),
    (
        "root relative",
        "lab/root",
        "/dev/dri",
        f"host_path: the host root 'lab/root' is not absolute; {ROOT_FIX}",
    ),
    ("root ~", "~/sim", None, f"host_path: the host root '~/sim' is not absolute; {ROOT_FIX}"),
    ("root int", 5, None, f"host_path: the host root must be a string, got int 5; {ROOT_FIX}"),
    (
        "root list",
        ["/"],
        None,
        f"host_path: the host root must be a string, got list ['/']; {ROOT_FIX}",
    ),
    ("path relative", "/", "dev/dri", f"host_path: the path 'dev/dri' is not absolute; {PATH_FIX}"),
    (
        "path relative, lab",
        "/lab",
        "dev/dri",
        f"host_path: the path 'dev/dri' is not absolute; {PATH_FIX}",
    ),
    ("path empty", "/lab", "", f"host_path: the path '' is not absolute; {PATH_FIX}"),
    (
        "path int",
        "/lab",
        7,
        f"host_path: the path must be a string or a list of strings, got int 7; {PATH_FIX}",
    ),
    (
        "list with a relative path",
        "/lab",
        ["/dev/dri", "dev/kfd"],
        f"host_path: the path 'dev/kfd' is not absolute; {PATH_FIX}",
    ),
    (
        "list with None",
        "/lab",
        ["/dev/dri", None],
        f"host_path: the path must be a string or a list of strings, got NoneType None; {PATH_FIX}",
    ),
]


@pytest.mark.parametrize(
    ("root", "path", "message"), [c[1:] for c in FAILURES], ids=[c[0] for c in FAILURES]
)
def test_host_path_refuses(root: Any, path: Any, message: str) -> None:
    with pytest.raises(AnsibleFilterError) as err:
        if path is None:
            host_path(root)
        else:
            host_path(root, path)
    assert err.value.message == message


# The roles place host paths under the root with this filter only: no role strips the root's
# trailing slash with a regex of its own.
ROLE_FILES = sorted(p for p in (ROOT / "roles").rglob("*") if p.suffix in {".yml", ".j2"})


def test_no_role_normalises_a_host_root_itself() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in ROLE_FILES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "host_root" in line and "regex_replace" in line
    ]
    assert offenders == []
