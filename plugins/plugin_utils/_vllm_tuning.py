"""Computed and validated tuning values for the ``vllm`` role (pure functions, no I/O).

The values the source write-up tuned by hand are derived here from the card, its other
tenants and a model catalog entry, and refused with a message that names the role variable,
the bad value and the fix:

* ``--gpu-memory-utilization`` from the card's memory, the reservations of the card's other
  tenants and a driver headroom (:func:`gpu_memory_utilization`);
* the context window, with static YaRN passed through ``--hf-overrides`` when the target
  exceeds the model's native window, written so that it starts under vLLM's rules before and
  since vllm-project/vllm PR #56446 and carries the model's own RoPE settings in the key the
  image's transformers reads (:func:`vllm_context`, :func:`start_window`,
  :func:`image_transformers`);
* the container's host-memory cap (:func:`vllm_memory_cap`);
* per-model command-line rules: tool-call parser, MoE INT4 must be GPTQ, no
  ``--quantization`` for pre-quantised checkpoints (:func:`vllm_model_args`);
* the whole ordered ``vllm serve`` argument list (:func:`vllm_serve_args`, :func:`vllm_plan`);
* the ladder of plans the arbiter starts vLLM on: the full plan, then plans with a shorter
  context and less of the card down to ``vllm_context_floor`` (:func:`vllm_plan_ladder`).

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

import json
import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from fractions import Fraction
from itertools import chain
from typing import Literal, overload

__all__ = [
    "ACCEPTED_QUANTIZATIONS",
    "DEFAULT_RUNTIME_OVERHEAD_BYTES",
    "DEFAULT_UTILIZATION_CEILING",
    "ENTRYPOINT_MODES",
    "KNOWN_DTYPES",
    "KNOWN_IMAGE_TRANSFORMERS",
    "LADDER_SETTINGS_KEYS",
    "MANAGED_FLAGS",
    "MEMORY_MARGIN_MIN_BYTES",
    "MIN_CONTEXT_TOKENS",
    "ONLINE_QUANTIZATIONS",
    "SEED_MEMORY_LESSON",
    "SETTINGS_KEYS",
    "TRANSFORMERS_ROPE_KEYS",
    "VLLM_LENGTH_KEYS",
    "VLLM_START_RULES",
    "ModelSpec",
    "Reservation",
    "VllmTuningError",
    "VllmTypeError",
    "apply_overrides",
    "compose_command",
    "gpu_memory_utilization",
    "human_size",
    "image_transformers",
    "known_image_transformers",
    "model_spec",
    "parse_number",
    "parse_reservations",
    "parse_size",
    "required_host_memory",
    "resolve_model",
    "start_window",
    "vllm_context",
    "vllm_memory_cap",
    "vllm_model_args",
    "vllm_plan",
    "vllm_plan_ladder",
    "vllm_serve_args",
]

KIB = 1024
MIB = 1024**2
GIB = 1024**3

DEFAULT_UTILIZATION_CEILING = 0.95
# What vLLM holds on the card beyond the weights and the KV cache (activations, graphs,
# the sampler's buffers) when a catalog entry gives no runtime_overhead.  An ESTIMATE, not a
# measurement: it only sizes the smaller plans of the ladder (vllm_plan_ladder).
DEFAULT_RUNTIME_OVERHEAD_BYTES = GIB
# Host-memory margin over a model's need: 25 %, and never less than 2 GiB.
MEMORY_MARGIN_FRACTION = Fraction(1, 4)
MEMORY_MARGIN_MIN_BYTES = 2 * GIB
SEED_MEMORY_LESSON = (
    "Seed lesson: a compose 'memory: 8G' limit killed Qwen3-32B at 8.3 GB of RSS, a memory "
    "cgroup kill that looked like a VRAM problem (252 restarts); the cap went to 16G."
)

# Checkpoint formats: ``none`` is unquantised (BF16/FP16); the others are pre-quantised and
# vLLM detects them from the checkpoint's config, so ``--quantization`` is never passed.
ACCEPTED_QUANTIZATIONS: dict[str, frozenset[int]] = {
    "none": frozenset({16, 32}),
    "awq": frozenset({4}),
    "gptq": frozenset({4, 8}),
    "fp8": frozenset({8}),
}
# Quantisation at load time (llm-scaler's ``--quantization`` values for an unquantised
# checkpoint).  It first loads the full model into host memory.
ONLINE_QUANTIZATIONS = frozenset({"fp8", "sym_int4"})
# Tool-call parser by model family, used when an entry does not name one.
FAMILY_TOOL_CALL_PARSERS: dict[str, str] = {
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "qwen3-coder": "qwen3_coder",
}
KNOWN_DTYPES = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})
ENTRYPOINT_MODES = frozenset({"auto", "command", "entrypoint"})
# Flags the role computes; ``vllm_extra_args`` may not set them.
MANAGED_FLAGS: dict[str, str] = {
    "--model": "the model is chosen with vllm_model",
    "--served-model-name": "the served name comes from the catalog entry (served_name)",
    "--host": "set vllm_listen_address instead",
    "--port": "set vllm_port instead",
    "--gpu-memory-utilization": "set vllm_gpu_memory_utilization or the reservations instead",
    "--max-model-len": "set vllm_context_target instead",
    "--hf-overrides": "YaRN is computed from vllm_context_target",
    "--rope-scaling": "it was removed from vLLM; YaRN is computed from vllm_context_target",
    "--quantization": "set online_quantization in the catalog entry instead",
    "--enable-auto-tool-choice": "set vllm_enable_tool_calls instead",
    "--tool-call-parser": "set tool_call_parser in the catalog entry instead",
    "--dtype": "set vllm_dtype instead",
    "--tensor-parallel-size": "the pool's size: list its cards in xe_driver_card_jobs instead",
}
# The key of the RoPE dict in ``--hf-overrides`` by the major version of transformers in the
# image: transformers 4 reads ``rope_scaling`` (``rope_theta`` stays top-level and separate);
# 5 reads ``rope_parameters``, which holds ``rope_theta`` too (a ``rope_scaling`` override
# becomes ``rope_parameters`` without it).
TRANSFORMERS_ROPE_KEYS: dict[int, str] = {4: "rope_scaling", 5: "rope_parameters"}
# The transformers major version inside the images the role knows, by repository and tag.
# From intel/llm-scaler's vllm/docker/Dockerfile at each release's tag (vllm-<tag>): the
# 0.14.0-b8.3 releases build vLLM v0.14.0 and the 0.21.0 releases vLLM v0.21.0, and each then
# runs `pip install transformers==5.8.0` (0.14.0-b8.3 was the first to pin it; b8.1 and b8.2
# installed transformers from its main branch, b8 left vLLM's own pin: not listed, so they
# need vllm_image_transformers).  ASSUMPTION: the published image of a tag was built from the
# Dockerfile at that tag.  All of them set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which turns
# vLLM's refusal of a --max-model-len above the derived window into a warning; the role does
# not rely on it.
KNOWN_IMAGE_TRANSFORMERS: dict[str, dict[str, int]] = {
    "intel/llm-scaler-vllm": {
        "0.14.0-b8.3": 5,
        "0.14.0-b8.3.1": 5,
        "0.14.0-b8.3.2": 5,
        "0.21.0-b1": 5,
        "0.21.0-b2": 5,
    },
}
# The config keys vLLM derives a model's window from (the smallest wins), and the two rules
# for a YaRN RoPE dict (start_window): before vllm-project/vllm PR #56446 (September 2026;
# the llm-scaler images are vLLM 0.14 and 0.21) the window is original x factor; since it
# (upstream 0.32), max_position_embeddings.
VLLM_LENGTH_KEYS: tuple[str, ...] = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
VLLM_START_RULES: tuple[str, ...] = ("pre-56446", "post-56446")
# Lower bound of a sensible context: below this an agent's prompt does not fit at all.
MIN_CONTEXT_TOKENS = 256

# A number in decimal, as Python (and so Ansible's argument spec) reads it, ASCII only: an
# optional sign, digits ('_' between digits groups them), an optional fraction and exponent.
_DIGITS = r"[0-9](?:_?[0-9])*"
_NUMBER_RE = re.compile(
    rf"^[+-]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?{_DIGITS})?$"
)
_INTEGER_RE = re.compile(rf"^[+-]?{_DIGITS}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)|)(b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1024**4, "p": 1024**5}
_ENTRY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PARSER_RE = re.compile(r"^[a-z0-9_]+$")


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


# --------------------------------------------------------------------------- utilisation


@dataclass(frozen=True)
class Reservation:
    """Card memory another tenant needs: ``count`` uses of ``size`` bytes each."""

    name: str
    size: int
    count: int

    @property
    def total(self) -> int:
        return self.size * self.count


def parse_reservations(value: object, variable: str = "vllm_reservations") -> list[Reservation]:
    """Validate a list of ``{name, bytes, count}`` mappings (``count`` defaults to 1).

    A ``pdev`` key (the card the tenant is on, ``_vllm_pool``) is allowed and not read here.
    """
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise VllmTypeError(
            f"{variable}: expected a list of {{name, bytes, count}} mappings, "
            f"got {_type_name(value)}"
        )
    result: list[Reservation] = []
    for index, item in enumerate(value):
        where = f"{variable}[{index}]"
        if not isinstance(item, Mapping):
            raise VllmTypeError(
                f"{where}: expected a mapping with name, bytes and count, got {_type_name(item)}"
            )
        unknown = sorted(str(key) for key in item if key not in {"name", "bytes", "count", "pdev"})
        if unknown:
            raise VllmTuningError(
                f"{where}: unknown key(s) {', '.join(unknown)}; a reservation has name, bytes "
                "and count"
            )
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise VllmTuningError(f"{where}.name: give the tenant a name, got {name!r}")
        if "bytes" not in item:
            raise VllmTuningError(f"{where}.bytes: missing; give the size of one use, e.g. 2GiB")
        size = parse_size(item["bytes"], f"{where}.bytes", allow_zero=True)
        expected = "a whole number of uses (0 or more)"
        count = parse_number(item.get("count", 1), f"{where}.count", expected, "2", whole=True)
        if count < 0:
            raise VllmTuningError(f"{where}.count: expected {expected}, got {count!r}")
        result.append(Reservation(name=name, size=size, count=count))
    return result


def _check_ceiling(value: object) -> Fraction:
    ceiling = parse_number(value, "vllm_gpu_memory_utilization_max", "a number in (0, 1]", "0.95")
    if not 0 < ceiling <= 1:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization_max: {ceiling!r} is outside (0, 1]; "
            f"the default {DEFAULT_UTILIZATION_CEILING} leaves the driver some room"
        )
    return Fraction(str(ceiling))


def _check_override(value: object, ceiling: Fraction, ceiling_text: str) -> float:
    override = parse_number(
        value,
        "vllm_gpu_memory_utilization",
        f"null (computed) or a number in (0, {ceiling_text}]",
        "0.85",
    )
    if not 0 < Fraction(str(override)) <= ceiling:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: {override!r} is outside (0, {ceiling_text}]; set it "
            "to null to compute it from the card and its reservations, or to a share in range"
        )
    return float(override)


def gpu_memory_utilization(
    card_memory_bytes: object,
    reservations: object,
    driver_headroom_bytes: object,
    ceiling: object = DEFAULT_UTILIZATION_CEILING,
    override: object = None,
) -> float:
    """Share of the card vLLM may claim at start, rounded down to two decimals.

    ``(card - sum(reservations) - headroom) / card``; 32 GiB with two 2 GiB transcodes and
    0.8 GiB of headroom gives 0.85.  An ``override`` replaces the computation but is
    validated against the same range ``(0, ceiling]``.
    """
    ceiling_q = _check_ceiling(ceiling)
    ceiling_text = f"{float(ceiling_q):g}"
    card = parse_size(card_memory_bytes, "vllm_card_memory")
    tenants = parse_reservations(reservations)
    headroom = parse_size(driver_headroom_bytes, "vllm_driver_headroom", allow_zero=True)
    reserved = sum(item.total for item in tenants)
    if reserved > card:
        parts = ", ".join(f"{t.name} {t.count} x {human_size(t.size)}" for t in tenants)
        raise VllmTuningError(
            f"vllm_reservations: the reservations add up to {human_size(reserved)} ({parts}), "
            f"more than the card's {human_size(card)} (vllm_card_memory); lower the "
            "reservations or correct vllm_card_memory"
        )
    if override is not None:
        forced = _check_override(override, ceiling_q, ceiling_text)
        left = card - int(card * Fraction(str(forced)))
        if left < reserved:
            raise VllmTuningError(
                f"vllm_gpu_memory_utilization: {forced:g} of the card's {human_size(card)} "
                f"leaves {human_size(left)}, less than the {human_size(reserved)} of "
                "vllm_reservations; lower it, or set it to null to compute it"
            )
        return forced
    free = card - reserved - headroom
    hundredths = (100 * free) // card if free > 0 else 0
    share = Fraction(hundredths, 100)
    if share <= 0:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: the computed share {float(share):.2f} is outside "
            f"(0, {ceiling_text}]: the reservations ({human_size(reserved)}) and "
            f"vllm_driver_headroom ({human_size(headroom)}) leave "
            f"{human_size(max(free, 0))} of the card's {human_size(card)} for vLLM; lower "
            "vllm_reservations or vllm_driver_headroom"
        )
    if share > ceiling_q:
        raise VllmTuningError(
            f"vllm_gpu_memory_utilization: the computed share {float(share):.2f} is outside "
            f"(0, {ceiling_text}]: only {human_size(reserved + headroom)} of the card's "
            f"{human_size(card)} is kept for other tenants and the driver; raise "
            "vllm_driver_headroom or vllm_reservations, or raise "
            "vllm_gpu_memory_utilization_max if the card really has no other tenant"
        )
    return float(share)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """One validated model catalog entry."""

    name: str
    source: str
    hf_repo: str
    family: str | None
    native_context: int
    yarn_supported: bool
    yarn_max_factor: float | None
    moe: bool
    quantization: str
    bits: int
    online_quantization: str | None
    tool_call_parser: str | None
    host_memory_bytes: int
    weights_bytes: int | None
    kv_bytes_per_token: int | None
    runtime_overhead_bytes: int
    path: str
    served_name: str

    def as_dict(self) -> dict[str, object]:
        """The entry as plain data, for templates and the role's verify step."""
        return {
            "name": self.name,
            "hf_repo": self.hf_repo,
            "family": self.family,
            "native_context": self.native_context,
            "yarn_supported": self.yarn_supported,
            "yarn_max_factor": self.yarn_max_factor,
            "moe": self.moe,
            "quantization": self.quantization,
            "bits": self.bits,
            "online_quantization": self.online_quantization,
            "tool_call_parser": self.tool_call_parser,
            "host_memory": self.host_memory_bytes,
            "weights": self.weights_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "runtime_overhead": self.runtime_overhead_bytes,
            "path": self.path,
            "served_name": self.served_name,
        }


