# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``vllm`` role's context window (pure functions, no I/O).

Static YaRN is passed through ``--hf-overrides`` when the target exceeds the model's native
window, written so that it starts under vLLM's rules before and since vllm-project/vllm PR
#56446 and carries the model's own RoPE settings in the key the image's transformers reads
(:func:`vllm_context`, :func:`start_window`, :func:`image_transformers`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
    _finite,
    _type_name,
    parse_number,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    ModelSpec,
    _as_spec,
)

__all__ = [
    "KNOWN_IMAGE_TRANSFORMERS",
    "MIN_CONTEXT_TOKENS",
    "TRANSFORMERS_ROPE_KEYS",
    "VLLM_LENGTH_KEYS",
    "VLLM_START_RULES",
    "apply_overrides",
    "image_transformers",
    "known_image_transformers",
    "start_window",
    "vllm_context",
]

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
