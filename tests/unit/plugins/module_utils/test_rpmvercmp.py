"""rpmvercmp against rpm's own results.

The expected values were produced by rpm 4.18 (``rpm --eval '%{lua: print(rpm.vercmp(a, b))}'``);
most pairs are the cases of rpm's test-suite (``tests/rpmvercmp.at``), the rest are kernel
releases of the kind RHEL ships.
"""

from __future__ import annotations

import pytest
from ansible_collections.cardshare.gpuhost.plugins.module_utils._rpmvercmp import (
    compare_evr,
    compare_uname,
    rpmvercmp,
    split_uname,
    uname_sort_key,
)

CASES = [
    ("1.0", "1.0", 0),
    ("1.0", "2.0", -1),
    ("2.0", "1.0", 1),
    ("2.0.1", "2.0.1", 0),
    ("2.0", "2.0.1", -1),
    ("2.0.1", "2.0", 1),
    ("2.0.1a", "2.0.1a", 0),
    ("2.0.1a", "2.0.1", 1),
    ("2.0.1", "2.0.1a", -1),
    ("5.5p1", "5.5p1", 0),
    ("5.5p1", "5.5p2", -1),
    ("5.5p2", "5.5p1", 1),
    ("5.5p10", "5.5p10", 0),
    ("5.5p1", "5.5p10", -1),
    ("5.5p10", "5.5p1", 1),
    ("10xyz", "10.1xyz", -1),
    ("10.1xyz", "10xyz", 1),
    ("xyz10", "xyz10", 0),
    ("xyz10", "xyz10.1", -1),
    ("xyz10.1", "xyz10", 1),
    ("xyz.4", "xyz.4", 0),
    ("xyz.4", "8", -1),
    ("8", "xyz.4", 1),
    ("xyz.4", "2", -1),
    ("2", "xyz.4", 1),
    ("5.5p2", "5.6p1", -1),
    ("5.6p1", "5.5p2", 1),
    ("5.6p1", "6.5p1", -1),
    ("6.5p1", "5.6p1", 1),
    ("6.0.rc1", "6.0", 1),
    ("6.0", "6.0.rc1", -1),
    ("10b2", "10a1", 1),
    ("10a2", "10b2", -1),
    ("1.0aa", "1.0aa", 0),
    ("1.0a", "1.0aa", -1),
    ("1.0aa", "1.0a", 1),
    ("10.0001", "10.0001", 0),
    ("10.0001", "10.1", 0),
    ("10.1", "10.0001", 0),
    ("10.0001", "10.0039", -1),
    ("10.0039", "10.0001", 1),
    ("4.999.9", "5.0", -1),
    ("5.0", "4.999.9", 1),
    ("20101121", "20101121", 0),
    ("20101121", "20101122", -1),
    ("20101122", "20101121", 1),
    ("2_0", "2_0", 0),
    ("2.0", "2_0", 0),
    ("2_0", "2.0", 0),
    ("a", "a", 0),
    ("a+", "a+", 0),
    ("a+", "a_", 0),
    ("a_", "a+", 0),
    ("+a", "+a", 0),
    ("+a", "_a", 0),
    ("_a", "+a", 0),
    ("+_", "+_", 0),
    ("_+", "+_", 0),
    ("_+", "_", 0),
    ("_", "_+", 0),
    ("+", "_", 0),
    ("_", "+", 0),
    ("1.0~rc1", "1.0~rc1", 0),
    ("1.0~rc1", "1.0", -1),
    ("1.0", "1.0~rc1", 1),
    ("1.0~rc1", "1.0~rc2", -1),
    ("1.0~rc2", "1.0~rc1", 1),
    ("1.0~rc1~git123", "1.0~rc1~git123", 0),
    ("1.0~rc1~git123", "1.0~rc1", -1),
    ("1.0~rc1", "1.0~rc1~git123", 1),
    ("1.0^", "1.0^", 0),
    ("1.0^", "1.0", 1),
    ("1.0", "1.0^", -1),
    ("1.0^git1", "1.0^git1", 0),
    ("1.0^git1", "1.0", 1),
    ("1.0", "1.0^git1", -1),
    ("1.0^git1", "1.0^git2", -1),
    ("1.0^git2", "1.0^git1", 1),
    ("1.0^git1", "1.01", -1),
    ("1.01", "1.0^git1", 1),
    ("1.0^20160101", "1.0^20160101", 0),
    ("1.0^20160101", "1.0.1", -1),
    ("1.0.1", "1.0^20160101", 1),
    ("1.0^20160101^git1", "1.0^20160101^git1", 0),
    ("1.0^20160102", "1.0^20160101^git1", 1),
    ("1.0^20160101^git1", "1.0^20160102", -1),
    ("1.0~rc1^git1", "1.0~rc1^git1", 0),
    ("1.0~rc1^git1", "1.0~rc1", 1),
    ("1.0~rc1", "1.0~rc1^git1", -1),
    ("1.0^git1~pre", "1.0^git1~pre", 0),
    ("1.0^git1", "1.0^git1~pre", 1),
    ("1.0^git1~pre", "1.0^git1", -1),
    ("1b.fc17", "1b.fc17", 0),
    ("1b.fc17", "1.fc17", -1),
    ("1.fc17", "1b.fc17", 1),
    ("1g.fc17", "1g.fc17", 0),
    ("1g.fc17", "1.fc17", 1),
    ("1.fc17", "1g.fc17", -1),
    ("1.0~", "1.0^", -1),
    ("1.0^", "1.0~", 1),
    ("55.el10", "124.el10", -1),
    ("124.el10", "55.el10", 1),
    ("55.el10", "55.1.el10", -1),
    ("55.el10_0", "55.el10", 1),
    ("6.12.0", "6.15.2", -1),
    ("6.15.2", "6.12.0", 1),
    ("611.5.1.el10_1.x86_64", "55.el10.x86_64", 1),
    ("a", "1", -1),
    ("1", "a", 1),
]