_ENTRY_FIELDS = frozenset(
    {
        "name",
        "hf_repo",
        "family",
        "native_context",
        "yarn_supported",
        "yarn_max_factor",
        "moe",
        "quantization",
        "bits",
        "online_quantization",
        "tool_call_parser",
        "host_memory",
        "weights",
        "kv_bytes_per_token",
        "runtime_overhead",
        "path",
        "served_name",
        "notes",
    }
)
_REQUIRED_FIELDS = (
    "hf_repo",
    "native_context",
    "yarn_supported",
    "moe",
    "quantization",
    "bits",
    "host_memory",
)


def _entry_str(
    entry: Mapping[str, object], key: str, where: str, default: str | None
) -> str | None:
    value = entry.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise VllmTypeError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def _entry_bool(entry: Mapping[str, object], key: str, where: str) -> bool:
    value = entry[key]
    if not isinstance(value, bool):
        raise VllmTypeError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _entry_int(entry: Mapping[str, object], key: str, where: str) -> int:
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VllmTypeError(f"{where}.{key}: expected a positive whole number, got {value!r}")
    return value


def model_spec(name: object, entry: object, source: str | None = None) -> ModelSpec:
    """Validate one catalog entry; ``source`` names where it came from in messages."""
    if not isinstance(name, str) or not _ENTRY_NAME_RE.match(name):
        raise VllmTuningError(
            f"vllm_model: {name!r} is not a usable model name; use letters, digits, '.', '_' "
            "and '-', e.g. Qwen2.5-7B-Instruct"
        )
    where = source or f"vllm_model_catalog[{name!r}]"
    if not isinstance(entry, Mapping):
        raise VllmTypeError(f"{where}: expected a mapping of model facts, got {_type_name(entry)}")
    unknown = sorted(str(key) for key in entry if key not in _ENTRY_FIELDS)
    if unknown:
        raise VllmTuningError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known fields are "
            f"{', '.join(sorted(_ENTRY_FIELDS))}"
        )
    missing = [key for key in _REQUIRED_FIELDS if entry.get(key) is None]
    if missing:
        raise VllmTuningError(f"{where}: missing field(s) {', '.join(missing)}")

    hf_repo = _entry_str(entry, "hf_repo", where, None)
    if hf_repo is None:  # required above; kept for the type checker without an assert
        raise VllmTuningError(f"{where}: missing field(s) hf_repo")
    family = _entry_str(entry, "family", where, None)
    native = _entry_int(entry, "native_context", where)
    yarn = _entry_bool(entry, "yarn_supported", where)
    moe = _entry_bool(entry, "moe", where)
    bits = _entry_int(entry, "bits", where)

    max_factor_raw = entry.get("yarn_max_factor")
    max_factor: float | None = None
    if max_factor_raw is not None:
        if isinstance(max_factor_raw, bool) or not isinstance(max_factor_raw, int | float):
            raise VllmTypeError(
                f"{where}.yarn_max_factor: expected a number above 1 or null, "
                f"got {max_factor_raw!r}"
            )
        if max_factor_raw <= 1:
            raise VllmTuningError(
                f"{where}.yarn_max_factor: {max_factor_raw!r} must be above 1 (or null for "
                "no documented limit)"
            )
        if not yarn:
            raise VllmTuningError(
                f"{where}.yarn_max_factor: set only for a model with yarn_supported: true"
            )
        max_factor = float(max_factor_raw)

    quant = entry["quantization"]
    if not isinstance(quant, str) or quant not in ACCEPTED_QUANTIZATIONS:
        raise VllmTuningError(
            f"{where}.quantization: {quant!r} is not one of "
            f"{', '.join(sorted(ACCEPTED_QUANTIZATIONS))}"
        )
    if bits not in ACCEPTED_QUANTIZATIONS[quant]:
        allowed = " or ".join(str(b) for b in sorted(ACCEPTED_QUANTIZATIONS[quant]))
        raise VllmTuningError(
            f"{where}.bits: {bits} does not match quantization {quant} (expected {allowed})"
        )
    if moe and bits == 4 and quant != "gptq":
        raise VllmTuningError(
            f"{where}: an MoE checkpoint quantised to INT4 must be GPTQ for the llm-scaler "
            f"image (only GPTQ checkpoints get a quantised method for the MoE layers), got "
            f"{quant}; use a GPTQ-Int4 checkpoint of {name}"
        )
    online = _entry_str(entry, "online_quantization", where, None)
    if online is not None:
        if online not in ONLINE_QUANTIZATIONS:
            raise VllmTuningError(
                f"{where}.online_quantization: {online!r} is not one of "
                f"{', '.join(sorted(ONLINE_QUANTIZATIONS))} (or null)"
            )
        if quant != "none":
            raise VllmTuningError(
                f"{where}.online_quantization: {quant} is a pre-quantised checkpoint that vLLM "
                "detects from its config; do not pass --quantization for it (set "
                "online_quantization: null)"
            )

    default_parser = FAMILY_TOOL_CALL_PARSERS.get(family.lower()) if family else None
    parser = _entry_str(entry, "tool_call_parser", where, default_parser)
    if parser is not None and not _PARSER_RE.match(parser):
        raise VllmTuningError(
            f"{where}.tool_call_parser: {parser!r} is not a vLLM parser name (e.g. hermes, "
            "qwen3_coder)"
        )

    host_memory = parse_size(entry["host_memory"], f"{where}.host_memory")
    weights_raw = entry.get("weights")
    weights = None if weights_raw is None else parse_size(weights_raw, f"{where}.weights")
    kv_raw = entry.get("kv_bytes_per_token")
    kv_per_token = None if kv_raw is None else parse_size(kv_raw, f"{where}.kv_bytes_per_token")
    overhead_raw = entry.get("runtime_overhead")
    overhead = (
        DEFAULT_RUNTIME_OVERHEAD_BYTES
        if overhead_raw is None
        else parse_size(overhead_raw, f"{where}.runtime_overhead")
    )
    path = _entry_str(entry, "path", where, hf_repo.rstrip("/").rsplit("/", 1)[-1])
    served = _entry_str(entry, "served_name", where, name)
    if path is None or served is None:  # both have defaults; kept for the type checker
        raise VllmTuningError(f"{where}: path and served_name must be strings")
    if path.startswith("/") or ".." in path.split("/"):
        raise VllmTuningError(
            f"{where}.path: {path!r} must be relative to the container's model root "
            "(vllm_container_model_root), without '..'"
        )
    return ModelSpec(
        name=name,
        source=where,
        hf_repo=hf_repo,
        family=family,
        native_context=native,
        yarn_supported=yarn,
        yarn_max_factor=max_factor,
        moe=moe,
        quantization=quant,
        bits=bits,
        online_quantization=online,
        tool_call_parser=parser,
        host_memory_bytes=host_memory,
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        runtime_overhead_bytes=overhead,
        path=path,
        served_name=served,
    )


