"""Tables for the ladder of vLLM plans (``vllm_plan_ladder`` in
plugins/plugin_utils/_vllm_plan.py and its filter).

The lab/reference case is the role's defaults on the reference card (Arc Pro B70, 32 GiB):
Qwen2.5-7B-Instruct, two Plex transcodes, a 64k target, a 32k floor, a 16k step and two
sequences.  The model's figures are from its config.json: 28 layers, 4 KV heads, head_dim
128 (3584 / 28), so 2 x 28 x 4 x 128 x 2 = 57344 bytes of K and V per token at 16 bits.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.vllm import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    DEFAULT_RUNTIME_OVERHEAD_BYTES,
    model_spec,
    resolve_model,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    LADDER_SETTINGS_KEYS,
    SETTINGS_KEYS,
    vllm_plan,
    vllm_plan_ladder,
)

ROOT = Path(__file__).resolve().parents[4]
GIB = 1024**3
MIB = 1024**2
CARD = 32 * GIB

with (ROOT / "roles" / "vllm" / "defaults" / "main.yml").open(encoding="utf-8") as _handle:
    DEFAULTS: dict[str, Any] = yaml.safe_load(_handle)

# vllm_card_memory defaults to null (read from the driver); the reference card has 32 GiB.
# The model's config.json as the role reads it on the host (the fields of Qwen2.5-7B-Instruct's
# published one that YaRN's override carries; test data).
SETTINGS: dict[str, Any] = {
    key: DEFAULTS[key] for key in (*SETTINGS_KEYS, *LADDER_SETTINGS_KEYS)
} | {
    "vllm_card_memory": "32GiB",
    "vllm_model_config": {"max_position_embeddings": 32768, "rope_theta": 1000000.0},
}
CATALOG: dict[str, Any] = DEFAULTS["vllm_model_catalog"]
LADDER_KEYS = {
    "args",
    "gpu_memory_utilization",
    "context",
    "memory_limit_bytes",
    "model",
    "rung",
    "max_model_len",
    "reservation_bytes",
    "degraded",
    "driver_headroom_bytes",
}


def settings(**changes: object) -> dict[str, Any]:
    return {**SETTINGS, **changes}


def contexts(ladder: list[dict[str, Any]]) -> list[int]:
    return [rung["max_model_len"] for rung in ladder]


def utilizations(ladder: list[dict[str, Any]]) -> list[float]:
    return [rung["gpu_memory_utilization"] for rung in ladder]


def strictly_decreasing(values: list[int] | list[float]) -> bool:
    return all(a > b for a, b in pairwise(values))


def ceil_hundredths(numerator: int, denominator: int) -> float:
    """numerator / denominator rounded UP to hundredths (integer arithmetic, no float error)."""
    return -(-100 * numerator // denominator) / 100


def reservation(utilization: float, card: int = CARD) -> int:
    return math.ceil(Fraction(str(utilization)) * card)


# --------------------------------------------------------------------------- the lab case


def test_lab_defaults_are_the_reference_case() -> None:
    assert DEFAULTS["vllm_model"] == "Qwen2.5-7B-Instruct"
    assert DEFAULTS["vllm_context_target"] == 65536
    assert DEFAULTS["vllm_context_floor"] == 32768
    assert DEFAULTS["vllm_context_step"] == 16384
    assert DEFAULTS["vllm_ladder_sequences"] == 2
    entry = CATALOG["Qwen2.5-7B-Instruct"]
    spec = model_spec("Qwen2.5-7B-Instruct", entry)
    assert spec.weights_bytes == 15 * GIB
    assert spec.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert spec.runtime_overhead_bytes == DEFAULT_RUNTIME_OVERHEAD_BYTES == GIB


def test_lab_ladder() -> None:
    ladder = vllm_plan_ladder(SETTINGS)
    full = vllm_plan(SETTINGS)
    # Rung 0 is the full plan, unchanged, plus the rung's keys.
    assert ladder[0] == {
        **full,
        "rung": 0,
        "max_model_len": 65536,
        "reservation_bytes": math.ceil(Fraction("0.85") * CARD),
        "degraded": False,
        "driver_headroom_bytes": int(0.8 * GIB),
    }
    assert ladder[0]["gpu_memory_utilization"] == 0.85
    assert ladder[0]["reservation_bytes"] == 29205777613  # 0.85 x 32 GiB, rounded up

    # need = weights + runtime_overhead + kv_bytes_per_token x context x sequences
    weights, overhead, kv, sequences = 15 * GIB, 1 * GIB, 57344, 2
    need_49152 = weights + overhead + kv * 49152 * sequences  # 16 GiB + 5.25 GiB
    need_32768 = weights + overhead + kv * 32768 * sequences  # 16 GiB + 3.5 GiB
    util_49152 = ceil_hundredths(need_49152, CARD)  # 21.25 / 32 = 0.6640625 -> 0.67
    util_32768 = ceil_hundredths(need_32768, CARD)  # 19.5 / 32 = 0.609375 -> 0.61
    assert (util_49152, util_32768) == (0.67, 0.61)

    assert [(r["rung"], r["max_model_len"], r["degraded"]) for r in ladder] == [
        (0, 65536, False),
        (1, 49152, True),
        (2, 32768, True),
    ]
    assert utilizations(ladder) == [0.85, util_49152, util_32768]
    assert [r["reservation_bytes"] for r in ladder] == [
        29205777613,
        reservation(util_49152),
        reservation(util_32768),
    ]
    assert [r["reservation_bytes"] for r in ladder[1:]] == [23021024707, 20959440405]
    assert strictly_decreasing(utilizations(ladder))
    for rung in ladder:
        assert set(rung) == LADDER_KEYS
        assert rung["context"]["max_model_len"] == rung["max_model_len"]
        assert rung["memory_limit_bytes"] == full["memory_limit_bytes"]
        assert rung["model"] == full["model"]
    assert [r["context"]["yarn_factor"] for r in ladder] == [2.0, 1.5, None]


# --------------------------------------------------------------------------- the args


def parse_args(args: list[str]) -> tuple[str, dict[str, str | None]]:
    """The model path and each flag with its value (None for a switch); a flag twice fails."""
    path, rest = args[0], args[1:]
    assert not path.startswith("--")
    flags: dict[str, str | None] = {}
    index = 0
    while index < len(rest):
        flag = rest[index]
        assert flag.startswith("--"), f"{flag!r} is not a flag"
        assert flag not in flags, f"{flag} given twice"
        if index + 1 < len(rest) and not rest[index + 1].startswith("--"):
            flags[flag] = rest[index + 1]
            index += 2
        else:
            flags[flag] = None
            index += 1
    return path, flags


RUNG_FLAGS = ("--gpu-memory-utilization", "--max-model-len", "--hf-overrides")


@pytest.mark.parametrize(
    "changes",
    [
        *({"vllm_model": name} for name in sorted(CATALOG)),
        {"vllm_context_target": 131072, "vllm_context_step": 32768},
        {"vllm_context_target": 100000, "vllm_context_floor": 20000, "vllm_context_step": 30000},
        {
            "vllm_context_target": 131072,
            "vllm_context_floor": 8192,
            "vllm_ladder_sequences": 1,
            "vllm_dtype": "float16",
            "vllm_extra_args": ["--enforce-eager", "--block-size", 64],
        },
        {"vllm_model": "Qwen3-14B-AWQ", "vllm_enable_tool_calls": False},
    ],
)
def test_every_rung_has_complete_args(changes: dict[str, object]) -> None:
    conf = settings(**changes)
    ladder = vllm_plan_ladder(conf)
    spec = resolve_model(conf["vllm_model"], CATALOG, {})
    native = spec.native_context
    _full_path, full_flags = parse_args(ladder[0]["args"])
    for rung in ladder:
        args = rung["args"]
        assert all(isinstance(arg, str) for arg in args)
        path, flags = parse_args(args)
        assert path == f"/llm/models/{spec.path}"
        context = rung["max_model_len"]
        assert flags["--max-model-len"] == str(context)
        assert flags["--gpu-memory-utilization"] == f"{rung['gpu_memory_utilization']:.2f}"
        if context <= native:
            assert "--hf-overrides" not in flags
            assert rung["context"]["yarn_factor"] is None
        else:
            overrides = flags["--hf-overrides"]
            assert overrides is not None
            # the pinned image (transformers 5): the RoPE dict with the model's base, and the
            # rung's length as max_position_embeddings (vLLM since PR #56446 derives it)
            override = json.loads(overrides)
            rope = override["rope_parameters"]
            assert rope == {
                "rope_type": "yarn",
                "factor": math.ceil(Fraction(100 * context, native)) / 100,
                "original_max_position_embeddings": native,
                "rope_theta": 1000000.0,
            }
            assert override["max_position_embeddings"] == context
            # vLLM before PR #56446 derives original x factor
            assert int(native * rope["factor"]) >= context
        # Everything else (served name, address, tool calls, dtype, extra args) is the full
        # plan's.
        rest = {flag: value for flag, value in flags.items() if flag not in RUNG_FLAGS}
        assert rest == {k: v for k, v in full_flags.items() if k not in RUNG_FLAGS}
    if "vllm_extra_args" in changes:
        assert ladder[-1]["args"][-3:] == ["--enforce-eager", "--block-size", "64"]


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_each_default_model_has_a_decreasing_ladder(name: str) -> None:
    ladder = vllm_plan_ladder(settings(vllm_model=name))
    assert [r["rung"] for r in ladder] == list(range(len(ladder)))
    assert [r["degraded"] for r in ladder] == [False] + [True] * (len(ladder) - 1)
    assert strictly_decreasing(utilizations(ladder))
    assert strictly_decreasing(contexts(ladder))
    assert all(r["reservation_bytes"] == reservation(r["gpu_memory_utilization"]) for r in ladder)


# --------------------------------------------------------------------------- dropped rungs


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # 1024 tokens of Qwen2.5-7B x 2 sequences are 112 MiB, a third of a hundredth of the
        # card: contexts whose share rounds up to the hundredth of a larger one are dropped.
        # 39936: 63.33 -> 64; 38912: 62.99 -> 63; 37888: 62.65 -> 63 (dropped); 36864: 62.30
        # -> 63 (dropped); 35840: 61.96 -> 62; 34816, 33792 -> 62 (dropped); 32768: 60.94 -> 61.
        (
            {"vllm_context_target": 40960, "vllm_context_step": 1024},
            [(40960, 0.85), (39936, 0.64), (38912, 0.63), (35840, 0.62), (32768, 0.61)],
        ),
        # A forced utilisation below what a rung needs: that rung would start in no less.
        ({"vllm_gpu_memory_utilization": 0.65}, [(65536, 0.65), (32768, 0.61)]),
        ({"vllm_gpu_memory_utilization": 0.61}, [(65536, 0.61)]),
        # A rung equal to the previous one is dropped too: 0.67 is not below 0.67.
        ({"vllm_gpu_memory_utilization": 0.67}, [(65536, 0.67), (32768, 0.61)]),
        # Qwen3-32B-AWQ at 32k with two sequences needs 20 GiB + 16 GiB: more than the full
        # plan's share, so no smaller plan saves anything.
        ({"vllm_model": "Qwen3-32B-AWQ"}, [(65536, 0.85)]),
        # One sequence: 49152 needs 20 + 12 GiB (1.00) and 32768 needs 20 + 8 GiB (0.875 ->
        # 0.88), neither below 0.85; the floor 16384 needs 20 + 4 GiB (0.75).
        (
            {
                "vllm_model": "Qwen3-32B-AWQ",
                "vllm_ladder_sequences": 1,
                "vllm_context_floor": 16384,
            },
            [(65536, 0.85), (16384, 0.75)],
        ),
    ],
)
def test_rungs_that_save_nothing_are_dropped(
    changes: dict[str, object], expected: list[tuple[int, float]]
) -> None:
    ladder = vllm_plan_ladder(settings(**changes))
    assert list(zip(contexts(ladder), utilizations(ladder), strict=True)) == expected
    assert [r["rung"] for r in ladder] == list(range(len(expected)))


def test_the_floor_is_a_rung_even_off_the_step() -> None:
    # 65536 - 24576 = 40960, then the floor 32768 (65536 - 2 x 24576 = 16384 is below it).
    ladder = vllm_plan_ladder(settings(vllm_context_step=24576))
    assert contexts(ladder) == [65536, 40960, 32768]


def test_a_step_past_the_floor_goes_straight_to_it() -> None:
    ladder = vllm_plan_ladder(settings(vllm_context_step=65536))
    assert contexts(ladder) == [65536, 32768]


# --------------------------------------------------------------------------- one rung


@pytest.mark.parametrize(
    "changes",
    [
        {"vllm_context_floor": 65536},
        {"vllm_context_floor": "65536"},
        {"vllm_context_target": 32768},  # the default floor equals this target
        # No kv_bytes_per_token (null in the extra catalog takes it away): nothing to size.
        {"vllm_model_catalog_extra": {"Qwen2.5-7B-Instruct": {"kv_bytes_per_token": None}}},
        # No weights: nothing to size either.
        {"vllm_model_catalog_extra": {"Qwen2.5-7B-Instruct": {"weights": None}}},
        {
            "vllm_model": "mine",
            "vllm_model_catalog_extra": {
                "mine": {
                    k: v
                    for k, v in CATALOG["Qwen2.5-7B-Instruct"].items()
                    if k != "kv_bytes_per_token"
                }
            },
        },
    ],
)
def test_one_rung(changes: dict[str, object]) -> None:
    conf = settings(**changes)
    ladder = vllm_plan_ladder(conf)
    assert len(ladder) == 1
    assert ladder[0] == {
        **vllm_plan(conf),
        "rung": 0,
        "max_model_len": ladder[0]["context"]["max_model_len"],
        "reservation_bytes": reservation(ladder[0]["gpu_memory_utilization"]),
        "degraded": False,
        "driver_headroom_bytes": int(0.8 * GIB),
    }


# --------------------------------------------------------------------------- catalog


def test_runtime_overhead_counts_in_the_need() -> None:
    extra = {"Qwen2.5-7B-Instruct": {"runtime_overhead": "3GiB"}}
    ladder = vllm_plan_ladder(settings(vllm_model_catalog_extra=extra))
    # 15 + 3 GiB + 57344 x 49152 x 2 (5.25 GiB) = 23.25 GiB of 32: 0.7265625 -> 0.73
    need_49152 = 15 * GIB + 3 * GIB + 57344 * 49152 * 2
    # 15 + 3 GiB + 57344 x 32768 x 2 (3.5 GiB) = 21.5 GiB of 32: 0.671875 -> 0.68
    need_32768 = 15 * GIB + 3 * GIB + 57344 * 32768 * 2
    expected = [0.85, ceil_hundredths(need_49152, CARD), ceil_hundredths(need_32768, CARD)]
    assert utilizations(ladder) == expected == [0.85, 0.73, 0.68]
    assert ladder[0]["model"]["runtime_overhead"] == 3 * GIB


def test_model_entry_carries_the_new_fields() -> None:
    entry = resolve_model("Qwen3-32B-AWQ", CATALOG, {}).as_dict()
    assert entry["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * 2 == 262144
    assert entry["runtime_overhead"] == GIB
    # The plain entry reads back as the same model (the filters pass it around).
    assert model_spec(entry["name"], entry).as_dict() == entry


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim"),
    [
        ("Qwen2.5-7B-Instruct", 28, 4, 128),
        ("Qwen3-14B-AWQ", 40, 8, 128),
        ("Qwen3-30B-A3B-GPTQ-Int4", 48, 4, 128),
        ("Qwen3-32B-AWQ", 64, 8, 128),
    ],
)
def test_default_kv_bytes_per_token_are_the_config_figures(
    name: str, layers: int, kv_heads: int, head_dim: int
) -> None:
    spec = model_spec(name, CATALOG[name])
    assert spec.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 2


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        (
            "kv_bytes_per_token",
            "lots",
            VllmTuningError,
            "vllm_model_catalog['m'].kv_bytes_per_token: cannot read 'lots' as a size; write "
            "bytes or a number with a unit k, m, g or t (binary, as Docker reads them), e.g. "
            "'16g' or '2GiB'",
        ),
        (
            "kv_bytes_per_token",
            0,
            VllmTuningError,
            "vllm_model_catalog['m'].kv_bytes_per_token: a size must be more than zero bytes, "
            "got 0",
        ),
        (
            "kv_bytes_per_token",
            True,
            VllmTypeError,
            "vllm_model_catalog['m'].kv_bytes_per_token: expected a size in bytes or a string "
            "such as '16g' or '2GiB', got a boolean (True)",
        ),
        (
            "runtime_overhead",
            "-1g",
            VllmTuningError,
            "vllm_model_catalog['m'].runtime_overhead: cannot read '-1g' as a size; write "
            "bytes or a number with a unit k, m, g or t (binary, as Docker reads them), e.g. "
            "'16g' or '2GiB'",
        ),
    ],
)
def test_catalog_refuses_bad_sizes(
    field: str, value: object, error: type[Exception], message: str
) -> None:
    entry = {**CATALOG["Qwen2.5-7B-Instruct"], field: value}
    with pytest.raises(error) as err:
        model_spec("m", entry)
    assert str(err.value) == message


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"vllm_context_floor": "lots"},
            "vllm_context_floor: expected a whole number of tokens, got 'lots', which is not a "
            "decimal number; give a whole number such as 32768",
        ),
        (
            {"vllm_context_floor": 32768.5},
            "vllm_context_floor: expected a whole number of tokens, got 32768.5, which is not "
            "a whole number; give a whole number such as 32768",
        ),
        (
            {"vllm_context_floor": None},
            "vllm_context_floor: expected a whole number of tokens, got null (None); give a "
            "whole number such as 32768",
        ),
        (
            {"vllm_context_floor": 100},
            "vllm_context_floor: 100 tokens is below the minimum 256; agents send about 16k "
            "tokens of prompt and tool schemas, so 32768 or more is sensible",
        ),
        (
            {"vllm_context_floor": 65537},
            "vllm_context_floor: 65537 tokens is above vllm_context_target (65536); lower "
            "vllm_context_floor to 65536 or less (equal to the target: the full plan only)",
        ),
        (
            {"vllm_context_target": 16384},
            "vllm_context_floor: 32768 tokens is above vllm_context_target (16384); lower "
            "vllm_context_floor to 16384 or less (equal to the target: the full plan only)",
        ),
        (
            {"vllm_context_step": 0},
            "vllm_context_step: expected a whole number of tokens, 1 or more, got 0; give the "
            "tokens between the contexts of two plans, such as 16384",
        ),
        (
            {"vllm_context_step": "-16384"},
            "vllm_context_step: expected a whole number of tokens, 1 or more, got -16384; give "
            "the tokens between the contexts of two plans, such as 16384",
        ),
        (
            {"vllm_context_step": "16k"},
            "vllm_context_step: expected a whole number of tokens, 1 or more, got '16k', which "
            "is not a decimal number; give a whole number such as 16384",
        ),
        (
            {"vllm_ladder_sequences": 0},
            "vllm_ladder_sequences: expected a whole number of sequences, 1 or more, got 0; "
            "give how many full-length sequences a smaller plan must hold, such as 2",
        ),
        (
            {"vllm_ladder_sequences": 1.5},
            "vllm_ladder_sequences: expected a whole number of sequences, 1 or more, got 1.5, "
            "which is not a whole number; give a whole number such as 2",
        ),
        # The full plan's own checks come first.
        (
            {"vllm_context_target": 262144, "vllm_context_floor": 1},
            "vllm_context_target: 262144 tokens needs a YaRN factor of 8 over "
            "Qwen2.5-7B-Instruct's native 32768, above the model's maximum 4; lower "
            "vllm_context_target to 131072 or less",
        ),
    ],
)
def test_ladder_refuses(changes: dict[str, object], message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_plan_ladder(settings(**changes))
    assert str(err.value) == message


def test_ladder_refuses_missing_settings() -> None:
    conf = {key: value for key, value in SETTINGS.items() if key not in LADDER_SETTINGS_KEYS}
    # vllm_plan does not need the ladder's variables.
    assert vllm_plan(conf) == vllm_plan(SETTINGS)
    with pytest.raises(VllmTuningError) as err:
        vllm_plan_ladder(conf)
    assert str(err.value) == (
        "settings: missing vllm_context_floor, vllm_context_step, vllm_ladder_sequences; pass "
        "every variable the role defines in its defaults"
    )


def test_ladder_reads_numeric_strings() -> None:
    strings = settings(
        vllm_context_target="65536",
        vllm_context_floor="32768",
        vllm_context_step="16384",
        vllm_ladder_sequences="2",
    )
    assert vllm_plan_ladder(strings) == vllm_plan_ladder(SETTINGS)


# --------------------------------------------------------------------------- the filter

FILTERS = FilterModule().filters()


def test_filter_returns_the_pure_result() -> None:
    assert FILTERS["vllm_plan_ladder"](SETTINGS) == vllm_plan_ladder(SETTINGS)


def test_filter_raises_ansible_filter_error() -> None:
    with pytest.raises(AnsibleFilterError) as err:
        FILTERS["vllm_plan_ladder"]({**SETTINGS, "vllm_context_step": 0})
    assert err.value.message == (
        "vllm_context_step: expected a whole number of tokens, 1 or more, got 0; give the "
        "tokens between the contexts of two plans, such as 16384"
    )
    assert isinstance(err.value.orig_exc, VllmTuningError)


def test_every_rung_carries_the_driver_headroom_in_bytes() -> None:
    ladder = vllm_plan_ladder(settings())
    assert {rung["driver_headroom_bytes"] for rung in ladder} == {int(0.8 * GIB)}
