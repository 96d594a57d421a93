"""Prometheus text (format 0.0.4), standard library only: the recorder's and the ratchet's
textfiles and the campaign's ``/metrics`` (the arbiter and the proxy use prometheus_client)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

__all__ = ["Sample", "escape_help", "escape_label", "number", "render"]

Sample = tuple[Mapping[str, str], float]  # labels, value
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"(?!__)[a-zA-Z_][a-zA-Z0-9_]*\Z")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label(value: str) -> str:
    return escape_help(value).replace('"', '\\"')


def number(value: float, places: int | None = None) -> str:
    """A sample value: an int as such (a bool as 0 or 1), a float as its shortest round-trip
    decimal or with ``places`` decimals, +Inf, -Inf, NaN."""
    if isinstance(value, int) and places is None:
        return str(int(value))
    if math.isnan(value) or math.isinf(value):
        return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if places is None else f"{value:.{places}f}"


def _labels(labels: Mapping[str, str]) -> str:
    if bad := [key for key in labels if not _LABEL.match(key)]:
        raise ValueError(f"bad label name {bad[0]!r}")
    pairs = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
    return "{" + pairs + "}" if pairs else ""


def render(
    families: Iterable[tuple[str, str, str]],
    samples: Mapping[str, Iterable[Sample]],
    places: Mapping[str, int] | None = None,
) -> str:
    """Per family ``(name, type, help)``, in the order given, its HELP and TYPE lines once,
    then its ``samples[name]``; ``places[name]`` fixes the decimals of a family's values."""
    lines: list[str] = []
    seen: set[str] = set()
    for name, kind, help_text in families:
        if not _NAME.match(name) or name in seen:
            raise ValueError(f"bad or repeated metric family name {name!r}")
        seen.add(name)
        lines += [f"# HELP {name} {escape_help(help_text)}", f"# TYPE {name} {kind}"]
        fixed = (places or {}).get(name)
        lines += (f"{name}{_labels(ls)} {number(v, fixed)}" for ls, v in samples.get(name, ()))
    return "\n".join(lines) + "\n"
