"""Tables for the vllm role's tuning functions (plugins/plugin_utils/_vllm_*.py).

The seed's numbers: a 32 GB card with two 4K HDR Plex transcodes at 2 GB and 0.8 GB of
driver headroom gives 0.85; 64k over a 32k window is a YaRN factor of 2.0; an 8G cap killed
a 32B model at 8.3 GB of RSS and 16G held.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_context import vllm_context
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
    human_size,
    parse_number,
    parse_size,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    SEED_MEMORY_LESSON,
    ModelSpec,
    model_spec,
    required_host_memory,
    resolve_model,
    vllm_memory_cap,
    vllm_model_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    compose_command,
    vllm_plan,
    vllm_serve_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    gpu_memory_utilization,
    parse_reservations,
)

GIB = 1024**3
MIB = 1024**2
PLEX = [{"name": "plex-4k-hdr-transcode", "bytes": "2GiB", "count": 2}]

QWEN25_7B: dict[str, Any] = {
    "name": "Qwen2.5-7B-Instruct",
    "hf_repo": "Qwen/Qwen2.5-7B-Instruct",
    "family": "qwen2.5",
    "native_context": 32768,
    "yarn_supported": True,
    "yarn_max_factor": 4.0,
    "moe": False,
    "quantization": "none",
    "bits": 16,
    "host_memory": "6GiB",
    "weights": "15GiB",
}
QWEN3_32B = {
    **QWEN25_7B,
    "name": "Qwen3-32B-AWQ",
    "hf_repo": "Qwen/Qwen3-32B-AWQ",
    "family": "qwen3",
    "quantization": "awq",
    "bits": 4,
    "host_memory": "12GiB",
    "weights": "19GiB",
}
NO_YARN = {**QWEN25_7B, "name": "short", "yarn_supported": False, "yarn_max_factor": None}
# The fields of Qwen2.5-7B-Instruct's published config.json the role reads (test data).
QWEN25_7B_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
CODER = {
    **QWEN25_7B,
    "name": "Qwen3-Coder-30B-A3B-GPTQ",
    "hf_repo": "example/Qwen3-Coder-30B-A3B-Instruct-GPTQ-Int4",
    "family": "qwen3-coder",
    "native_context": 262144,
    "moe": True,
    "quantization": "gptq",
    "bits": 4,
}


def _message(err: pytest.ExceptionInfo[BaseException]) -> str:
    return str(err.value)


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (17179869184, 16 * GIB),
        ("16g", 16 * GIB),
        ("16G", 16 * GIB),
        ("16GiB", 16 * GIB),
        ("16gb", 16 * GIB),
        ("16 GB", 16 * GIB),
        ("8g", 8 * GIB),
        ("800m", 800 * MIB),
        ("0.8GiB", int(0.8 * GIB)),
        ("512", 512),
        ("512b", 512),
        ("2k", 2048),
        ("1t", 1024**4),
    ],
)
def test_parse_size_reads_docker_sizes_as_binary(value: object, expected: int) -> None:
    assert parse_size(value, "vllm_memory_limit") == expected


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "16 gigs",
            VllmTuningError,
            "vllm_memory_limit: cannot read '16 gigs' as a size; write bytes or a number with "
            "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'",
        ),
        (
            "16i",
            VllmTuningError,
            "vllm_memory_limit: cannot read '16i' as a size; write bytes or a number with "
            "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'",
        ),
        (
            1.5,
            VllmTypeError,
            "vllm_memory_limit: expected a size in bytes or a string such as '16g' or '2GiB', "
            "got a float (1.5)",
        ),
        (
            True,
            VllmTypeError,
            "vllm_memory_limit: expected a size in bytes or a string such as '16g' or '2GiB', "
            "got a boolean (True)",
        ),
        (
            None,
            VllmTypeError,
            "vllm_memory_limit: expected a size in bytes or a string such as '16g' or '2GiB', "
            "got null (None)",
        ),
        (-1, VllmTuningError, "vllm_memory_limit: a size must be more than zero bytes, got -1"),
        (0, VllmTuningError, "vllm_memory_limit: a size must be more than zero bytes, got 0"),
    ],
)
def test_parse_size_refuses(value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as err:
        parse_size(value, "vllm_memory_limit")
    assert _message(err) == message


# --------------------------------------------------------------------------- numbers


# -e key=value gives strings; the argument spec accepts them for int and float but leaves them
# strings. Each spelling reads as the number written as a number.
@pytest.mark.parametrize(
    ("value", "whole", "expected"),
    [
        ("0.8", False, 0.8),
        (" 0.8 ", False, 0.8),
        ("+0.8", False, 0.8),
        (".8", False, 0.8),
        ("8e-1", False, 0.8),
        ("1", False, 1),
        ("1.", False, 1.0),
        ("-2", False, -2),
        (0.8, False, 0.8),
        (1, False, 1),
        ("65536", True, 65536),
        ("65_536", True, 65536),
        ("65536.0", True, 65536),
        ("6.5536e4", True, 65536),
        (65536.0, True, 65536),
        (65536, True, 65536),
        ("-1", True, -1),
    ],
)
def test_parse_number_reads_numeric_strings_as_numbers(
    value: object, whole: bool, expected: float
) -> None:
    number = parse_number(value, "vllm_context_target", "a number", "65536", whole=whole)
    assert number == expected
    assert type(number) is type(expected)


@pytest.mark.parametrize(
    ("value", "whole", "error", "got"),
    [
        ("lots", False, VllmTuningError, "'lots', which is not a decimal number"),
        ("", False, VllmTuningError, "'', which is not a decimal number"),
        ("0x10", False, VllmTuningError, "'0x10', which is not a decimal number"),
        ("nan", False, VllmTuningError, "'nan', which is not a decimal number"),
        ("inf", False, VllmTuningError, "'inf', which is not a decimal number"),
        ("-Infinity", False, VllmTuningError, "'-Infinity', which is not a decimal number"),
        ("1e400", False, VllmTuningError, "'1e400', which is out of range"),
        ("-1e400", True, VllmTuningError, "'-1e400', which is out of range"),
        ("0,8", False, VllmTuningError, "'0,8', which is not a decimal number"),
        ("64k", True, VllmTuningError, "'64k', which is not a decimal number"),
        ("65 536", True, VllmTuningError, "'65 536', which is not a decimal number"),
        ("65__536", True, VllmTuningError, "'65__536', which is not a decimal number"),
        # digits of other scripts, which Python's float() would read
        ("\u0668", True, VllmTuningError, "'\u0668', which is not a decimal number"),
        ("65536.5", True, VllmTuningError, "'65536.5', which is not a whole number"),
        (65536.5, True, VllmTuningError, "65536.5, which is not a whole number"),
        (float("nan"), False, VllmTuningError, "nan, which is not a finite number"),
        (float("-inf"), True, VllmTuningError, "-inf, which is not a finite number"),
        (10**400, True, VllmTuningError, f"{10**400!r}, which is out of range"),
        (True, False, VllmTypeError, "a boolean (True)"),
        (None, True, VllmTypeError, "null (None)"),
        ([65536], True, VllmTypeError, "a list ([65536])"),
    ],
)
def test_parse_number_refuses(value: object, whole: bool, error: type[Exception], got: str) -> None:
    kind = "a whole number" if whole else "a decimal number"
    with pytest.raises(error) as err:
        parse_number(value, "vllm_context_target", "a number of tokens", "65536", whole=whole)
    assert _message(err) == (
        f"vllm_context_target: expected a number of tokens, got {got}; give {kind} such as 65536"
    )


@pytest.mark.parametrize(
    ("size", "text"),
    [(8 * GIB, "8 GiB"), (int(0.8 * GIB), "819.2 MiB"), (512, "512 B"), (15 * GIB // 2, "7.5 GiB")],
)
def test_human_size(size: int, text: str) -> None:
    assert human_size(size) == text


# --------------------------------------------------------------------------- utilisation


@pytest.mark.parametrize(
    ("card", "reservations", "headroom", "kwargs", "expected"),
    [
        # The seed: 32 GB, two 4K HDR transcodes at 2 GB, 0.8 GB headroom: 0.85.
        ("32GiB", PLEX, "0.8GiB", {}, 0.85),
        (32 * GIB, PLEX, int(0.8 * GIB), {}, 0.85),
        # Rounded down, never up: 27.5/32 = 0.859375.
        ("32GiB", PLEX, "0.5GiB", {}, 0.85),
        # A third transcode: (32 - 6 - 0.8) / 32 = 0.7875.
        ("32GiB", [{**PLEX[0], "count": 3}], "0.8GiB", {}, 0.78),
        # count defaults to 1.
        ("32GiB", [{"name": "plex", "bytes": "4GiB"}], "0.8GiB", {}, 0.85),
        ("32GiB", None, "3.2GiB", {}, 0.9),
        ("32GiB", [], "1.6GiB", {}, 0.95),
        # An explicit override within range wins.
        ("32GiB", PLEX, "0.8GiB", {"override": 0.8}, 0.8),
        ("32GiB", [], "0", {"ceiling": 1, "override": 1}, 1.0),
        # A configurable ceiling.
        ("32GiB", [], "0.32GiB", {"ceiling": 0.99}, 0.99),
    ],
)
def test_gpu_memory_utilization(
    card: object, reservations: object, headroom: object, kwargs: dict[str, Any], expected: float
) -> None:
    assert gpu_memory_utilization(card, reservations, headroom, **kwargs) == expected


@pytest.mark.parametrize(
    ("card", "reservations", "headroom", "kwargs", "message"),
    [
        (
            "32GiB",
            [{"name": "plex", "bytes": "20GiB", "count": 2}],
            "0.8GiB",
            {},
            "vllm_reservations: the reservations add up to 40 GiB (plex 2 x 20 GiB), more than "
            "the card's 32 GiB (vllm_card_memory); lower the reservations or correct "
            "vllm_card_memory",
        ),
        (
            "32GiB",
            [{"name": "comfy", "bytes": "30GiB"}],
            "2GiB",
            {},
            "vllm_gpu_memory_utilization: the computed share 0.00 is outside (0, 0.95]: the "
            "reservations (30 GiB) and vllm_driver_headroom (2 GiB) leave 0 B of the card's "
            "32 GiB for vLLM; lower vllm_reservations or vllm_driver_headroom",
        ),
        (
            "32GiB",
            [],
            "0.8GiB",
            {},
            "vllm_gpu_memory_utilization: the computed share 0.97 is outside (0, 0.95]: only "
            "819.2 MiB of the card's 32 GiB is kept for other tenants and the driver; raise "
            "vllm_driver_headroom or vllm_reservations, or raise "
            "vllm_gpu_memory_utilization_max if the card really has no other tenant",
        ),
        (
            "32GiB",
            PLEX,
            "0.8GiB",
            {"override": 0.96},
            "vllm_gpu_memory_utilization: 0.96 is outside (0, 0.95]; set it to null to compute "
            "it from the card and its reservations, or to a share in range",
        ),
        (
            "32GiB",
            PLEX,
            "0.8GiB",
            {"override": 0},
            "vllm_gpu_memory_utilization: 0 is outside (0, 0.95]; set it to null to compute "
            "it from the card and its reservations, or to a share in range",
        ),
        (
            "32GiB",
            PLEX,
            "0.8GiB",
            {"override": 0.9},
            "vllm_gpu_memory_utilization: 0.9 of the card's 32 GiB leaves 3.2 GiB, less than "
            "the 4 GiB of vllm_reservations; lower it, or set it to null to compute it",
        ),
        (
            "32GiB",
            PLEX,
            "0.8GiB",
            {"ceiling": 1.5},
            "vllm_gpu_memory_utilization_max: 1.5 is outside (0, 1]; the default 0.95 leaves "
            "the driver some room",
        ),
        (
            "32GiB",
            [{"name": "plex", "bytes": "2GiB", "count": -1}],
            "0.8GiB",
            {},
            "vllm_reservations[0].count: expected a whole number of uses (0 or more), got -1",
        ),
        (
            "32GiB",
            [{"name": "", "bytes": "2GiB"}],
            "0.8GiB",
            {},
            "vllm_reservations[0].name: give the tenant a name, got ''",
        ),
        (
            "32GiB",
            [{"name": "plex", "size": "2GiB"}],
            "0.8GiB",
            {},
            "vllm_reservations[0]: unknown key(s) size; a reservation has name, bytes and count",
        ),
        (
            "32GiB",
            [{"name": "plex", "count": 2}],
            "0.8GiB",
            {},
            "vllm_reservations[0].bytes: missing; give the size of one use, e.g. 2GiB",
        ),
        (
            "thirty-two",
            PLEX,
            "0.8GiB",
            {},
            "vllm_card_memory: cannot read 'thirty-two' as a size; write bytes or a number with "
            "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'",
        ),
        (
            "32GiB",
            PLEX,
            "-1",
            {},
            "vllm_driver_headroom: cannot read '-1' as a size; write bytes or a number with "
            "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'",
        ),
    ],
)
def test_gpu_memory_utilization_refuses(
    card: object, reservations: object, headroom: object, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(VllmTuningError) as err:
        gpu_memory_utilization(card, reservations, headroom, **kwargs)
    assert _message(err) == message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "plex",
            "vllm_reservations: expected a list of {name, bytes, count} mappings, got a string",
        ),
        (
            ["plex"],
            "vllm_reservations[0]: expected a mapping with name, bytes and count, got a string",
        ),
    ],
)
def test_parse_reservations_refuses_wrong_types(value: object, message: str) -> None:
    with pytest.raises(VllmTypeError) as err:
        parse_reservations(value)
    assert _message(err) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "lots",
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got 'lots', which is not a decimal number; give a decimal number such as 0.85",
        ),
        (
            "nan",
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got 'nan', which is not a decimal number; give a decimal number such as 0.85",
        ),
        (
            True,
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got a boolean (True); give a decimal number such as 0.85",
        ),
        (
            "0.97",
            "vllm_gpu_memory_utilization: 0.97 is outside (0, 0.95]; set it to null to compute "
            "it from the card and its reservations, or to a share in range",
        ),
    ],
)
def test_override_type(override: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        gpu_memory_utilization("32GiB", PLEX, "0.8GiB", override=override)
    assert _message(err) == message


# Each numeric argument as -e gives it (a string): the share the number gives.
@pytest.mark.parametrize(
    ("reservations", "kwargs", "expected"),
    [
        (PLEX, {"override": "0.8"}, 0.8),
        (PLEX, {"override": " 0.80 "}, 0.8),
        ([], {"ceiling": "1", "override": "1"}, 1.0),
        ([], {"ceiling": "0.99"}, 0.99),
        # (32 - 3 x 2 - 0.32) / 32 = 0.8025
        ([{**PLEX[0], "count": "3"}], {}, 0.8),
    ],
)
def test_gpu_memory_utilization_reads_numeric_strings(
    reservations: object, kwargs: dict[str, Any], expected: float
) -> None:
    share = gpu_memory_utilization("32GiB", reservations, "0.32GiB", **kwargs)
    assert share == expected
    assert type(share) is float


@pytest.mark.parametrize(
    ("kwargs", "reservations", "message"),
    [
        (
            {"ceiling": "0x1"},
            PLEX,
            "vllm_gpu_memory_utilization_max: expected a number in (0, 1], got '0x1', which is "
            "not a decimal number; give a decimal number such as 0.95",
        ),
        (
            {"ceiling": "1e400"},
            PLEX,
            "vllm_gpu_memory_utilization_max: expected a number in (0, 1], got '1e400', which is "
            "out of range; give a decimal number such as 0.95",
        ),
        (
            {"ceiling": float("nan")},
            PLEX,
            "vllm_gpu_memory_utilization_max: expected a number in (0, 1], got nan, which is not "
            "a finite number; give a decimal number such as 0.95",
        ),
        (
            {},
            [{**PLEX[0], "count": "two"}],
            "vllm_reservations[0].count: expected a whole number of uses (0 or more), got "
            "'two', which is not a decimal number; give a whole number such as 2",
        ),
        (
            {},
            [{**PLEX[0], "count": "-1"}],
            "vllm_reservations[0].count: expected a whole number of uses (0 or more), got -1",
        ),
    ],
)
def test_gpu_memory_utilization_refuses_non_numbers(
    kwargs: dict[str, Any], reservations: object, message: str
) -> None:
    with pytest.raises(VllmTuningError) as err:
        gpu_memory_utilization("32GiB", reservations, "0.8GiB", **kwargs)
    assert _message(err) == message


# --------------------------------------------------------------------------- context


@pytest.mark.parametrize(
    ("model", "target", "max_len", "factor"),
    [
        # The seed: 64k over the 7B's 32k window is 2.0.
        (QWEN25_7B, 65536, 65536, 2.0),
        (QWEN25_7B, 131072, 131072, 4.0),
        # The smallest factor, in hundredths, that reaches the target: 40000/32768 = 1.2207.
        (QWEN25_7B, 40000, 40000, 1.23),
        (QWEN25_7B, 32769, 32769, 1.01),
        # At or below the native window: no rope scaling.
        (QWEN25_7B, 32768, 32768, None),
        (QWEN25_7B, 16384, 16384, None),
        (NO_YARN, 32768, 32768, None),
        # No documented maximum factor: any factor.
        ({**QWEN25_7B, "yarn_max_factor": None}, 262144, 262144, 8.0),
    ],
)
def test_vllm_context(model: object, target: int, max_len: int, factor: float | None) -> None:
    # transformers 4 without the model's config.json: the RoPE dict alone, and the length
    result = vllm_context(model, target, None, 4)
    assert result["max_model_len"] == max_len
    assert result["yarn_factor"] == factor
    if factor is None:
        assert result["rope_scaling"] is None
        assert result["hf_overrides"] is None
    else:
        rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 32768}
        assert result["rope_scaling"] == rope
        assert isinstance(result["hf_overrides"], str)
        assert json.loads(result["hf_overrides"]) == {
            "rope_scaling": rope,
            "max_position_embeddings": target,
        }
        assert 32768 * factor >= target


@pytest.mark.parametrize("target", ["65536", " 65536 ", "65536.0", "6.5536e4", 65536.0, "16384"])
def test_vllm_context_reads_numeric_strings(target: object) -> None:
    result = vllm_context(QWEN25_7B, target, None, "5", QWEN25_7B_CONFIG)
    assert result == vllm_context(QWEN25_7B, int(float(str(target))), None, 5, QWEN25_7B_CONFIG)
    assert type(result["max_model_len"]) is int


def test_hf_overrides_is_the_documented_json() -> None:
    # the filter's documented example: the pinned image (transformers 5) and the 7B's config
    result = vllm_context(
        QWEN25_7B, 65536, "intel/llm-scaler-vllm:0.21.0-b2", None, QWEN25_7B_CONFIG
    )
    assert result["hf_overrides"] == (
        '{"rope_parameters":{"rope_type":"yarn","factor":2.0,'
        '"original_max_position_embeddings":32768,"rope_theta":1000000.0},'
        '"max_position_embeddings":65536}'
    )


@pytest.mark.parametrize(
    ("model", "target", "message"),
    [
        (
            NO_YARN,
            65536,
            "vllm_context_target: 65536 tokens exceeds the native window of short (32768) and "
            "the model does not support YaRN; lower vllm_context_target to 32768 or less, or "
            "pick a model with yarn_supported: true",
        ),
        (
            QWEN25_7B,
            262144,
            "vllm_context_target: 262144 tokens needs a YaRN factor of 8 over "
            "Qwen2.5-7B-Instruct's native 32768, above the model's maximum 4; lower "
            "vllm_context_target to 131072 or less",
        ),
        (
            QWEN25_7B,
            131073,
            "vllm_context_target: 131073 tokens needs a YaRN factor of 4.01 over "
            "Qwen2.5-7B-Instruct's native 32768, above the model's maximum 4; lower "
            "vllm_context_target to 131072 or less",
        ),
        (
            QWEN25_7B,
            100,
            "vllm_context_target: 100 tokens is below the minimum 256; agents send about 16k "
            "tokens of prompt and tool schemas, so 32768 or more is sensible",
        ),
        (
            QWEN25_7B,
            "64k",
            "vllm_context_target: expected a whole number of tokens, got '64k', which is not a "
            "decimal number; give a whole number such as 65536",
        ),
        (
            QWEN25_7B,
            "",
            "vllm_context_target: expected a whole number of tokens, got '', which is not a "
            "decimal number; give a whole number such as 65536",
        ),
        (
            QWEN25_7B,
            "1e400",
            "vllm_context_target: expected a whole number of tokens, got '1e400', which is out "
            "of range; give a whole number such as 65536",
        ),
        (
            QWEN25_7B,
            "65536.5",
            "vllm_context_target: expected a whole number of tokens, got '65536.5', which is not "
            "a whole number; give a whole number such as 65536",
        ),
        (
            QWEN25_7B,
            None,
            "vllm_context_target: expected a whole number of tokens, got null (None); give a "
            "whole number such as 65536",
        ),
        (
            QWEN25_7B,
            "100",
            "vllm_context_target: 100 tokens is below the minimum 256; agents send about 16k "
            "tokens of prompt and tool schemas, so 32768 or more is sensible",
        ),
    ],
)
def test_vllm_context_refuses(model: object, target: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_context(model, target, "intel/llm-scaler-vllm:0.21.0-b2", None, QWEN25_7B_CONFIG)
    assert _message(err) == message


# --------------------------------------------------------------------------- memory cap


@pytest.mark.parametrize(
    ("model", "cap", "expected"),
    [
        # The seed's lesson: 16G holds the 32B.
        (QWEN3_32B, "16G", 16 * GIB),
        (QWEN3_32B, "16GiB", 16 * GIB),
        (QWEN3_32B, "15g", 15 * GIB),
        # The smaller models ran under the seed's 8G cap.
        (QWEN25_7B, "8g", 8 * GIB),
        (QWEN25_7B, 8 * GIB, 8 * GIB),
    ],
)
def test_vllm_memory_cap(model: object, cap: object, expected: int) -> None:
    assert vllm_memory_cap(model, cap) == expected


@pytest.mark.parametrize(
    ("need", "required"),
    [
        # 25 %, but at least 2 GiB.
        ("12GiB", 15 * GIB),
        ("6GiB", 8 * GIB),
        ("1GiB", 3 * GIB),
        ("16GiB", 20 * GIB),
    ],
)
def test_required_host_memory(need: str, required: int) -> None:
    assert required_host_memory({**QWEN25_7B, "host_memory": need}) == required


@pytest.mark.parametrize(
    ("model", "cap", "message"),
    [
        (
            QWEN3_32B,
            "8g",
            "vllm_memory_limit: 8 GiB is below what Qwen3-32B-AWQ needs on the host: about "
            "12 GiB plus a margin of 25% (at least 2 GiB) makes 15 GiB; raise "
            "vllm_memory_limit to '15g' or more. Seed lesson: a compose 'memory: 8G' limit "
            "killed Qwen3-32B at 8.3 GB of RSS, a memory cgroup kill that looked like a VRAM "
            "problem (252 restarts); the cap went to 16G.",
        ),
        (
            QWEN25_7B,
            "7g",
            "vllm_memory_limit: 7 GiB is below what Qwen2.5-7B-Instruct needs on the host: "
            "about 6 GiB plus a margin of 25% (at least 2 GiB) makes 8 GiB; raise "
            f"vllm_memory_limit to '8g' or more. {SEED_MEMORY_LESSON}",
        ),
        (
            QWEN3_32B,
            "sixteen",
            "vllm_memory_limit: cannot read 'sixteen' as a size; write bytes or a number with "
            "a unit k, m, g or t (binary, as Docker reads them), e.g. '16g' or '2GiB'",
        ),
    ],
)
def test_vllm_memory_cap_refuses(model: object, cap: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_memory_cap(model, cap)
    assert _message(err) == message


# --------------------------------------------------------------------------- model rules


@pytest.mark.parametrize(
    ("model", "tools", "expected"),
    [
        (QWEN25_7B, True, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
        (QWEN3_32B, True, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
        (CODER, True, ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]),
        (QWEN25_7B, False, []),
        # A parser named in the entry wins over the family's.
        (
            {**QWEN25_7B, "tool_call_parser": "qwen3_xml"},
            True,
            ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"],
        ),
        # Online quantisation of an unquantised checkpoint passes --quantization.
        (
            {**QWEN25_7B, "online_quantization": "sym_int4"},
            False,
            ["--quantization", "sym_int4"],
        ),
        ({**QWEN25_7B, "family": "other"}, False, []),
    ],
)
def test_vllm_model_args(model: object, tools: bool, expected: list[str]) -> None:
    assert vllm_model_args(model, tools) == expected


@pytest.mark.parametrize("quantization", ["awq", "gptq"])
def test_pre_quantised_checkpoints_never_get_quantization_flag(quantization: str) -> None:
    entry = {**QWEN25_7B, "quantization": quantization, "bits": 4}
    assert "--quantization" not in vllm_model_args(entry, True)


MOE_AWQ_MESSAGE = (
    "model 'Qwen3-30B-A3B-AWQ': an MoE checkpoint quantised to INT4 must be GPTQ for the "
    "llm-scaler image (only GPTQ checkpoints get a quantised method for the MoE layers), got "
    "awq; use a GPTQ-Int4 checkpoint of Qwen3-30B-A3B-AWQ"
)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {**CODER, "name": "Qwen3-30B-A3B-AWQ", "quantization": "awq"},
            MOE_AWQ_MESSAGE,
        ),
        (
            {**QWEN25_7B, "quantization": "awq", "bits": 4, "online_quantization": "fp8"},
            "model 'Qwen2.5-7B-Instruct'.online_quantization: awq is a pre-quantised checkpoint "
            "that vLLM detects from its config; do not pass --quantization for it (set "
            "online_quantization: null)",
        ),
        (
            {**QWEN25_7B, "online_quantization": "int8"},
            "model 'Qwen2.5-7B-Instruct'.online_quantization: 'int8' is not one of fp8, "
            "sym_int4 (or null)",
        ),
        (
            {**QWEN25_7B, "family": "llama3"},
            "vllm_model: Qwen2.5-7B-Instruct has no tool_call_parser (and no family with a "
            "known one); set tool_call_parser in its catalog entry (vllm_model_catalog_extra), "
            "or set vllm_enable_tool_calls: false",
        ),
        (
            {**QWEN25_7B, "quantization": "gptq", "bits": 16},
            "model 'Qwen2.5-7B-Instruct'.bits: 16 does not match quantization gptq (expected "
            "4 or 8)",
        ),
        (
            {**QWEN25_7B, "quantization": "int4"},
            "model 'Qwen2.5-7B-Instruct'.quantization: 'int4' is not one of awq, fp8, gptq, none",
        ),
        (
            {**QWEN25_7B, "tool_call_parser": "Hermes Parser"},
            "model 'Qwen2.5-7B-Instruct'.tool_call_parser: 'Hermes Parser' is not a vLLM parser "
            "name (e.g. hermes, qwen3_coder)",
        ),
        (
            {**QWEN25_7B, "native_ctx": 32768},
            "model 'Qwen2.5-7B-Instruct': unknown field(s) native_ctx; known fields are bits, "
            "family, hf_repo, host_memory, kv_bytes_per_token, moe, name, native_context, notes, "
            "online_quantization, path, quantization, runtime_overhead, served_name, "
            "tool_call_parser, weights, yarn_max_factor, yarn_supported",
        ),
        (
            {k: v for k, v in QWEN25_7B.items() if k not in {"moe", "host_memory"}},
            "model 'Qwen2.5-7B-Instruct': missing field(s) moe, host_memory",
        ),
        (
            {**QWEN25_7B, "yarn_supported": "yes"},
            "model 'Qwen2.5-7B-Instruct'.yarn_supported: expected true or false, got 'yes'",
        ),
        (
            {**QWEN25_7B, "native_context": 0},
            "model 'Qwen2.5-7B-Instruct'.native_context: expected a positive whole number, got 0",
        ),
        (
            {**QWEN25_7B, "yarn_max_factor": 1},
            "model 'Qwen2.5-7B-Instruct'.yarn_max_factor: 1 must be above 1 (or null for no "
            "documented limit)",
        ),
        (
            {**NO_YARN, "yarn_max_factor": 4.0},
            "model 'short'.yarn_max_factor: set only for a model with yarn_supported: true",
        ),
        (
            {**QWEN25_7B, "path": "../etc"},
            "model 'Qwen2.5-7B-Instruct'.path: '../etc' must be relative to the container's "
            "model root (vllm_container_model_root), without '..'",
        ),
        (
            {**QWEN25_7B, "name": "bad name"},
            "vllm_model: 'bad name' is not a usable model name; use letters, digits, '.', '_' "
            "and '-', e.g. Qwen2.5-7B-Instruct",
        ),
        (
            "Qwen2.5-7B-Instruct",
            "model: expected a catalog entry (a mapping, e.g. from vllm_model_entry), got a string",
        ),
    ],
)
def test_model_rules_refuse(model: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_model_args(model, True)
    assert _message(err) == message


def test_model_spec_fills_defaults() -> None:
    spec = model_spec("Qwen2.5-7B-Instruct", {k: v for k, v in QWEN25_7B.items() if k != "name"})
    assert isinstance(spec, ModelSpec)
    assert spec.path == "Qwen2.5-7B-Instruct"
    assert spec.served_name == "Qwen2.5-7B-Instruct"
    assert spec.tool_call_parser == "hermes"
    assert spec.host_memory_bytes == 6 * GIB
    assert spec.source == "vllm_model_catalog['Qwen2.5-7B-Instruct']"


# --------------------------------------------------------------------------- catalog


CATALOG = {
    "Qwen2.5-7B-Instruct": {k: v for k, v in QWEN25_7B.items() if k != "name"},
    "Qwen3-32B-AWQ": {k: v for k, v in QWEN3_32B.items() if k != "name"},
}


@pytest.mark.parametrize(
    ("name", "extra", "field", "expected"),
    [
        ("Qwen2.5-7B-Instruct", None, "host_memory_bytes", 6 * GIB),
        # The extra catalog changes only the fields it gives.
        (
            "Qwen2.5-7B-Instruct",
            {"Qwen2.5-7B-Instruct": {"host_memory": "7GiB"}},
            "host_memory_bytes",
            7 * GIB,
        ),
        (
            "Qwen2.5-7B-Instruct",
            {"Qwen2.5-7B-Instruct": {"host_memory": "7GiB"}},
            "native_context",
            32768,
        ),
        ("mine", {"mine": {**CATALOG["Qwen2.5-7B-Instruct"], "path": "x/y"}}, "path", "x/y"),
    ],
)
def test_resolve_model(name: str, extra: object, field: str, expected: object) -> None:
    assert getattr(resolve_model(name, CATALOG, extra), field) == expected


@pytest.mark.parametrize(
    ("name", "catalog", "extra", "message"),
    [
        (
            "Qwen3-8B",
            CATALOG,
            {},
            "vllm_model: 'Qwen3-8B' is not in vllm_model_catalog or vllm_model_catalog_extra "
            "(known: Qwen2.5-7B-Instruct, Qwen3-32B-AWQ); pick one of those or add an entry "
            "to vllm_model_catalog_extra",
        ),
        (
            "Qwen2.5-7B-Instruct",
            CATALOG,
            {"Qwen2.5-7B-Instruct": {"bits": 3}},
            "vllm_model_catalog_extra['Qwen2.5-7B-Instruct'].bits: 3 does not match "
            "quantization none (expected 16 or 32)",
        ),
        (
            "Qwen2.5-7B-Instruct",
            ["Qwen2.5-7B-Instruct"],
            None,
            "vllm_model_catalog: expected a mapping of model name to entry, got a list",
        ),
        (
            "Qwen2.5-7B-Instruct",
            {"Qwen2.5-7B-Instruct": "Qwen/Qwen2.5-7B-Instruct"},
            None,
            "vllm_model_catalog['Qwen2.5-7B-Instruct']: expected a mapping of model facts, "
            "got a string",
        ),
        (
            None,
            CATALOG,
            None,
            "vllm_model: expected a catalog key, got null",
        ),
    ],
)
def test_resolve_model_refuses(name: object, catalog: object, extra: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        resolve_model(name, catalog, extra)
    assert _message(err) == message


# --------------------------------------------------------------------------- the whole line


def settings(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "vllm_model": "Qwen2.5-7B-Instruct",
        "vllm_model_catalog": CATALOG,
        "vllm_model_catalog_extra": {},
        "vllm_card_memory": "32GiB",
        "vllm_reservations": PLEX,
        "vllm_driver_headroom": "0.8GiB",
        "vllm_gpu_memory_utilization": None,
        "vllm_gpu_memory_utilization_max": 0.95,
        "vllm_context_target": 65536,
        "vllm_memory_limit": "16g",
        "vllm_listen_address": "0.0.0.0",
        "vllm_port": 8000,
        "vllm_container_model_root": "/llm/models",
        "vllm_dtype": None,
        "vllm_enable_tool_calls": True,
        "vllm_extra_args": [],
        "vllm_image": "intel/llm-scaler-vllm:0.21.0-b2",
        "vllm_image_transformers": None,
        "vllm_model_config": QWEN25_7B_CONFIG,
    }
    base.update(changes)
    return base


SEED_ARGS = [
    "/llm/models/Qwen2.5-7B-Instruct",
    "--served-model-name",
    "Qwen2.5-7B-Instruct",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--gpu-memory-utilization",
    "0.85",
    "--max-model-len",
    "65536",
    "--hf-overrides",
    '{"rope_parameters":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":32768,'
    '"rope_theta":1000000.0},"max_position_embeddings":65536}',
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, SEED_ARGS),
        (
            {"vllm_dtype": "float16", "vllm_extra_args": ["--enforce-eager", "--block-size", 64]},
            [*SEED_ARGS, "--dtype", "float16", "--enforce-eager", "--block-size", "64"],
        ),
        (
            {
                "vllm_model": "Qwen3-32B-AWQ",
                "vllm_context_target": 32768,
                "vllm_enable_tool_calls": False,
                "vllm_gpu_memory_utilization": 0.8,
                "vllm_port": 8001,
                "vllm_container_model_root": "/models/",
            },
            [
                "/models/Qwen3-32B-AWQ",
                "--served-model-name",
                "Qwen3-32B-AWQ",
                "--host",
                "0.0.0.0",
                "--port",
                "8001",
                "--gpu-memory-utilization",
                "0.80",
                "--max-model-len",
                "32768",
            ],
        ),
        (
            {
                "vllm_model_catalog_extra": {
                    "Qwen2.5-7B-Instruct": {"online_quantization": "fp8", "served_name": "qwen"}
                },
                "vllm_context_target": 16384,
            },
            [
                "/llm/models/Qwen2.5-7B-Instruct",
                "--served-model-name",
                "qwen",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--gpu-memory-utilization",
                "0.85",
                "--max-model-len",
                "16384",
                "--quantization",
                "fp8",
                "--enable-auto-tool-choice",
                "--tool-call-parser",
                "hermes",
            ],
        ),
    ],
)
def test_vllm_serve_args(changes: dict[str, object], expected: list[str]) -> None:
    assert vllm_serve_args(settings(**changes)) == expected


# Every number of the settings as -e gives it (strings): the same plan as the numbers.
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"vllm_gpu_memory_utilization": 0.8},
        {"vllm_model": "Qwen3-32B-AWQ", "vllm_context_target": 32768},
    ],
)
def test_vllm_plan_reads_numeric_strings(changes: dict[str, object]) -> None:
    numbers = settings(**changes)
    numbers["vllm_reservations"] = [{**PLEX[0], "count": 2}]
    strings = {
        **numbers,
        "vllm_gpu_memory_utilization_max": str(numbers["vllm_gpu_memory_utilization_max"]),
        "vllm_context_target": str(numbers["vllm_context_target"]),
        "vllm_port": str(numbers["vllm_port"]),
        "vllm_reservations": [{**PLEX[0], "count": "2"}],
    }
    if numbers["vllm_gpu_memory_utilization"] is not None:
        strings["vllm_gpu_memory_utilization"] = str(numbers["vllm_gpu_memory_utilization"])
    assert vllm_plan(strings) == vllm_plan(numbers)


def test_vllm_plan_carries_the_computed_values() -> None:
    plan = vllm_plan(settings())
    assert plan["args"] == SEED_ARGS
    assert plan["gpu_memory_utilization"] == 0.85
    assert plan["memory_limit_bytes"] == 16 * GIB
    context = plan["context"]
    assert isinstance(context, dict)
    assert context["yarn_factor"] == 2.0
    model = plan["model"]
    assert isinstance(model, dict)
    assert model["name"] == "Qwen2.5-7B-Instruct"
    assert model["host_memory"] == 6 * GIB


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"vllm_model": "Qwen3-32B-AWQ", "vllm_memory_limit": "8G"},
            "vllm_memory_limit: 8 GiB is below what Qwen3-32B-AWQ needs on the host: about "
            "12 GiB plus a margin of 25% (at least 2 GiB) makes 15 GiB; raise "
            f"vllm_memory_limit to '15g' or more. {SEED_MEMORY_LESSON}",
        ),
        (
            {"vllm_context_target": 262144},
            "vllm_context_target: 262144 tokens needs a YaRN factor of 8 over "
            "Qwen2.5-7B-Instruct's native 32768, above the model's maximum 4; lower "
            "vllm_context_target to 131072 or less",
        ),
        (
            {"vllm_gpu_memory_utilization": 0.99},
            "vllm_gpu_memory_utilization: 0.99 is outside (0, 0.95]; set it to null to compute "
            "it from the card and its reservations, or to a share in range",
        ),
        (
            {"vllm_model": "Qwen3-32B"},
            "vllm_model: 'Qwen3-32B' is not in vllm_model_catalog or vllm_model_catalog_extra "
            "(known: Qwen2.5-7B-Instruct, Qwen3-32B-AWQ); pick one of those or add an entry "
            "to vllm_model_catalog_extra",
        ),
        (
            {"vllm_card_memory": "16GiB", "vllm_model": "Qwen3-32B-AWQ"},
            "vllm_model: the weights of Qwen3-32B-AWQ (about 19 GiB) do not fit the 11.2 GiB "
            "vLLM may claim (0.70 of 16 GiB), leaving nothing for the KV cache; pick a smaller "
            "or quantised model, or lower vllm_reservations",
        ),
        (
            {"vllm_extra_args": ["--max-model-len=8192"]},
            "vllm_extra_args[0]: --max-model-len is computed by the role; set "
            "vllm_context_target instead",
        ),
        (
            {"vllm_extra_args": ["--rope-scaling", "{}"]},
            "vllm_extra_args[0]: --rope-scaling is computed by the role; it was removed from "
            "vLLM; YaRN is computed from vllm_context_target",
        ),
        (
            {"vllm_extra_args": "--enforce-eager"},
            "vllm_extra_args: expected a list of strings (one argument each), got a string",
        ),
        ({"vllm_port": 70000}, "vllm_port: expected a TCP port 1-65535, got 70000"),
        ({"vllm_port": "70000"}, "vllm_port: expected a TCP port 1-65535, got 70000"),
        (
            {"vllm_port": "0x1F40"},
            "vllm_port: expected a TCP port 1-65535, got '0x1F40', which is not a decimal "
            "number; give a whole number such as 8000",
        ),
        (
            {"vllm_gpu_memory_utilization": "lots"},
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got 'lots', which is not a decimal number; give a decimal number such as 0.85",
        ),
        (
            {"vllm_gpu_memory_utilization": "nan"},
            "vllm_gpu_memory_utilization: expected null (computed) or a number in (0, 0.95], "
            "got 'nan', which is not a decimal number; give a decimal number such as 0.85",
        ),
        (
            {"vllm_context_target": "1e400"},
            "vllm_context_target: expected a whole number of tokens, got '1e400', which is out "
            "of range; give a whole number such as 65536",
        ),
        (
            {"vllm_gpu_memory_utilization_max": ""},
            "vllm_gpu_memory_utilization_max: expected a number in (0, 1], got '', which is not "
            "a decimal number; give a decimal number such as 0.95",
        ),
        (
            {"vllm_dtype": "fp16"},
            "vllm_dtype: 'fp16' is not one of auto, bfloat16, float, float16, float32, half "
            "(or null to let vLLM choose)",
        ),
        (
            {"vllm_enable_tool_calls": "yes"},
            "vllm_enable_tool_calls: expected true or false, got 'yes'",
        ),
        (
            {"vllm_listen_address": ""},
            "vllm_listen_address: expected a non-empty string without spaces (e.g. 0.0.0.0), "
            "got ''",
        ),
        (
            {"vllm_container_model_root": "llm/models"},
            "vllm_container_model_root: expected an absolute path inside the container (e.g. "
            "/llm/models), got 'llm/models'",
        ),
        (
            {"vllm_reservations": [{"name": "plex", "bytes": "40GiB"}]},
            "vllm_reservations: the reservations add up to 40 GiB (plex 1 x 40 GiB), more than "
            "the card's 32 GiB (vllm_card_memory); lower the reservations or correct "
            "vllm_card_memory",
        ),
    ],
)
def test_vllm_plan_refuses(changes: dict[str, object], message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_plan(settings(**changes))
    assert _message(err) == message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            ["vllm_model"],
            "settings: expected a mapping of the vllm role's variables, got a list",
        ),
        (
            {"vllm_model": "Qwen2.5-7B-Instruct"},
            "settings: missing vllm_model_catalog, vllm_model_catalog_extra, vllm_card_memory, "
            "vllm_reservations, vllm_driver_headroom, vllm_gpu_memory_utilization, "
            "vllm_gpu_memory_utilization_max, vllm_context_target, vllm_memory_limit, "
            "vllm_listen_address, vllm_port, vllm_container_model_root, vllm_dtype, "
            "vllm_enable_tool_calls, vllm_extra_args, vllm_image, vllm_image_transformers; pass "
            "every variable the role defines in its defaults",
        ),
    ],
)
def test_vllm_plan_refuses_bad_settings(value: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        vllm_plan(value)
    assert _message(err) == message


# --------------------------------------------------------------------------- compose


@pytest.mark.parametrize(
    ("image", "mode", "expected"),
    [
        (
            "intel/llm-scaler-vllm:0.21.0-b2",
            "auto",
            {"mode": "command", "entrypoint": None, "command": SEED_ARGS},
        ),
        (
            "intel/llm-scaler-vllm:0.21.0-b2",
            "entrypoint",
            {
                "mode": "entrypoint",
                "entrypoint": [
                    "bash",
                    "-c",
                    "source /opt/intel/oneapi/setvars.sh --force && exec vllm serve "
                    "/llm/models/Qwen2.5-7B-Instruct --served-model-name Qwen2.5-7B-Instruct "
                    "--host 0.0.0.0 --port 8000 --gpu-memory-utilization 0.85 --max-model-len "
                    '65536 --hf-overrides \'{"rope_parameters":{"rope_type":"yarn","factor"'
                    ':2.0,"original_max_position_embeddings":32768,"rope_theta":1000000.0},'
                    '"max_position_embeddings":65536}\' '
                    "--enable-auto-tool-choice --tool-call-parser hermes",
                ],
                "command": None,
            },
        ),
    ],
)
def test_compose_command(image: str, mode: str, expected: dict[str, object]) -> None:
    assert compose_command(SEED_ARGS, image, mode) == expected


@pytest.mark.parametrize(
    ("image", "mode"),
    [
        ("intel/llm-scaler-vllm:0.14.0-b8.3.1", "auto"),
        ("registry.example:5000/intel/llm-scaler-vllm:0.14.0-b8.3.1", "auto"),
        ("intel/llm-scaler-vllm:0.21.0-b2", "entrypoint"),
        ("intel/llm-scaler-vllm:0.14.0-b8.3.1@sha256:" + "0" * 64, "auto"),
    ],
)
def test_compose_command_entrypoint_mode(image: str, mode: str) -> None:
    result = compose_command(["/llm/models/m", "--port", "8000"], image, mode)
    assert result["mode"] == "entrypoint"
    assert result["command"] is None
    assert result["entrypoint"] == [
        "bash",
        "-c",
        "source /opt/intel/oneapi/setvars.sh --force && exec vllm serve /llm/models/m --port 8000",
    ]


@pytest.mark.parametrize(
    ("args", "image", "mode", "message"),
    [
        (
            [],
            "intel/llm-scaler-vllm:latest",
            "auto",
            "vllm_image: 'intel/llm-scaler-vllm:latest' has no pinned tag; pin a release such "
            "as intel/llm-scaler-vllm:0.21.0-b2 (Intel asks not to use latest)",
        ),
        (
            [],
            "registry.example:5000/intel/llm-scaler-vllm",
            "auto",
            "vllm_image: 'registry.example:5000/intel/llm-scaler-vllm' has no pinned tag; pin a "
            "release such as intel/llm-scaler-vllm:0.21.0-b2 (Intel asks not to use latest)",
        ),
        (
            [],
            "intel/llm-scaler-vllm:0.21.0-b2",
            "shell",
            "vllm_image_entrypoint_mode: 'shell' is not one of auto, command, entrypoint",
        ),
        (
            "--port 8000",
            "intel/llm-scaler-vllm:0.21.0-b2",
            "auto",
            "args: expected a list of strings, got a string",
        ),
        (
            [],
            "",
            "auto",
            "vllm_image: expected an image reference such as intel/llm-scaler-vllm:0.21.0-b2, "
            "got ''",
        ),
    ],
)
def test_compose_command_refuses(args: object, image: object, mode: object, message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        compose_command(args, image, mode)
    assert _message(err) == message