def _as_spec(model: object) -> ModelSpec:
    """Accept a :class:`ModelSpec` or a catalog entry mapping carrying its ``name``."""
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, Mapping):
        raise VllmTypeError(
            f"model: expected a catalog entry (a mapping, e.g. from vllm_model_entry), "
            f"got {_type_name(model)}"
        )
    name = model.get("name")
    return model_spec(name, model, f"model {name!r}")


def resolve_model(name: object, catalog: object, extra: object = None) -> ModelSpec:
    """Look ``name`` up in ``catalog`` with ``extra`` merged over it, field by field."""
    for variable, value in (("vllm_model_catalog", catalog), ("vllm_model_catalog_extra", extra)):
        if value is not None and not isinstance(value, Mapping):
            raise VllmTypeError(
                f"{variable}: expected a mapping of model name to entry, got {_type_name(value)}"
            )
    base: Mapping[str, object] = catalog if isinstance(catalog, Mapping) else {}
    more: Mapping[str, object] = extra if isinstance(extra, Mapping) else {}
    if not isinstance(name, str):
        raise VllmTypeError(f"vllm_model: expected a catalog key, got {_type_name(name)}")
    if name not in base and name not in more:
        known = ", ".join(sorted({*map(str, base), *map(str, more)})) or "none"
        raise VllmTuningError(
            f"vllm_model: {name!r} is not in vllm_model_catalog or vllm_model_catalog_extra "
            f"(known: {known}); pick one of those or add an entry to vllm_model_catalog_extra"
        )
    merged: dict[str, object] = {}
    for layer, variable in ((base, "vllm_model_catalog"), (more, "vllm_model_catalog_extra")):
        entry = layer.get(name)
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise VllmTypeError(
                f"{variable}[{name!r}]: expected a mapping of model facts, got {_type_name(entry)}"
            )
        merged.update({str(key): value for key, value in entry.items()})
    source = (
        f"vllm_model_catalog_extra[{name!r}]" if name in more else f"vllm_model_catalog[{name!r}]"
    )
    merged.pop("name", None)
    return model_spec(name, merged, source)


