# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""RPM version ordering in pure Python.

``rpmvercmp`` follows rpm's own algorithm (``rpmio/rpmvercmp.c``): a version is
split into runs of ASCII digits and runs of ASCII letters; every other character
only separates runs.  A numeric run beats an alphabetic one, numbers compare by
value (leading zeros ignored), letters compare byte-wise.  ``~`` sorts before
everything, even the end of the string (``1.0~rc1 < 1.0``); ``^`` sorts after the
end of the string but before any other run (``1.0 < 1.0^git1 < 1.0.1``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = [
    "compare_evr",
    "compare_uname",
    "evr_sort_key",
    "rpmvercmp",
    "split_uname",
    "uname_sort_key",
]

_DIGITS = "0123456789"
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_ALNUM = _DIGITS + _LETTERS


def _skip_separators(s: str, i: int) -> int:
    while i < len(s) and s[i] not in _ALNUM and s[i] not in "~^":
        i += 1
    return i


def _run_end(s: str, i: int, chars: str) -> int:
    while i < len(s) and s[i] in chars:
        i += 1
    return i


def rpmvercmp(a: str, b: str) -> int:
    """Compare two version (or release) strings as rpm does: -1, 0 or 1."""
    if a == b:
        return 0
    i = j = 0
    while i < len(a) or j < len(b):
        i = _skip_separators(a, i)
        j = _skip_separators(b, j)
        ca = a[i] if i < len(a) else ""
        cb = b[j] if j < len(b) else ""

        # Tilde sorts before everything else, including the end of the string.
        if ca == "~" or cb == "~":
            if ca != "~":
                return 1
            if cb != "~":
                return -1
            i += 1
            j += 1
            continue

        # Caret is like tilde, except that the end of the string sorts before it.
        if ca == "^" or cb == "^":
            if not ca:
                return -1
            if not cb:
                return 1
            if ca != "^":
                return 1
            if cb != "^":
                return -1
            i += 1
            j += 1
            continue

        if not (ca and cb):
            break

        numeric = ca in _DIGITS
        chars = _DIGITS if numeric else _LETTERS
        end_a = _run_end(a, i, chars)
        end_b = _run_end(b, j, chars)
        seg_a = a[i:end_a]
        seg_b = b[j:end_b]

        # Segments of different types: the numeric one is newer.
        if not seg_b:
            return 1 if numeric else -1

        if numeric:
            seg_a = seg_a.lstrip("0")
            seg_b = seg_b.lstrip("0")
            if len(seg_a) != len(seg_b):
                return 1 if len(seg_a) > len(seg_b) else -1

        if seg_a != seg_b:
            return 1 if seg_a > seg_b else -1

        i = end_a
        j = end_b

    rest_a = i < len(a)
    rest_b = j < len(b)
    if not rest_a and not rest_b:
        return 0
    # Whichever version still has characters left over wins.
    return 1 if rest_a else -1


def compare_evr(a: tuple[int, str, str], b: tuple[int, str, str]) -> int:
    """Compare (epoch, version, release) triples as rpm does."""
    if a[0] != b[0]:
        return 1 if a[0] > b[0] else -1
    rc = rpmvercmp(a[1], b[1])
    if rc:
        return rc
    return rpmvercmp(a[2], b[2])


evr_sort_key: Callable[[tuple[int, str, str]], Any] = functools.cmp_to_key(compare_evr)


def split_uname(uname: str) -> tuple[str, str]:
    """Split a kernel release string (``6.12.0-55.el10.x86_64``) into version and release.

    The release keeps the architecture suffix: kernels of one host share it, so it
    does not change the order.
    """
    version, sep, release = uname.partition("-")
    return (version, release if sep else "")


def compare_uname(a: str, b: str) -> int:
    """Compare two kernel release strings (``uname -r`` form) in rpm order."""
    va, ra = split_uname(a)
    vb, rb = split_uname(b)
    return compare_evr((0, va, ra), (0, vb, rb))


uname_sort_key: Callable[[str], Any] = functools.cmp_to_key(compare_uname)
