"""The vllm filter shell, its per-filter docs, and the role's defaults and argument spec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.vllm import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_context import vllm_context
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import VllmTuningError
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    model_spec,
    resolve_model,
    vllm_memory_cap,
    vllm_model_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    SETTINGS_KEYS,
    compose_command,
    vllm_plan,
    vllm_serve_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    gpu_memory_utilization,
)

ROOT = Path(__file__).resolve().parents[4]
FILTER_DIR = ROOT / "plugins" / "filter"
ROLE = ROOT / "roles" / "vllm"
GIB = 1024**3

FILTERS: dict[str, Callable[..., Any]] = FilterModule().filters()


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


DEFAULTS: dict[str, Any] = _load(ROLE / "defaults" / "main.yml")
SPEC_OPTIONS: dict[str, Any] = _load(ROLE / "meta" / "argument_specs.yml")["argument_specs"][
    "main"
]["options"]
# vllm_card_memory defaults to null: the role then takes the card's size from xe_driver_cards.
# The reference card (Arc Pro B70) has 32 GiB.
# The model's config.json as the role reads it on the host (the fields of Qwen2.5-7B-Instruct's
# published one that YaRN's override carries; test data).
MODEL_CONFIG = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1000000.0}
SETTINGS = {key: DEFAULTS[key] for key in SETTINGS_KEYS} | {
    "vllm_card_memory": "32GiB",
    "vllm_model_config": MODEL_CONFIG,
}
ENTRY = resolve_model(
    DEFAULTS["vllm_model"], DEFAULTS["vllm_model_catalog"], DEFAULTS["vllm_model_catalog_extra"]
).as_dict()


def test_filter_names() -> None:
    assert sorted(FILTERS) == [
        "vllm_compose_command",
        "vllm_context",
        "vllm_gpu_memory_utilization",
        "vllm_memory_cap",
        "vllm_model_args",
        "vllm_model_entry",
        "vllm_plan",
        "vllm_plan_ladder",
        "vllm_serve_args",
    ]


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_each_filter_has_its_doc(name: str) -> None:
    doc = _load(FILTER_DIR / f"{name}.yml")
    assert doc["DOCUMENTATION"]["name"] == name
    assert doc["DOCUMENTATION"]["options"]["_input"]["required"] is True
    assert f"cardshare.gpuhost.{name}" in doc["EXAMPLES"]
    assert "_value" in doc["RETURN"]


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "expected"),
    [
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", DEFAULTS["vllm_reservations"], "0.8GiB"),
            {},
            gpu_memory_utilization("32GiB", DEFAULTS["vllm_reservations"], "0.8GiB"),
        ),
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", [], "0"),
            {"ceiling": 0.9, "override": 0.5},
            gpu_memory_utilization("32GiB", [], "0", 0.9, 0.5),
        ),
        (
            "vllm_model_entry",
            ("Qwen2.5-7B-Instruct", DEFAULTS["vllm_model_catalog"]),
            {},
            ENTRY,
        ),
        (
            "vllm_context",
            (ENTRY, 65536, DEFAULTS["vllm_image"]),
            {"model_config": MODEL_CONFIG},
            vllm_context(ENTRY, 65536, DEFAULTS["vllm_image"], None, MODEL_CONFIG),
        ),
        ("vllm_context", (ENTRY, 65536, "x/y:1", 4), {}, vllm_context(ENTRY, 65536, "x/y:1", 4)),
        ("vllm_memory_cap", (ENTRY, "16g"), {}, vllm_memory_cap(ENTRY, "16g")),
        ("vllm_model_args", (ENTRY,), {}, vllm_model_args(ENTRY)),
        ("vllm_model_args", (ENTRY,), {"enable_tool_calls": False}, []),
        ("vllm_plan", (SETTINGS,), {}, vllm_plan(SETTINGS)),
        ("vllm_serve_args", (SETTINGS,), {}, vllm_serve_args(SETTINGS)),
        (
            "vllm_compose_command",
            (["/llm/models/m"], "intel/llm-scaler-vllm:0.21.0-b2"),
            {},
            compose_command(["/llm/models/m"], "intel/llm-scaler-vllm:0.21.0-b2"),
        ),
    ],
)
def test_filters_return_the_pure_results(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], expected: object
) -> None:
    assert FILTERS[name](*args, **kwargs) == expected


# The role's numbers as -e key=value gives them (strings): what the numbers give.
STRING_NUMBERS = {
    "vllm_gpu_memory_utilization_max": "0.95",
    "vllm_context_target": "65536",
    "vllm_port": "8000",
}


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "expected"),
    [
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", [], "0"),
            {"ceiling": "0.9", "override": "0.5"},
            gpu_memory_utilization("32GiB", [], "0", 0.9, 0.5),
        ),
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", [{"name": "plex", "bytes": "2GiB", "count": "2"}], "0.8GiB"),
            {},
            0.85,
        ),
        ("vllm_context", (ENTRY, "65536", None, "4"), {}, vllm_context(ENTRY, 65536, None, 4)),
        ("vllm_plan", ({**SETTINGS, **STRING_NUMBERS},), {}, vllm_plan(SETTINGS)),
        (
            "vllm_plan",
            ({**SETTINGS, "vllm_gpu_memory_utilization": "0.8"},),
            {},
            vllm_plan({**SETTINGS, "vllm_gpu_memory_utilization": 0.8}),
        ),
        ("vllm_serve_args", ({**SETTINGS, **STRING_NUMBERS},), {}, vllm_serve_args(SETTINGS)),
    ],
)
def test_filters_read_numeric_strings_as_numbers(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], expected: object
) -> None:
    assert FILTERS[name](*args, **kwargs) == expected


def test_numeric_defaults_are_numbers() -> None:
    # the strings above stand for these defaults
    assert {key: DEFAULTS[key] for key in STRING_NUMBERS} == {
        "vllm_gpu_memory_utilization_max": 0.95,
        "vllm_context_target": 65536,
        "vllm_port": 8000,
    }


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", [{"name": "plex", "bytes": "40GiB"}], "0.8GiB"),
            "vllm_reservations: the reservations add up to 40 GiB (plex 1 x 40 GiB), more than "
            "the card's 32 GiB (vllm_card_memory); lower the reservations or correct "
            "vllm_card_memory",
        ),
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", "plex", "0.8GiB"),
            "vllm_reservations: expected a list of {name, bytes, count} mappings, got a string",
        ),
        (
            "vllm_model_entry",
            ("Qwen3-8B", {}),
            "vllm_model: 'Qwen3-8B' is not in vllm_model_catalog or vllm_model_catalog_extra "
            "(known: none); pick one of those or add an entry to vllm_model_catalog_extra",
        ),
        (
            "vllm_context",
            ({**ENTRY, "yarn_supported": False, "yarn_max_factor": None}, 65536),
            "vllm_context_target: 65536 tokens exceeds the native window of "
            "Qwen2.5-7B-Instruct (32768) and the model does not support YaRN; lower "
            "vllm_context_target to 32768 or less, or pick a model with yarn_supported: true",
        ),
        (
            "vllm_memory_cap",
            (ENTRY, "4g"),
            "vllm_memory_limit: 4 GiB is below what Qwen2.5-7B-Instruct needs on the host: "
            "about 6 GiB plus a margin of 25% (at least 2 GiB) makes 8 GiB; raise "
            "vllm_memory_limit to '8g' or more. Seed lesson: a compose 'memory: 8G' limit "
            "killed Qwen3-32B at 8.3 GB of RSS, a memory cgroup kill that looked like a VRAM "
            "problem (252 restarts); the cap went to 16G.",
        ),
        (
            "vllm_model_args",
            ({**ENTRY, "moe": True, "quantization": "awq", "bits": 4},),
            "model 'Qwen2.5-7B-Instruct': an MoE checkpoint quantised to INT4 must be GPTQ for "
            "the llm-scaler image (only GPTQ checkpoints get a quantised method for the MoE "
            "layers), got awq; use a GPTQ-Int4 checkpoint of Qwen2.5-7B-Instruct",
        ),
        (
            "vllm_plan",
            ({**SETTINGS, "vllm_gpu_memory_utilization": 1.2},),
            "vllm_gpu_memory_utilization: 1.2 is outside (0, 0.95]; set it to null to compute "
            "it from the card and its reservations, or to a share in range",
        ),
        (
            "vllm_plan",
            ({**SETTINGS, "vllm_gpu_memory_utilization": "lots"},),
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got 'lots', which is not a decimal number; give a decimal number such as 0.85",
        ),
        (
            "vllm_plan",
            ({**SETTINGS, "vllm_context_target": "nan"},),
            "vllm_context_target: expected a whole number of tokens, got 'nan', which is not a "
            "decimal number; give a whole number such as 65536",
        ),
        (
            "vllm_context",
            (ENTRY, "0x10"),
            "vllm_context_target: expected a whole number of tokens, got '0x10', which is not a "
            "decimal number; give a whole number such as 65536",
        ),
        (
            "vllm_gpu_memory_utilization",
            ("32GiB", [], "0", "1e400"),
            "vllm_gpu_memory_utilization_max: expected a number in (0, 1], got '1e400', which is "
            "out of range; give a decimal number such as 0.95",
        ),
        (
            "vllm_serve_args",
            ({**SETTINGS, "vllm_extra_args": ["--port", "9000"]},),
            "vllm_extra_args[0]: --port is computed by the role; set vllm_port instead",
        ),
        (
            "vllm_compose_command",
            ([], "intel/llm-scaler-vllm"),
            "vllm_image: 'intel/llm-scaler-vllm' has no pinned tag; pin a release such as "
            "intel/llm-scaler-vllm:0.21.0-b2 (Intel asks not to use latest)",
        ),
    ],
)
def test_filters_raise_ansible_filter_error(name: str, args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(AnsibleFilterError) as err:
        FILTERS[name](*args)
    assert err.value.message == message
    assert isinstance(err.value.orig_exc, VllmTuningError)


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("name", sorted(DEFAULTS["vllm_model_catalog"]))
def test_each_default_catalog_entry_passes_validation(name: str) -> None:
    spec = model_spec(name, DEFAULTS["vllm_model_catalog"][name])
    assert spec.name == name
    # With the role's other defaults (the seed's card, Plex, 64k, 16G), each model plans.
    plan = vllm_plan({**SETTINGS, "vllm_model": name})
    assert plan["memory_limit_bytes"] == 16 * GIB


def test_defaults_reproduce_the_seed() -> None:
    plan = vllm_plan(SETTINGS)
    assert plan["gpu_memory_utilization"] == 0.85
    context = plan["context"]
    assert isinstance(context, dict)
    assert context["max_model_len"] == 65536
    assert context["yarn_factor"] == 2.0
    args = plan["args"]
    assert isinstance(args, list)
    assert args[args.index("--tool-call-parser") + 1] == "hermes"


def test_defaults_refuse_the_seed_8g_cap_for_the_32b() -> None:
    with pytest.raises(VllmTuningError, match=r"^vllm_memory_limit: 8 GiB is below"):
        vllm_plan({**SETTINGS, "vllm_model": "Qwen3-32B-AWQ", "vllm_memory_limit": "8G"})


def test_defaults_pin_the_image() -> None:
    assert DEFAULTS["vllm_image"] == "intel/llm-scaler-vllm:0.21.0-b2"
    assert compose_command([], DEFAULTS["vllm_image"])["mode"] == "command"


def test_argument_spec_and_defaults_have_the_same_keys() -> None:
    assert sorted(SPEC_OPTIONS) == sorted(DEFAULTS)


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_argument_spec_agrees_with_each_default(key: str) -> None:
    option = SPEC_OPTIONS[key]
    assert key.startswith("vllm_")
    assert option["description"]
    if "default" in option:
        assert option["default"] == DEFAULTS[key]
    else:
        # Options without a spec default are the catalog, the reservations (structured, in
        # defaults) and the optional ones whose default is null.
        assert key in {"vllm_model_catalog", "vllm_reservations"} or DEFAULTS[key] is None
    if "choices" in option and DEFAULTS[key] is not None:
        assert DEFAULTS[key] in option["choices"]