# --------------------------------------------------------------------------- context


def _check_target(value: object) -> int:
    target_len = parse_number(
        value, "vllm_context_target", "a whole number of tokens", "65536", whole=True
    )
    if target_len < MIN_CONTEXT_TOKENS:
        raise VllmTuningError(
            f"vllm_context_target: {target_len} tokens is below the minimum "
            f"{MIN_CONTEXT_TOKENS}; agents send about 16k tokens of prompt and tool schemas, "
            "so 32768 or more is sensible"
        )
    return target_len


def yarn_factor(target_len: int, native: int) -> float:
    """Smallest factor, in hundredths, whose window ``native * factor`` reaches the target."""
    hundredths = math.ceil(Fraction(100 * target_len, native))
    while int(native * (hundredths / 100)) < target_len:  # guard float rounding
        hundredths += 1
    return hundredths / 100


# --------------------------------------------------------------------------- images


def _image_name_and_tag(image: str) -> tuple[str, str]:
    """The repository (without a ``docker.io/`` prefix) and tag of an image reference."""
    reference = image.strip().split("@", 1)[0]
    slash = reference.rfind("/")
    colon = reference.rfind(":")
    name, tag = (reference[:colon], reference[colon + 1 :]) if colon > slash else (reference, "")
    for prefix in ("docker.io/", "index.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name, tag


def known_image_transformers(image: object) -> int | None:
    """The transformers major version of an image the role knows (KNOWN_IMAGE_TRANSFORMERS)."""
    if not isinstance(image, str):
        return None
    name, tag = _image_name_and_tag(image)
    return KNOWN_IMAGE_TRANSFORMERS.get(name, {}).get(tag)


def _known_images_text() -> str:
    return "; ".join(
        f"{name} {', '.join(tags)}: transformers {major}"
        for name, by_tag in KNOWN_IMAGE_TRANSFORMERS.items()
        for major in sorted(set(by_tag.values()))
        for tags in [[tag for tag, value in by_tag.items() if value == major]]
    )


def _check_transformers(value: object) -> int | None:
    """``vllm_image_transformers``: null, or the major version 4 or 5."""
    if value is None:
        return None
    expected = "null or the major version of transformers in vllm_image, 4 or 5"
    major = parse_number(value, "vllm_image_transformers", expected, "5", whole=True)
    if major not in TRANSFORMERS_ROPE_KEYS:
        raise VllmTuningError(f"vllm_image_transformers: expected {expected}, got {major!r}")
    return major


def image_transformers(image: object, declared: object = None) -> int:
    """The transformers major version of ``image``: ``declared`` when set, else the catalogue.

    The key YaRN's ``--hf-overrides`` is written in depends on it (transformers 4 reads
    ``rope_scaling`` beside a top-level ``rope_theta``; 5 reads ``rope_parameters``, which
    holds ``rope_theta`` too).  An image the role does not know is refused until
    ``vllm_image_transformers`` says which.
    """
    major = _check_transformers(declared)
    if major is not None:
        return major
    known = known_image_transformers(image)
    if known is not None:
        return known
    raise VllmTuningError(
        f"vllm_image_transformers: null, and the role does not know which transformers the "
        f"image {image!r} (vllm_image) has (it knows {_known_images_text()}); YaRN's "
        "--hf-overrides is written in the key that version reads (4: rope_scaling beside "
        "rope_theta, 5: rope_parameters holding rope_theta), so set vllm_image_transformers to "
        "4 or 5, the major version `python3 -c 'import transformers; "
        "print(transformers.__version__)'` prints inside the image"
    )


# --------------------------------------------------------------------------- model config


@dataclass(frozen=True)
class _ModelRope:
    """What the role carries from a model's config.json into a YaRN override."""

    config: Mapping[str, object] | None
    theta: int | float | None
    carried: Mapping[str, object]


# Keys of the model's own RoPE dict the override sets itself: YaRN's own parameters (the
# attention factor is derived from the factor) and the base.
_YARN_OWN_KEYS = frozenset(
    {"rope_type", "type", "factor", "original_max_position_embeddings", "attention_factor"}
)


def _number(value: object) -> float | None:
    """``value`` as a float when it is a positive finite number (not a boolean), else None."""
    if _positive_number(value) and isinstance(value, int | float):
        return float(value)
    return None


def _positive_number(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and _finite(value)
        and value > 0
    )


def _model_rope(spec: ModelSpec, config: Mapping[str, object] | None) -> _ModelRope:
    """The RoPE base and the other RoPE settings of ``spec``'s config.json (or nothing)."""
    where = f"vllm_model: {spec.name}'s config.json (under vllm_model_dir)"
    if config is None:
        return _ModelRope(None, None, {})
    rope_raw = config.get("rope_parameters")
    source = "rope_parameters"
    if rope_raw is None:
        rope_raw, source = config.get("rope_scaling"), "rope_scaling"
    if rope_raw is not None and not isinstance(rope_raw, Mapping):
        raise VllmTuningError(
            f"{where}: {source} is {_type_name(rope_raw)} ({rope_raw!r}), not a mapping; "
            "download the model's files again"
        )
    rope: Mapping[str, object] = rope_raw if isinstance(rope_raw, Mapping) else {}
    if any(isinstance(value, Mapping) for value in rope.values()):
        raise VllmTuningError(
            f"{where}: {source} holds RoPE settings per layer type "
            f"({', '.join(sorted(map(str, rope)))}); the role cannot turn YaRN on over them: "
            f"lower vllm_context_target to {spec.native_context} or less"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise VllmTuningError(
            f"{where}: {source} already scales RoPE (rope_type {rope_type!r}); YaRN over it is "
            f"not defined: lower vllm_context_target to {spec.native_context} or less"
        )

    thetas = {
        name: value
        for name, value in (
            ("rope_theta", config.get("rope_theta")),
            (f"{source}.rope_theta", rope.get("rope_theta")),
        )
        if value is not None
    }
    for name, value in thetas.items():
        if not _positive_number(value):
            raise VllmTuningError(
                f"{where}: {name} is {value!r}, not a positive number; download the model's "
                "files again"
            )
    if len(set(thetas.values())) > 1:
        shown = " and ".join(f"{name} {value!r}" for name, value in thetas.items())
        raise VllmTuningError(
            f"{where}: {shown} disagree; the role cannot tell the model's RoPE base: correct "
            "config.json"
        )
    theta = next(iter(thetas.values()), None)
    carried = {
        str(key): value
        for key, value in rope.items()
        if key not in _YARN_OWN_KEYS and key != "rope_theta"
    }
    return _ModelRope(config, theta if isinstance(theta, int | float) else None, carried)


# --------------------------------------------------------------------------- start rules


def _rope_of(config: Mapping[str, object], major: int | None) -> Mapping[str, object] | None:
    """The RoPE dict vLLM reads from a (merged) config under transformers ``major``."""
    keys = ("rope_scaling",) if major == 4 else ("rope_parameters", "rope_scaling")
    for key in keys:
        value = config.get(key)
        if isinstance(value, Mapping):
            return value
    return None


def apply_overrides(
    config: Mapping[str, object], overrides: Mapping[str, object], major: int | None = None
) -> dict[str, object]:
    """``config`` with ``--hf-overrides`` applied as vLLM applies them (``config.update``).

    Each top-level key is replaced whole.  Under transformers 5 ``rope_scaling`` is another
    name of ``rope_parameters``: either key of the override replaces the model's RoPE dict.
    """
    merged = dict(config)
    for key, value in overrides.items():
        if major == 5 and key in ("rope_scaling", "rope_parameters"):
            merged.pop("rope_scaling", None)
            merged["rope_parameters"] = value
        else:
            merged[key] = value
    return merged


def start_window(
    config: Mapping[str, object], rules: str, major: int | None = None
) -> tuple[float, str]:
    """The longest ``--max-model-len`` vLLM starts with on ``config`` (config.json with the
    ``--hf-overrides`` applied), and what it was derived from.

    As vLLM's ``_get_and_verify_max_len``: the smallest of the length keys the config sets
    (VLLM_LENGTH_KEYS); then a RoPE scaling other than ``su``, ``longrope`` and ``llama3``
    multiplies it by its ``factor``, except YaRN, for which the rules differ:

    * ``pre-56446`` (vLLM before PR #56446: the llm-scaler 0.14 and 0.21 images): the window
      is ``original_max_position_embeddings x factor``;
    * ``post-56446`` (since PR #56446, upstream 0.32): YaRN no longer re-scales it.

    ``(inf, "no length key")`` when the config sets none (vLLM then takes the given length).
    """
    if rules not in VLLM_START_RULES:
        raise VllmTuningError(f"rules: {rules!r} is not one of {', '.join(VLLM_START_RULES)}")
    lengths = [(key, length) for key in VLLM_LENGTH_KEYS if (length := _number(config.get(key)))]
    if not lengths:
        return math.inf, "no length key"
    key, window = min(lengths, key=lambda item: item[1])
    why = f"{key}={window:g}"
    rope = _rope_of(config, major)
    if rope is None or any(isinstance(value, Mapping) for value in rope.values()):
        return window, why
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = _number(rope.get("factor", 1.0))
    if rope_type in ("su", "longrope", "llama3") or factor is None:
        return window, why
    if rope_type != "yarn":
        return window * factor, f"{why} x factor {factor:g}"
    if rules == "post-56446":
        return window, why
    base = _number(rope.get("original_max_position_embeddings")) or window
    return base * factor, f"original_max_position_embeddings={base:g} x factor {factor:g}"


_RULES_TEXT = {
    "pre-56446": "before vllm-project/vllm PR #56446 (the llm-scaler 0.14 and 0.21 images)",
    "post-56446": "since vllm-project/vllm PR #56446 (upstream 0.32)",
}


def _parse_model_config(spec: ModelSpec, config: object) -> Mapping[str, object] | None:
    """The model's config.json as a mapping (given as JSON text or parsed), or None."""
    if config is None:
        return None
    where = f"vllm_model: {spec.name}'s config.json (under vllm_model_dir)"
    if isinstance(config, str | bytes):
        try:
            config = json.loads(config)
        except ValueError as err:
            raise VllmTuningError(
                f"{where} is not JSON ({err}); download the model's files again"
            ) from err
    if not isinstance(config, Mapping):
        raise VllmTypeError(f"{where}: expected a JSON object, got {_type_name(config)}")
    return config


def _windows(
    spec: ModelSpec,
    config: Mapping[str, object],
    major: int | None,
    target: int,
    yarn: bool,
) -> dict[str, int | None]:
    """Each start rule's window for ``config``; refuses a ``target`` a rule would refuse."""
    windows: dict[str, int | None] = {}
    for rules in VLLM_START_RULES:
        window, why = start_window(config, rules, major)
        if target > window:
            if not yarn:
                raise VllmTuningError(
                    f"{spec.source}.native_context: {spec.native_context} is above the window "
                    f"vLLM derives from {spec.name}'s config.json ({why}): a plan of {target} "
                    f"tokens without YaRN would be refused at start by vLLM {_RULES_TEXT[rules]}; "
                    f"set native_context to {int(window)}, or lower vllm_context_target to "
                    f"{int(window)} or less"
                )
            raise VllmTuningError(
                f"vllm_context_target: {target} tokens with YaRN would be refused at start by "
                f"vLLM {_RULES_TEXT[rules]}: it derives {window:g} from {spec.name}'s "
                f"config.json with the override ({why}), and the override sets "
                f"max_position_embeddings only; lower vllm_context_target to {int(window)} or less"
            )
        windows[rules] = None if math.isinf(window) else int(window)
    return windows


def vllm_context(
    model: object,
    target_len: object,
    image: object = None,
    transformers: object = None,
    model_config: object = None,
) -> dict[str, object]:
    """Context settings for ``target_len`` tokens on ``model``.

    Above the model's native window, static YaRN with the smallest factor (in hundredths)
    that reaches the target, as ``--hf-overrides`` that starts under both of vLLM's rules
    (:func:`start_window`): it carries ``"max_position_embeddings": <target>`` beside the
    RoPE dict, whose key is the one the image's transformers reads (``image`` and
    ``transformers``, see :func:`image_transformers`):

    * transformers 4: ``{"rope_scaling": {yarn...}, "rope_theta": <base>,
      "max_position_embeddings": <target>}``;
    * transformers 5: ``{"rope_parameters": {yarn..., "rope_theta": <base>},
      "max_position_embeddings": <target>}``.

    The override replaces the model's RoPE dict whole, so the model's own settings are
    carried from ``model_config`` (its config.json, text or parsed): ``rope_theta`` and the
    keys of its RoPE dict other than YaRN's own.  Under transformers 5 the base is required.

    Returns ``max_model_len``, ``yarn_factor``, ``rope_scaling`` (the YaRN dict, under
    ``rope_key`` in the override), ``rope_key``, ``rope_theta`` (carried, or None),
    ``hf_overrides`` (the JSON, or None without YaRN) and ``start_windows`` (each rule's
    longest ``--max-model-len``, None when unbounded).
    """
    spec = _as_spec(model)
    target = _check_target(target_len)
    declared = _check_transformers(transformers)
    config = _parse_model_config(spec, model_config)
    native = spec.native_context
    base: Mapping[str, object] = (
        config if config is not None else {"max_position_embeddings": native}
    )
    if target <= native:
        major = declared if declared is not None else known_image_transformers(image)
        return {
            "max_model_len": target,
            "yarn_factor": None,
            "rope_scaling": None,
            "rope_key": None,
            "rope_theta": None,
            "hf_overrides": None,
            "start_windows": _windows(spec, base, major, target, yarn=False),
        }
    if not spec.yarn_supported:
        raise VllmTuningError(
            f"vllm_context_target: {target} tokens exceeds the native window of {spec.name} "
            f"({native}) and the model does not support YaRN; lower vllm_context_target to "
            f"{native} or less, or pick a model with yarn_supported: true"
        )
    factor = yarn_factor(target, native)
    if spec.yarn_max_factor is not None and factor > spec.yarn_max_factor:
        reachable = int(native * spec.yarn_max_factor)
        raise VllmTuningError(
            f"vllm_context_target: {target} tokens needs a YaRN factor of {factor:g} over "
            f"{spec.name}'s native {native}, above the model's maximum "
            f"{spec.yarn_max_factor:g}; lower vllm_context_target to {reachable} or less"
        )
    major = image_transformers(image, declared)
    own = _model_rope(spec, config)
    key = TRANSFORMERS_ROPE_KEYS[major]
    rope: dict[str, object] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": native,
    }
    overrides: dict[str, object]
    if major == 5:
        if own.theta is None:
            found = (
                f"{spec.name}'s config.json gives no rope_theta (vLLM would take a default): "
                "add the model's rope_theta to its config.json"
                if config is not None
                else f"the role found no config.json of {spec.name} (it reads "
                f"<vllm_model_dir>/{spec.path}/config.json): download the model first"
            )
            raise VllmTuningError(
                f"vllm_context_target: {target} tokens needs YaRN over {spec.name}'s native "
                f"{native}; under transformers 5 (vllm_image_transformers, or known from "
                "vllm_image) the override replaces the model's RoPE settings whole, rope_theta "
                f"included, so the role carries them from the model's config.json, but {found}, "
                f"or lower vllm_context_target to {native} or less"
            )
        rope["rope_theta"] = own.theta
        rope.update(own.carried)
        overrides = {key: rope, "max_position_embeddings": target}
    else:
        rope.update(own.carried)
        overrides = {key: rope}
        if own.theta is not None:
            overrides["rope_theta"] = own.theta
        overrides["max_position_embeddings"] = target
    windows = _windows(spec, apply_overrides(base, overrides, major), major, target, yarn=True)
    return {
        "max_model_len": target,
        "yarn_factor": factor,
        "rope_scaling": rope,
        "rope_key": key,
        "rope_theta": own.theta,
        "hf_overrides": json.dumps(overrides, separators=(",", ":")),
        "start_windows": windows,
    }


# --------------------------------------------------------------------------- host memory


def required_host_memory(model: object) -> int:
    """The model's host-memory need plus 25 %, and at least 2 GiB more."""
    need = _as_spec(model).host_memory_bytes
    margin = max(math.ceil(need * MEMORY_MARGIN_FRACTION), MEMORY_MARGIN_MIN_BYTES)
    return need + margin


def vllm_memory_cap(model: object, cap: object) -> int:
    """Validate the container's memory cap (bytes or a Docker size) for ``model``; bytes."""
    spec = _as_spec(model)
    limit = parse_size(cap, "vllm_memory_limit")
    required = required_host_memory(spec)
    if limit < required:
        raise VllmTuningError(
            f"vllm_memory_limit: {human_size(limit)} is below what {spec.name} needs on the "
            f"host: about {human_size(spec.host_memory_bytes)} plus a margin of 25% (at least "
            f"2 GiB) makes {human_size(required)}; raise vllm_memory_limit to "
            f"'{_ceil_gib(required)}g' or more. {SEED_MEMORY_LESSON}"
        )
    return limit


# --------------------------------------------------------------------------- model args


def vllm_model_args(model: object, enable_tool_calls: object = True) -> list[str]:
    """Command-line arguments a model needs: online quantisation and tool calls."""
    spec = _as_spec(model)
    if not isinstance(enable_tool_calls, bool):
        raise VllmTypeError(
            f"vllm_enable_tool_calls: expected true or false, got {enable_tool_calls!r}"
        )
    args: list[str] = []
    if spec.online_quantization is not None:
        args += ["--quantization", spec.online_quantization]
    if enable_tool_calls:
        if spec.tool_call_parser is None:
            raise VllmTuningError(
                f"vllm_model: {spec.name} has no tool_call_parser (and no family with a known "
                "one); set tool_call_parser in its catalog entry (vllm_model_catalog_extra), "
                "or set vllm_enable_tool_calls: false"
            )
        args += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    return args


# --------------------------------------------------------------------------- the whole line

# The role's variables the plan is computed from.  Besides them, the settings may hold
# ``vllm_model_config``: the model's config.json as the role read it on the host (its text, or
# parsed), or null when it found none; YaRN's override carries the model's RoPE settings from it.
SETTINGS_KEYS: tuple[str, ...] = (
    "vllm_model",
    "vllm_model_catalog",
    "vllm_model_catalog_extra",
    "vllm_card_memory",
    "vllm_reservations",
    "vllm_driver_headroom",
    "vllm_gpu_memory_utilization",
    "vllm_gpu_memory_utilization_max",
    "vllm_context_target",
    "vllm_memory_limit",
    "vllm_listen_address",
    "vllm_port",
    "vllm_container_model_root",
    "vllm_dtype",
    "vllm_enable_tool_calls",
    "vllm_extra_args",
    "vllm_image",
    "vllm_image_transformers",
)
# What the ladder needs besides SETTINGS_KEYS (vllm_plan_ladder).
LADDER_SETTINGS_KEYS: tuple[str, ...] = (
    "vllm_context_floor",
    "vllm_context_step",
    "vllm_ladder_sequences",
)


def _check_settings(settings: object, keys: Sequence[str] = SETTINGS_KEYS) -> Mapping[str, object]:
    if not isinstance(settings, Mapping):
        raise VllmTypeError(
            f"settings: expected a mapping of the vllm role's variables, got {_type_name(settings)}"
        )
    missing = [key for key in keys if key not in settings]
    if missing:
        raise VllmTuningError(
            f"settings: missing {', '.join(missing)}; pass every variable the role defines "
            "in its defaults"
        )
    return settings


def _check_port(value: object) -> int:
    expected = "a TCP port 1-65535"
    port = parse_number(value, "vllm_port", expected, "8000", whole=True)
    if not 1 <= port <= 65535:
        raise VllmTuningError(f"vllm_port: expected {expected}, got {port!r}")
    return port


def _check_nonempty(value: object, variable: str, example: str) -> str:
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise VllmTuningError(
            f"{variable}: expected a non-empty string without spaces (e.g. {example}), "
            f"got {value!r}"
        )
    return value


def _check_dtype(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in KNOWN_DTYPES:
        raise VllmTuningError(
            f"vllm_dtype: {value!r} is not one of {', '.join(sorted(KNOWN_DTYPES))} "
            "(or null to let vLLM choose)"
        )
    return value


def _check_extra_args(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise VllmTypeError(
            f"vllm_extra_args: expected a list of strings (one argument each), "
            f"got {_type_name(value)}"
        )
    result: list[str] = []
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise VllmTypeError(
                f"vllm_extra_args[{index}]: expected a string, got {_type_name(item)}"
            )
        text = str(item)
        flag = text.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise VllmTuningError(
                f"vllm_extra_args[{index}]: {flag} is computed by the role; {MANAGED_FLAGS[flag]}"
            )
        result.append(text)
    return result


def _build_plan(
    conf: Mapping[str, object],
    spec: ModelSpec,
    card: int,
    utilization: float,
    target_len: object,
) -> dict[str, object]:
    """One plan: ``spec`` on ``utilization`` of ``card`` bytes with a ``target_len`` context.

    The full plan and every rung of the ladder are built here, so each is a complete and
    validated argument list (the weights against the share, the YaRN factor against the
    model's maximum, the memory cap, the address, the tool-call parser, the extra args).
    """
    if spec.weights_bytes is not None:
        share = int(card * Fraction(str(utilization)))
        if spec.weights_bytes >= share:
            raise VllmTuningError(
                f"vllm_model: the weights of {spec.name} (about "
                f"{human_size(spec.weights_bytes)}) do not fit the {human_size(share)} vLLM "
                f"may claim ({utilization:.2f} of {human_size(card)}), leaving nothing for "
                "the KV cache; pick a smaller or quantised model, or lower vllm_reservations"
            )
    # the settings' own checks first, then the context, which also reads the host's config.json
    memory_limit = vllm_memory_cap(spec, conf["vllm_memory_limit"])
    context = vllm_context(
        spec,
        target_len,
        conf["vllm_image"],
        conf["vllm_image_transformers"],
        conf.get("vllm_model_config"),
    )
    host = _check_nonempty(conf["vllm_listen_address"], "vllm_listen_address", "0.0.0.0")
    port = _check_port(conf["vllm_port"])
    root = _check_nonempty(
        conf["vllm_container_model_root"], "vllm_container_model_root", "/llm/models"
    )
    if not root.startswith("/"):
        raise VllmTuningError(
            f"vllm_container_model_root: expected an absolute path inside the container "
            f"(e.g. /llm/models), got {root!r}"
        )
    dtype = _check_dtype(conf["vllm_dtype"])
    model_args = vllm_model_args(spec, conf["vllm_enable_tool_calls"])
    extra = _check_extra_args(conf["vllm_extra_args"])

    args = [
        f"{root.rstrip('/')}/{spec.path}",
        "--served-model-name",
        spec.served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--gpu-memory-utilization",
        f"{utilization:.2f}",
        "--max-model-len",
        str(context["max_model_len"]),
    ]
    if context["hf_overrides"] is not None:
        args += ["--hf-overrides", str(context["hf_overrides"])]
    args += model_args
    if dtype is not None:
        args += ["--dtype", dtype]
    args += extra
    return {
        "args": args,
        "gpu_memory_utilization": utilization,
        "context": context,
        "memory_limit_bytes": memory_limit,
        "model": spec.as_dict(),
    }


def _full_plan(
    conf: Mapping[str, object],
) -> tuple[dict[str, object], ModelSpec, int, float]:
    """The full plan of checked settings, with the model, the card's bytes and the share."""
    spec = resolve_model(
        conf["vllm_model"], conf["vllm_model_catalog"], conf["vllm_model_catalog_extra"]
    )
    utilization = gpu_memory_utilization(
        conf["vllm_card_memory"],
        conf["vllm_reservations"],
        conf["vllm_driver_headroom"],
        ceiling=conf["vllm_gpu_memory_utilization_max"],
        override=conf["vllm_gpu_memory_utilization"],
    )
    card = parse_size(conf["vllm_card_memory"], "vllm_card_memory")
    plan = _build_plan(conf, spec, card, utilization, conf["vllm_context_target"])
    return plan, spec, card, utilization


def vllm_plan(settings: object) -> dict[str, object]:
    """Validate the role's settings and compute everything the role renders and verifies.

    Returns ``args`` (the ordered argument list after ``vllm serve``),
    ``gpu_memory_utilization``, ``context`` (see :func:`vllm_context`),
    ``memory_limit_bytes`` and ``model`` (the resolved catalog entry).
    """
    plan, _spec, _card, _utilization = _full_plan(_check_settings(settings))
    return plan


# --------------------------------------------------------------------------- the ladder


def _check_floor(value: object, target: int) -> int:
    floor = parse_number(
        value, "vllm_context_floor", "a whole number of tokens", "32768", whole=True
    )
    if floor < MIN_CONTEXT_TOKENS:
        raise VllmTuningError(
            f"vllm_context_floor: {floor} tokens is below the minimum {MIN_CONTEXT_TOKENS}; "
            "agents send about 16k tokens of prompt and tool schemas, so 32768 or more is "
            "sensible"
        )
    if floor > target:
        raise VllmTuningError(
            f"vllm_context_floor: {floor} tokens is above vllm_context_target ({target}); "
            f"lower vllm_context_floor to {target} or less (equal to the target: the full "
            "plan only)"
        )
    return floor


def _check_at_least_one(value: object, variable: str, expected: str, example: str, fix: str) -> int:
    number = parse_number(value, variable, expected, example, whole=True)
    if number < 1:
        raise VllmTuningError(f"{variable}: expected {expected}, got {number!r}; {fix}")
    return number


def _ceil_hundredths(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` in hundredths, rounded up."""
    return -(-100 * numerator // denominator)


def _rung(
    plan: Mapping[str, object], index: int, card: int, utilization: float, context: int
) -> dict[str, object]:
    """A plan as a rung: its index, context, reservation on the card, and whether degraded."""
    return {
        **plan,
        "rung": index,
        "max_model_len": context,
        "reservation_bytes": math.ceil(Fraction(str(utilization)) * card),
        "degraded": index > 0,
    }


def vllm_plan_ladder(settings: object) -> list[dict[str, object]]:
    """The plans the arbiter may start vLLM on, the full plan first, each smaller than the last.

    Rung 0 is :func:`vllm_plan`.  The next rungs shorten the context by
    ``vllm_context_step`` tokens at a time while it stays above ``vllm_context_floor``, then
    take the floor itself (when it is below ``vllm_context_target``).  A rung of ``c``
    tokens asks for the share of the card its model needs::

        need = weights + runtime_overhead + kv_bytes_per_token * c * vllm_ladder_sequences
        utilisation = need / card, rounded up to hundredths

    so its KV cache holds ``vllm_ladder_sequences`` sequences of its full length.  A rung
    whose utilisation is not below the previous kept rung's is dropped: it would start in no
    less memory.  Each rung is built like the full plan (:func:`_build_plan`): its own
    ``--gpu-memory-utilization``, ``--max-model-len`` and YaRN factor (no ``--hf-overrides``
    within the native window), the same tool-call, dtype and extra arguments.

    Every rung has the keys of :func:`vllm_plan` plus ``rung`` (0, 1, ...),
    ``max_model_len``, ``reservation_bytes`` (``ceil(utilisation * card)``, what vLLM wants
    free at start), ``degraded`` (false for rung 0 only) and ``driver_headroom_bytes`` (the
    arbiter keeps it free beside a plan's reservation when it chooses one).  A model without
    ``kv_bytes_per_token`` or ``weights`` in its catalog entry cannot size smaller plans:
    its ladder is the full plan alone.
    """
    conf = _check_settings(settings, (*SETTINGS_KEYS, *LADDER_SETTINGS_KEYS))
    full, spec, card, utilization = _full_plan(conf)
    target = _check_target(conf["vllm_context_target"])
    floor = _check_floor(conf["vllm_context_floor"], target)
    step = _check_at_least_one(
        conf["vllm_context_step"],
        "vllm_context_step",
        "a whole number of tokens, 1 or more",
        "16384",
        "give the tokens between the contexts of two plans, such as 16384",
    )
    sequences = _check_at_least_one(
        conf["vllm_ladder_sequences"],
        "vllm_ladder_sequences",
        "a whole number of sequences, 1 or more",
        "2",
        "give how many full-length sequences a smaller plan must hold, such as 2",
    )
    headroom = parse_size(conf["vllm_driver_headroom"], "vllm_driver_headroom", allow_zero=True)
    ladder = [{**_rung(full, 0, card, utilization, target), "driver_headroom_bytes": headroom}]
    if spec.kv_bytes_per_token is None or spec.weights_bytes is None:
        return ladder

    # target - step, target - 2 * step, ... while above the floor, then the floor itself
    contexts = chain(range(target - step, floor, -step), [floor] if floor < target else [])
    previous = Fraction(str(utilization))
    for context in contexts:
        need = (
            spec.weights_bytes
            + spec.runtime_overhead_bytes
            + spec.kv_bytes_per_token * context * sequences
        )
        hundredths = _ceil_hundredths(need, card)
        if Fraction(hundredths, 100) >= previous:
            continue
        share = hundredths / 100
        plan = _build_plan(conf, spec, card, share, context)
        rung = _rung(plan, len(ladder), card, share, context)
        ladder.append({**rung, "driver_headroom_bytes": headroom})
        previous = Fraction(hundredths, 100)
    return ladder


def vllm_serve_args(settings: object) -> list[str]:
    """The full, ordered argument list after ``vllm serve`` (model path first)."""
    args = vllm_plan(settings)["args"]
    if not isinstance(args, list):  # vllm_plan always builds a list
        raise VllmTuningError(f"the plan's args are {type(args).__name__}, not a list")
    return [str(arg) for arg in args]


# --------------------------------------------------------------------------- compose


def _image_tag(image: str) -> str:
    """The tag of an image reference (``""`` when it has none); a digest is ignored."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else ""


def compose_command(args: object, image: object, mode: object = "auto") -> dict[str, object]:
    """How Compose hands ``args`` to the image: ``{"mode", "entrypoint", "command"}``.

    ``command`` mode (0.21 images) passes the arguments as the compose ``command:``, which the
    image forwards to ``vllm serve``.  ``entrypoint`` mode (0.14 images, whose entrypoint is
    ``bash -c "vllm serve"`` and drops compose arguments) replaces the entrypoint with a shell
    that sources oneAPI and execs ``vllm serve`` with the quoted arguments.  ``auto`` picks
    ``entrypoint`` for tags starting with ``0.14`` and ``command`` otherwise.
    """
    if not isinstance(image, str) or not image.strip():
        raise VllmTuningError(
            f"vllm_image: expected an image reference such as "
            f"intel/llm-scaler-vllm:0.21.0-b2, got {image!r}"
        )
    if not isinstance(mode, str) or mode not in ENTRYPOINT_MODES:
        raise VllmTuningError(
            f"vllm_image_entrypoint_mode: {mode!r} is not one of "
            f"{', '.join(sorted(ENTRYPOINT_MODES))}"
        )
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise VllmTypeError(f"args: expected a list of strings, got {_type_name(args)}")
    argv = [str(arg) for arg in args]
    tag = _image_tag(image)
    if tag in {"", "latest"}:
        raise VllmTuningError(
            f"vllm_image: {image!r} has no pinned tag; pin a release such as "
            "intel/llm-scaler-vllm:0.21.0-b2 (Intel asks not to use latest)"
        )
    chosen = mode if mode != "auto" else ("entrypoint" if tag.startswith("0.14") else "command")
    if chosen == "command":
        return {"mode": chosen, "entrypoint": None, "command": argv}
    script = "source /opt/intel/oneapi/setvars.sh --force && exec vllm serve " + shlex.join(argv)
    return {"mode": chosen, "entrypoint": ["bash", "-c", script], "command": None}
