"""Tables for YaRN's ``--hf-overrides`` (``vllm_context``, ``start_window`` and
``image_transformers`` in plugins/plugin_utils/_vllm_context.py), issue 28.

Two facts decide the override's shape:

* vLLM's start rule for a YaRN RoPE dict: before vllm-project/vllm PR #56446 (the llm-scaler
  0.14 and 0.21 images) the window is ``original_max_position_embeddings x factor``; since it
  (upstream 0.32) it is ``max_position_embeddings``.  The override carries
  ``"max_position_embeddings": <length>`` so that both start every rung.
* the override replaces the model's RoPE dict whole: transformers 4 reads ``rope_scaling``
  and keeps a top-level ``rope_theta``; transformers 5 reads ``rope_parameters``, which holds
  ``rope_theta`` (a ``rope_scaling`` override there ends without it, and vLLM's qwen3_moe
  then serves with a base of 10000).  The role carries the base from the model's config.json.

The model configs below are test data with the fields the role reads, at the values of the
models' published config.json files (Qwen2.5-7B-Instruct: window 32768, base 1000000;
Qwen3-30B-A3B: window 40960, base 1000000).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_context import (
    KNOWN_IMAGE_TRANSFORMERS,
    VLLM_START_RULES,
    apply_overrides,
    image_transformers,
    known_image_transformers,
    start_window,
    vllm_context,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import resolve_model
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    LADDER_SETTINGS_KEYS,
    SETTINGS_KEYS,
    vllm_plan_ladder,
)

ROOT = Path(__file__).resolve().parents[4]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


DEFAULTS: dict[str, Any] = _load(ROOT / "roles" / "vllm" / "defaults" / "main.yml")
EXAMPLE: dict[str, Any] = _load(ROOT / "inventories" / "example" / "host_vars" / "devastator.yml")
LAB: dict[str, Any] = _load(ROOT / "inventories" / "lab" / "group_vars" / "gpuhosts" / "vllm.yml")
CATALOG: dict[str, Any] = DEFAULTS["vllm_model_catalog"]
QWEN25 = resolve_model("Qwen2.5-7B-Instruct", CATALOG)
MOE = resolve_model("Qwen3-30B-A3B-GPTQ-Int4", CATALOG)
PINNED = "intel/llm-scaler-vllm:0.21.0-b2"

QWEN25_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
}
# As transformers 4 saved it: rope_theta top-level, rope_scaling null.
MOE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "num_experts": 128,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
}
# The same model as transformers 5 saves it: the base inside rope_parameters only.
MOE_CONFIG_T5: dict[str, Any] = {
    **{
        key: value for key, value in MOE_CONFIG.items() if key not in ("rope_theta", "rope_scaling")
    },
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
YARN_2 = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}


def overrides(context: dict[str, object]) -> Any:
    text = context["hf_overrides"]
    assert isinstance(text, str)
    return json.loads(text)


# --------------------------------------------------------------------------- the override


@pytest.mark.parametrize(
    ("model", "target", "transformers", "config", "expected"),
    [
        # transformers 5 (the pinned images): rope_parameters holding the model's base
        (
            QWEN25,
            65536,
            5,
            QWEN25_CONFIG,
            '{"rope_parameters":{"rope_type":"yarn","factor":2.0,'
            '"original_max_position_embeddings":32768,"rope_theta":1000000.0},'
            '"max_position_embeddings":65536}',
        ),
        # the MoE whose base vLLM's qwen3_moe would take as 10000 without it
        (
            MOE,
            65536,
            5,
            MOE_CONFIG,
            '{"rope_parameters":{"rope_type":"yarn","factor":2.0,'
            '"original_max_position_embeddings":32768,"rope_theta":1000000.0},'
            '"max_position_embeddings":65536}',
        ),
        # ... saved by transformers 5: the base read from rope_parameters
        (
            MOE,
            49152,
            5,
            json.dumps(MOE_CONFIG_T5),
            '{"rope_parameters":{"rope_type":"yarn","factor":1.5,'
            '"original_max_position_embeddings":32768,"rope_theta":1000000.0},'
            '"max_position_embeddings":49152}',
        ),
        # transformers 4: rope_scaling, the base beside it (where transformers 4 reads it)
        (
            QWEN25,
            65536,
            4,
            QWEN25_CONFIG,
            '{"rope_scaling":{"rope_type":"yarn","factor":2.0,'
            '"original_max_position_embeddings":32768},"rope_theta":1000000.0,'
            '"max_position_embeddings":65536}',
        ),
        (
            MOE,
            131072,
            4,
            MOE_CONFIG_T5,
            '{"rope_scaling":{"rope_type":"yarn","factor":4.0,'
            '"original_max_position_embeddings":32768},"rope_theta":1000000.0,'
            '"max_position_embeddings":131072}',
        ),
        # transformers 4 without the model's config.json: rope_theta stays the model's own
        (
            QWEN25,
            40000,
            4,
            None,
            '{"rope_scaling":{"rope_type":"yarn","factor":1.23,'
            '"original_max_position_embeddings":32768},"max_position_embeddings":40000}',
        ),
        # the model's other RoPE settings are carried; YaRN's own are the role's
        (
            QWEN25,
            65536,
            5,
            {
                **QWEN25_CONFIG,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                    "attention_factor": 1.1386,
                    "beta_fast": 32,
                },
            },
            '{"rope_parameters":{"rope_type":"yarn","factor":2.0,'
            '"original_max_position_embeddings":32768,"rope_theta":1000000.0,"beta_fast":32},'
            '"max_position_embeddings":65536}',
        ),
        (
            QWEN25,
            65536,
            4,
            {**QWEN25_CONFIG, "rope_scaling": {"rope_type": "default", "mrope_section": [16, 24]}},
            '{"rope_scaling":{"rope_type":"yarn","factor":2.0,'
            '"original_max_position_embeddings":32768,"mrope_section":[16,24]},'
            '"rope_theta":1000000.0,"max_position_embeddings":65536}',
        ),
    ],
)
def test_the_override_for_each_transformers(
    model: object, target: int, transformers: int, config: object, expected: str
) -> None:
    context = vllm_context(model, target, "example/vllm:1", transformers, config)
    assert context["hf_overrides"] == expected
    assert context["rope_key"] == ("rope_parameters" if transformers == 5 else "rope_scaling")
    assert context["max_model_len"] == target


def test_a_moe_keeps_its_rope_base_under_the_pinned_image() -> None:
    # issue 28: under transformers 5 a rope_scaling override ended as rope_parameters without
    # rope_theta, and vLLM's qwen3_moe took rope_parameters.get("rope_theta", 10000)
    context = vllm_context(MOE, 65536, PINNED, None, MOE_CONFIG)
    rope = overrides(context)["rope_parameters"]
    assert rope.get("rope_theta", 10000) == 1000000.0
    assert context["rope_theta"] == 1000000.0
    assert "rope_scaling" not in overrides(context)


@pytest.mark.parametrize(
    ("image", "declared", "major"),
    [
        ("intel/llm-scaler-vllm:0.21.0-b2", None, 5),
        ("intel/llm-scaler-vllm:0.21.0-b1", None, 5),
        ("intel/llm-scaler-vllm:0.14.0-b8.3", None, 5),
        ("intel/llm-scaler-vllm:0.14.0-b8.3.1", None, 5),
        ("intel/llm-scaler-vllm:0.14.0-b8.3.2", None, 5),
        ("docker.io/intel/llm-scaler-vllm:0.21.0-b2", None, 5),
        ("intel/llm-scaler-vllm:0.21.0-b2@sha256:" + "0" * 64, None, 5),
        # the variable wins over the catalogue, as -e gives it too
        ("intel/llm-scaler-vllm:0.21.0-b2", 4, 4),
        ("example/vllm:1", "4", 4),
        ("example/vllm:1", 5.0, 5),
    ],
)
def test_image_transformers(image: str, declared: object, major: int) -> None:
    assert image_transformers(image, declared) == major


def test_the_catalogue_lists_only_the_pinned_llm_scaler_releases() -> None:
    assert KNOWN_IMAGE_TRANSFORMERS == {
        "intel/llm-scaler-vllm": {
            "0.14.0-b8.3": 5,
            "0.14.0-b8.3.1": 5,
            "0.14.0-b8.3.2": 5,
            "0.21.0-b1": 5,
            "0.21.0-b2": 5,
        }
    }
    # the role's default and the example inventory's image are known
    assert known_image_transformers(DEFAULTS["vllm_image"]) == 5
    assert known_image_transformers(EXAMPLE["vllm_image"]) == 5


UNKNOWN = (
    "vllm_image_transformers: null, and the role does not know which transformers the image "
    "{image} (vllm_image) has (it knows intel/llm-scaler-vllm 0.14.0-b8.3, 0.14.0-b8.3.1, "
    "0.14.0-b8.3.2, 0.21.0-b1, 0.21.0-b2: transformers 5); YaRN's --hf-overrides is written in "
    "the key that version reads (4: rope_scaling beside rope_theta, 5: rope_parameters holding "
    "rope_theta), so set vllm_image_transformers to 4 or 5, the major version `python3 -c "
    "'import transformers; print(transformers.__version__)'` prints inside the image"
)
NOT_4_OR_5 = (
    "vllm_image_transformers: expected null or the major version of transformers in "
    "vllm_image, 4 or 5, got {got}"
)


@pytest.mark.parametrize(
    ("image", "declared", "error", "message"),
    [
        (
            "vllm/vllm-openai:v0.32.0",
            None,
            VllmTuningError,
            UNKNOWN.format(image="'vllm/vllm-openai:v0.32.0'"),
        ),
        # releases whose transformers the role cannot tell from their Dockerfile
        (
            "intel/llm-scaler-vllm:0.14.0-b8",
            None,
            VllmTuningError,
            UNKNOWN.format(image="'intel/llm-scaler-vllm:0.14.0-b8'"),
        ),
        (
            "intel/llm-scaler-vllm:0.14.0-b8.2",
            None,
            VllmTuningError,
            UNKNOWN.format(image="'intel/llm-scaler-vllm:0.14.0-b8.2'"),
        ),
        (
            "cardshare-lab/vllm-standin:current",
            None,
            VllmTuningError,
            UNKNOWN.format(image="'cardshare-lab/vllm-standin:current'"),
        ),
        (None, None, VllmTuningError, UNKNOWN.format(image="None")),
        (PINNED, 6, VllmTuningError, NOT_4_OR_5.format(got="6")),
        (PINNED, "3", VllmTuningError, NOT_4_OR_5.format(got="3")),
        (
            PINNED,
            "five",
            VllmTuningError,
            NOT_4_OR_5.format(
                got="'five', which is not a decimal number; give a whole number such as 5"
            ),
        ),
        (
            PINNED,
            True,
            VllmTypeError,
            NOT_4_OR_5.format(got="a boolean (True); give a whole number such as 5"),
        ),
    ],
)
def test_image_transformers_refuses(
    image: object, declared: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as err:
        image_transformers(image, declared)
    assert str(err.value) == message
    # the same refusal where YaRN needs it, before anything is rendered
    with pytest.raises(error) as err:
        vllm_context(QWEN25, 65536, image, declared, QWEN25_CONFIG)
    assert str(err.value) == message


def test_no_yarn_needs_no_transformers() -> None:
    # at or below the native window the image's transformers does not matter
    context = vllm_context(QWEN25, 32768, "vllm/vllm-openai:v0.32.0", None, None)
    assert context["hf_overrides"] is None
    assert context["rope_key"] is None
    assert context["start_windows"] == {"pre-56446": 32768, "post-56446": 32768}


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        (
            MOE,
            None,
            "vllm_context_target: 65536 tokens needs YaRN over Qwen3-30B-A3B-GPTQ-Int4's native "
            "32768; under transformers 5 (vllm_image_transformers, or known from vllm_image) the "
            "override replaces the model's RoPE settings whole, rope_theta included, so the role "
            "carries them from the model's config.json, but the role found no config.json of "
            "Qwen3-30B-A3B-GPTQ-Int4 (it reads <vllm_model_dir>/Qwen3-30B-A3B-GPTQ-Int4/"
            "config.json): download the model first, or lower vllm_context_target to 32768 or "
            "less",
        ),
        (
            MOE,
            {key: value for key, value in MOE_CONFIG.items() if key != "rope_theta"},
            "vllm_context_target: 65536 tokens needs YaRN over Qwen3-30B-A3B-GPTQ-Int4's native "
            "32768; under transformers 5 (vllm_image_transformers, or known from vllm_image) the "
            "override replaces the model's RoPE settings whole, rope_theta included, so the role "
            "carries them from the model's config.json, but Qwen3-30B-A3B-GPTQ-Int4's config.json "
            "gives no rope_theta (vLLM would take a default): add the model's rope_theta to its "
            "config.json, or lower vllm_context_target to 32768 or less",
        ),
        (
            QWEN25,
            "{not json",
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir) is not JSON "
            "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
            "download the model's files again",
        ),
        (
            QWEN25,
            {**QWEN25_CONFIG, "rope_theta": "1e6"},
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): rope_theta is "
            "'1e6', not a positive number; download the model's files again",
        ),
        (
            QWEN25,
            {**QWEN25_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): rope_theta "
            "1000000.0 and rope_parameters.rope_theta 10000.0 disagree; the role cannot tell the "
            "model's RoPE base: correct config.json",
        ),
        (
            QWEN25,
            {**QWEN25_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): rope_scaling "
            "already scales RoPE (rope_type 'llama3'); YaRN over it is not defined: lower "
            "vllm_context_target to 32768 or less",
        ),
        (
            QWEN25,
            {
                **QWEN25_CONFIG,
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            },
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): "
            "rope_parameters holds RoPE settings per layer type (full_attention, "
            "sliding_attention); the role cannot turn YaRN on over them: lower "
            "vllm_context_target to 32768 or less",
        ),
        (
            QWEN25,
            {**QWEN25_CONFIG, "rope_scaling": "yarn"},
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): rope_scaling is "
            "a string ('yarn'), not a mapping; download the model's files again",
        ),
        (
            QWEN25,
            ["not", "an", "object"],
            "vllm_model: Qwen2.5-7B-Instruct's config.json (under vllm_model_dir): expected a JSON "
            "object, got a list",
        ),
        # a length key vLLM takes beside max_position_embeddings: since PR #56446 it bounds the
        # window, and the override sets max_position_embeddings only
        (
            QWEN25,
            {**QWEN25_CONFIG, "seq_length": 32768},
            "vllm_context_target: 65536 tokens with YaRN would be refused at start by vLLM since "
            "vllm-project/vllm PR #56446 (upstream 0.32): it derives 32768 from "
            "Qwen2.5-7B-Instruct's config.json with the override (seq_length=32768), and the "
            "override sets max_position_embeddings only; lower vllm_context_target to 32768 or "
            "less",
        ),
    ],
)
def test_vllm_context_refuses_what_it_cannot_carry(
    model: object, config: object, message: str
) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_context(model, 65536, PINNED, None, config)
    assert str(err.value) == message


def test_a_window_below_the_catalogs_native_context_is_refused_without_yarn() -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_context(
            QWEN25, 32768, PINNED, None, {**QWEN25_CONFIG, "max_position_embeddings": 8192}
        )
    assert str(err.value) == (
        "vllm_model_catalog['Qwen2.5-7B-Instruct'].native_context: 32768 is above the window vLLM "
        "derives from Qwen2.5-7B-Instruct's config.json (max_position_embeddings=8192): a plan of "
        "32768 tokens without YaRN would be refused at start by vLLM before vllm-project/vllm PR "
        "#56446 (the llm-scaler 0.14 and 0.21 images); set native_context to 8192, or lower "
        "vllm_context_target to 8192 or less"
    )


# --------------------------------------------------------------------------- the start rules


@pytest.mark.parametrize(
    ("config", "pre", "post"),
    [
        # issue 28's refusal: the old override on vLLM 0.32 (max_position_embeddings=32768.0)
        ({**QWEN25_CONFIG, "rope_scaling": YARN_2}, 65536, 32768),
        # with max_position_embeddings: both start 64k
        ({**QWEN25_CONFIG, "rope_scaling": YARN_2, "max_position_embeddings": 65536}, 65536, 65536),
        # transformers 5's key, read the same way
        (
            {**QWEN25_CONFIG, "rope_parameters": YARN_2, "max_position_embeddings": 65536},
            65536,
            65536,
        ),
        # no RoPE scaling: the smallest length key
        (QWEN25_CONFIG, 32768, 32768),
        ({**QWEN25_CONFIG, "n_positions": 4096}, 4096, 4096),
        # other scalings still multiply the window under both rules
        ({**QWEN25_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 65536, 65536),
        ({**QWEN25_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 32768, 32768),
        ({"rope_theta": 1000000.0}, math.inf, math.inf),
    ],
)
def test_start_window(config: dict[str, Any], pre: float, post: float) -> None:
    assert start_window(config, "pre-56446")[0] == pre
    assert start_window(config, "post-56446")[0] == post


def test_start_window_names_what_it_derived_from() -> None:
    config = {**QWEN25_CONFIG, "rope_scaling": YARN_2}
    assert start_window(config, "pre-56446") == (
        65536.0,
        "original_max_position_embeddings=32768 x factor 2",
    )
    assert start_window(config, "post-56446") == (32768.0, "max_position_embeddings=32768")
    with pytest.raises(VllmTuningError) as err:
        start_window(config, "0.32")
    assert str(err.value) == "rules: '0.32' is not one of pre-56446, post-56446"


def _settings(inventory: dict[str, Any], config: object, **changes: object) -> dict[str, Any]:
    keys = (*SETTINGS_KEYS, *LADDER_SETTINGS_KEYS)
    values = {**DEFAULTS, **{k: v for k, v in inventory.items() if k.startswith("vllm_")}}
    return {key: values[key] for key in keys} | {
        "vllm_card_memory": "32GiB",
        "vllm_model_config": config,
        **changes,
    }


# Every rung of the example inventory's ladder and of the lab's, under both rules: the
# arithmetic the role's plan must satisfy for vLLM to start each one.
@pytest.mark.parametrize(
    ("inventory", "changes", "config", "rungs"),
    [
        # the example inventory: 64k (factor 2), 48k (factor 1.5), 32k (native, no YaRN)
        (EXAMPLE, {}, QWEN25_CONFIG, [(65536, 2.0), (49152, 1.5), (32768, None)]),
        (LAB, {}, QWEN25_CONFIG, [(65536, 2.0), (49152, 1.5), (32768, None)]),
        # the catalog's MoE: its KV cache leaves the 0.70 of the card no smaller plan below 64k
        (
            EXAMPLE,
            {"vllm_model": "Qwen3-30B-A3B-GPTQ-Int4"},
            MOE_CONFIG,
            [(65536, 2.0)],
        ),
        (
            EXAMPLE,
            {"vllm_model": "Qwen3-30B-A3B-GPTQ-Int4", "vllm_context_target": 131072},
            MOE_CONFIG_T5,
            [(131072, 4.0)],
        ),
        # the 7B up to 128k on the card alone: every 16k step down to the floor
        (
            EXAMPLE,
            {
                "vllm_context_target": 131072,
                "vllm_reservations": [],
                "vllm_driver_headroom": "2GiB",
            },
            QWEN25_CONFIG,
            [
                (131072, 4.0),
                (114688, 3.5),
                (98304, 3.0),
                (81920, 2.5),
                (65536, 2.0),
                (49152, 1.5),
                (32768, None),
            ],
        ),
    ],
)
def test_every_rung_starts_under_both_rules(
    inventory: dict[str, Any],
    changes: dict[str, object],
    config: dict[str, Any],
    rungs: list[tuple[int, float | None]],
) -> None:
    ladder = vllm_plan_ladder(_settings(inventory, config, **changes))
    assert [(rung["max_model_len"], rung["context"]["yarn_factor"]) for rung in ladder] == rungs
    native = 32768
    for rung in ladder:
        length = rung["max_model_len"]
        context = rung["context"]
        merged = {**config}
        if context["hf_overrides"] is not None:
            override = overrides(context)
            assert override["max_position_embeddings"] == length
            rope = override["rope_parameters"]
            assert rope["rope_theta"] == 1000000.0
            # before PR #56446: original x factor reaches the length
            assert native * rope["factor"] >= length
            merged = apply_overrides(config, override, 5)
        for rules in VLLM_START_RULES:
            window, _why = start_window(merged, rules, 5)
            assert length <= window, (rules, length, window)
        assert context["start_windows"] == {
            rules: int(start_window(merged, rules, 5)[0]) for rules in VLLM_START_RULES
        }
        args = rung["args"]
        assert args[args.index("--max-model-len") + 1] == str(length)


def test_the_old_override_fails_the_new_rule_on_every_yarn_rung() -> None:
    # the test the fix must pass and the old form fails: the role's override before issue 28
    # had rope_scaling only, and since PR #56446 every YaRN rung is above its window
    ladder = vllm_plan_ladder(_settings(EXAMPLE, QWEN25_CONFIG))
    for rung in ladder:
        if rung["context"]["yarn_factor"] is None:
            continue
        old = {"rope_scaling": {**rung["context"]["rope_scaling"]}}
        old["rope_scaling"].pop("rope_theta", None)
        window, why = start_window({**QWEN25_CONFIG, **old}, "post-56446", 4)
        assert rung["max_model_len"] > window
        assert why == "max_position_embeddings=32768"


# --------------------------------------------------------------------------- real recordings

# tests/fixtures/vllm/yarn-refusal.log: upstream vLLM 0.32.0 (CPU build, transformers 5.19.0)
# refusing the role's rung 0 as rendered before this change, on the conformance lane's tiny
# Qwen2 (tests/fixtures/vllm/README.md says how it was made).  Its config.json as that README
# gives it: max_position_embeddings 32768, rope_parameters {default, rope_theta 250000.0}.
RECORDED_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0},
}
OLD_RUNG_0 = {"rope_scaling": YARN_2}


def _recorded(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_the_recorded_refusal_is_the_old_override_under_the_new_rule() -> None:
    log = _recorded("yarn-refusal.log")
    # the run's arguments are the old override of rung 0, as vLLM echoed them
    assert (
        "'max_model_len': 65536, 'served_model_name': ['Qwen2.5-7B-Instruct'], 'hf_overrides': "
        "{'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, "
        "'original_max_position_embeddings': 32768}}" in log
    )
    # the rule the role models for vLLM since PR #56446 gives the refusal vLLM printed, with
    # its numbers; the rule before it would have started the same line
    merged = apply_overrides(RECORDED_MODEL_CONFIG, OLD_RUNG_0, 5)
    # transformers 5: the rope_scaling override replaced the model's rope_parameters whole
    assert merged["rope_parameters"] == YARN_2
    window, why = start_window(merged, "post-56446", 5)
    key, _, _value = why.partition("=")
    assert (
        f"User-specified max_model_len (65536) is greater than the derived max_model_len "
        f"({key}={window} or model_max_length=None in model's config.json)" in log
    )
    assert start_window(merged, "pre-56446", 5)[0] == 65536


def test_the_role_renders_for_the_recorded_model_what_starts_there() -> None:
    # the same rung as the role renders it now for that model on vLLM 0.32 (transformers 5)
    context = vllm_context(QWEN25, 65536, "vllm/vllm-openai:v0.32.0", 5, RECORDED_MODEL_CONFIG)
    assert context["hf_overrides"] == (
        '{"rope_parameters":{"rope_type":"yarn","factor":2.0,'
        '"original_max_position_embeddings":32768,"rope_theta":250000.0},'
        '"max_position_embeddings":65536}'
    )
    assert context["start_windows"] == {"pre-56446": 65536, "post-56446": 65536}


def test_the_settings_own_checks_come_before_the_model_files() -> None:
    # a memory cap below the model's need is told even when the model's config.json (which
    # YaRN under transformers 5 needs) is not there yet
    settings = _settings(EXAMPLE, None, vllm_model="Qwen3-32B-AWQ", vllm_memory_limit="8G")
    with pytest.raises(VllmTuningError) as err:
        vllm_plan_ladder(settings)
    assert str(err.value).startswith(
        "vllm_memory_limit: 8 GiB is below what Qwen3-32B-AWQ needs on the host"
    )