@pytest.mark.parametrize(("a", "b", "expected"), CASES)
def test_rpmvercmp_matches_rpm(a: str, b: str, expected: int) -> None:
    assert rpmvercmp(a, b) == expected


@pytest.mark.parametrize(("a", "b", "expected"), CASES)
def test_rpmvercmp_is_antisymmetric(a: str, b: str, expected: int) -> None:
    assert rpmvercmp(b, a) == -expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, "6.12.0", "55.el10"), (0, "6.12.0", "124.el10"), -1),
        ((1, "1.0", "1"), (0, "9.9", "9"), 1),
        ((0, "6.12.0", "124.el10"), (0, "6.12.0", "124.el10"), 0),
        ((0, "6.17.8", "1.el10.elrepo"), (0, "6.12.0", "124.el10"), 1),
        ((0, "6.12.0", "55.el10_0.1"), (0, "6.12.0", "55.el10_0"), 1),
    ],
)
def test_compare_evr(a: tuple[int, str, str], b: tuple[int, str, str], expected: int) -> None:
    assert compare_evr(a, b) == expected


@pytest.mark.parametrize(
    ("uname", "expected"),
    [
        ("6.12.0-55.el10.x86_64", ("6.12.0", "55.el10.x86_64")),
        ("6.17.8-1.el10.elrepo.x86_64", ("6.17.8", "1.el10.elrepo.x86_64")),
        ("6.12.0", ("6.12.0", "")),
    ],
)
def test_split_uname(uname: str, expected: tuple[str, str]) -> None:
    assert split_uname(uname) == expected


def test_uname_sort_newest_first() -> None:
    kernels = [
        "6.12.0-55.el10.x86_64",
        "6.12.0-124.el10.x86_64",
        "6.12.0-9.el10.x86_64",
        "6.12.0-124.1.el10_1.x86_64",
    ]
    ordered = sorted(kernels, key=uname_sort_key, reverse=True)
    assert ordered == [
        "6.12.0-124.1.el10_1.x86_64",
        "6.12.0-124.el10.x86_64",
        "6.12.0-55.el10.x86_64",
        "6.12.0-9.el10.x86_64",
    ]
    assert compare_uname("6.12.0-9.el10.x86_64", "6.12.0-55.el10.x86_64") == -1
