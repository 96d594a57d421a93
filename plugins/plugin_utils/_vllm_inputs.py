# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Sizes and numbers as the ``vllm`` role reads them (the ``retrieval`` role reads its own
with them), and the errors that name the variable, the value and the fix (pure functions,
no I/O).

Sizes.  Every size is bytes, given as an integer or as a Docker-style string (``"16g"``,
``"16G"``, ``"16GiB"``, ``"0.8GiB"``, ``"800m"``).  As in Docker and Compose, every unit is
binary whatever its spelling: ``g``, ``gb`` and ``gib`` all mean 1024**3 bytes.  One grammar
for all sizes of the role keeps ``vllm_memory_limit`` meaning what Compose makes of it, and
a "32 GB" card is 32 GiB of memory.  Only the ratios matter for the utilisation, so the card,
the reservations and the headroom only need to be given in the same unit.

Numbers.  Every number of the role (the utilisation and its ceiling, the context target,
the ladder's floor, step and sequences, the port, a reservation's count) is read by
:func:`parse_number`, which takes a number or a string spelling one in decimal:
``-e vllm_context_target=65536`` gives the string ``"65536"``, which the role's argument spec
accepts for an ``int`` without converting it for the tasks that follow.  The string gives the
same result as the number; what does not spell a finite decimal number (``"lots"``, ``""``,
``"0x10"``, ``"nan"``, ``"1e400"``) is refused with a message naming the variable, the value
and the fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from typing import Literal, overload

__all__ = [
    "VllmTuningError",
    "VllmTypeError",
    "human_size",
    "parse_number",
    "parse_size",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3


# A number in decimal, as Python (and so Ansible's argument spec) reads it, ASCII only: an
# optional sign, digits ('_' between digits groups them), an optional fraction and exponent.
_DIGITS = r"[0-9](?:_?[0-9])*"
_NUMBER_RE = re.compile(
    rf"^[+-]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?{_DIGITS})?$"
)
_INTEGER_RE = re.compile(rf"^[+-]?{_DIGITS}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)|)(b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1024**4, "p": 1024**5}


class VllmTuningError(ValueError):
    """A value the role cannot use; the message names the variable, the value and the fix."""


class VllmTypeError(VllmTuningError, TypeError):
    """A value of the wrong type; the message names the variable and what it got."""


# --------------------------------------------------------------------------- sizes


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, Sequence):
        return "a list"
    return type(value).__name__


def parse_size(value: object, variable: str, *, allow_zero: bool = False) -> int:
    """Bytes from an integer or a Docker-style size string (all units binary).

    >>> parse_size("16g", "vllm_memory_limit") == 16 * 1024**3
    True
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise VllmTypeError(
            f"{variable}: expected a size in bytes or a string such as '16g' or '2GiB', "
            f"got {_type_name(value)} ({value!r})"
        )
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(value)
        if match is None:
            raise VllmTuningError(
                f"{variable}: cannot read {value!r} as a size; write bytes or a number with "
                "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'"
            )
        number, unit, _binary, _suffix = match.groups()
        try:
            amount = Decimal(number) * _UNITS[(unit or "").lower()]
        except InvalidOperation as err:  # pragma: no cover - the pattern admits only digits
            raise VllmTuningError(f"{variable}: cannot read {value!r} as a size") from err
        size = int(amount.to_integral_value(rounding=ROUND_FLOOR))
    if size < 0 or (size == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise VllmTuningError(f"{variable}: a size must be {bound} bytes, got {value!r}")
    return size


def _finite(number: int | float | Decimal) -> bool:
    """Whether ``number`` is finite and within the range of a float."""
    try:
        return math.isfinite(float(number))
    except OverflowError:  # an int beyond a float's range
        return False


@overload
def parse_number(
    value: object, variable: str, expected: str, example: str, *, whole: Literal[True]
) -> int: ...


@overload
def parse_number(
    value: object, variable: str, expected: str, example: str, *, whole: bool = False
) -> int | float: ...


def parse_number(
    value: object, variable: str, expected: str, example: str, *, whole: bool = False
) -> int | float:
    """A number, or a string spelling one in decimal, as the number it is.

    Values given on the command line (``-e vllm_context_target=65536``) are strings; the
    role's argument spec accepts them for its ``int`` and ``float`` options but leaves them
    strings.  A string gives the same number as the value written as a number: an integer
    when it has no fraction or exponent, a float otherwise, and with ``whole`` an integer
    (``"65536.0"`` and ``65536.0`` are 65536, as the spec reads them).  Surrounding blanks
    are ignored.  Refused, with a message naming ``variable``, the value, what is
    ``expected`` and an ``example``: booleans, null and other types, strings that do not
    spell a decimal number (``"lots"``, ``""``, ``"0x10"``, ``"nan"``, ``"inf"``), numbers
    that are not finite or beyond a float's range (``"1e400"``), and with ``whole`` numbers
    with a fraction.

    >>> parse_number("0.8", "vllm_gpu_memory_utilization", "a number", "0.85")
    0.8
    >>> parse_number("65536", "vllm_context_target", "a whole number", "65536", whole=True)
    65536
    """
    kind = "a whole number" if whole else "a decimal number"

    def refuse(got: str, error: type[VllmTuningError] = VllmTuningError) -> VllmTuningError:
        return error(f"{variable}: expected {expected}, got {got}; give {kind} such as {example}")

    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise refuse(f"{_type_name(value)} ({value!r})", VllmTypeError)
    if isinstance(value, str):
        text = value.strip()
        if not _NUMBER_RE.match(text):
            raise refuse(f"{value!r}, which is not a decimal number")
        exact = Decimal(text)
        if not _finite(exact):
            raise refuse(f"{value!r}, which is out of range")
        if whole and exact != exact.to_integral_value():
            raise refuse(f"{value!r}, which is not a whole number")
        return int(exact) if whole or _INTEGER_RE.match(text) else float(exact)
    if isinstance(value, float) and not math.isfinite(value):
        raise refuse(f"{value!r}, which is not a finite number")
    if not _finite(value):
        raise refuse(f"{value!r}, which is out of range")
    if whole and isinstance(value, float):
        if not value.is_integer():
            raise refuse(f"{value!r}, which is not a whole number")
        return int(value)
    return value


def human_size(size: int) -> str:
    """A short binary rendering for messages: ``8 GiB``, ``819.2 MiB``, ``512 B``."""
    for unit, factor in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(size) >= factor:
            text = f"{size / factor:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{size} B"


def _ceil_gib(size: int) -> int:
    return -(-size // GIB)
