# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``vllm`` role's model catalog (pure functions, no I/O): a validated entry
(:func:`model_spec`, :func:`resolve_model`) and what follows from the model alone:

* the container's host-memory cap (:func:`vllm_memory_cap`);
* per-model command-line rules: tool-call parser, MoE INT4 must be GPTQ, no
  ``--quantization`` for pre-quantised checkpoints (:func:`vllm_model_args`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    GIB,
    VllmTuningError,
    VllmTypeError,
    _ceil_gib,
    _type_name,
    human_size,
    parse_size,
)

__all__ = [
    "ACCEPTED_QUANTIZATIONS",
    "DEFAULT_RUNTIME_OVERHEAD_BYTES",
    "MEMORY_MARGIN_MIN_BYTES",
    "ONLINE_QUANTIZATIONS",
    "SEED_MEMORY_LESSON",
    "ModelSpec",
    "model_spec",
    "required_host_memory",
    "resolve_model",
    "vllm_memory_cap",
    "vllm_model_args",
]

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


_ENTRY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_PARSER_RE = re.compile(r"^[a-z0-9_]+$")


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
