"""Prometheus text exposition (format 0.0.4), standard library only: the recorder's and the
ratchet's textfiles and the campaign's ``/metrics``. (The arbiter and the proxy expose
through ``prometheus_client``, :mod:`cardshare.exposition`.)

Per family its ``# HELP`` (``\\`` and newline escaped) and ``# TYPE`` once, then its samples,
families in the order given; label values escape ``\\``, ``"`` and newline; values are
integers as such, floats as their shortest round-trip decimal (or with fixed places) and
``+Inf``, ``-Inf``, ``NaN``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

__all__ = ["Sample", "escape_help", "escape_label", "number", "render"]

Sample = tuple[Mapping[str, str], float]  # labels, value
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float, places: int | None = None) -> str:
    """A sample value: ``places`` fixes the decimals of a finite value."""
    if isinstance(value, int) and places is None:
        return str(int(value))  # a bool too, as 0 or 1
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if places is None else f"{value:.{places}f}"


def _labels(labels: Mapping[str, str]) -> str:
    for key in labels:
        if not _LABEL.match(key) or key.startswith("__"):
            raise ValueError(f"bad label name {key!r}")
    pairs = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
    return "{" + pairs + "}" if pairs else ""


def render(
    families: Iterable[tuple[str, str, str]],
    samples: Mapping[str, Iterable[Sample]],
    places: Mapping[str, int] | None = None,
) -> str:
    """Per family ``(name, type, help)`` its HELP and TYPE lines, then its samples
    (``samples[name]``, none when absent); ``places[name]`` fixes a family's decimals."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, kind, help_text in families:
        if not _NAME.match(name) or name in seen:
            raise ValueError(f"bad or repeated metric family name {name!r}")
        seen.add(name)
        fixed = (places or {}).get(name)
        lines.append(f"# HELP {name} {escape_help(help_text)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(
            f"{name}{_labels(labels)} {number(value, fixed)}"
            for labels, value in samples.get(name, ())
        )
    return "\n".join(lines) + "\n"
