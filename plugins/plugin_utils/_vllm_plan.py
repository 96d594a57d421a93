# Copyright: contributors to cardshare.gpuhost
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ``vllm`` role's plans: the whole ``vllm serve`` line and the ladder (pure functions,
no I/O).

The values the source write-up tuned by hand are derived from the card, its other tenants
and a model catalog entry, and refused with a message that names the role variable, the bad
value and the fix.  This module puts them together:

* the whole ordered ``vllm serve`` argument list (:func:`vllm_serve_args`, :func:`vllm_plan`);
* the ladder of plans the arbiter starts vLLM on: the full plan, then plans with a shorter
  context and less of the card down to ``vllm_context_floor`` (:func:`vllm_plan_ladder`);
* how Compose hands the arguments to the image (:func:`compose_command`).

Its parts, each in a module of its own: sizes and numbers (``_vllm_inputs``),
``--gpu-memory-utilization`` (``_vllm_utilization``), the model catalog, the host-memory cap
and the per-model arguments (``_vllm_models``), the context window with YaRN
(``_vllm_context``).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from fractions import Fraction
from itertools import chain

from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_context import (
    MIN_CONTEXT_TOKENS,
    _check_target,
    vllm_context,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import (
    VllmTuningError,
    VllmTypeError,
    _type_name,
    human_size,
    parse_number,
    parse_size,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_models import (
    ModelSpec,
    resolve_model,
    vllm_memory_cap,
    vllm_model_args,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_utilization import (
    gpu_memory_utilization,
)

__all__ = [
    "ENTRYPOINT_MODES",
    "KNOWN_DTYPES",
    "LADDER_SETTINGS_KEYS",
    "MANAGED_FLAGS",
    "SETTINGS_KEYS",
    "compose_command",
    "vllm_plan",
    "vllm_plan_ladder",
    "vllm_serve_args",
    "weights_per_card",
]

KNOWN_DTYPES = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})
ENTRYPOINT_MODES = frozenset({"auto", "command", "entrypoint"})
# Flags the role computes; ``vllm_extra_args`` may not set them.
MANAGED_FLAGS: dict[str, str] = {
    "--model": "the model is chosen with vllm_model",
    "--served-model-name": "the served name comes from the catalog entry (served_name)",
    "--host": "set vllm_listen_address instead",
    "--port": "set vllm_port instead",
    "--api-key": "set vllm_api_key_file instead (the key stays off the command line)",
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


def _tensor_parallel_size(conf: Mapping[str, object]) -> int:
    """The pool's size the plan is for (``vllm_tensor_parallel_size``, set by the pool's
    filters; 1, one card, when absent)."""
    value = conf.get("vllm_tensor_parallel_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VllmTuningError(
            f"vllm_tensor_parallel_size is {value!r}: expected the pool's size, a whole number "
            "of cards, 1 or more; the xe_driver role publishes the pool from "
            "xe_driver_card_jobs"
        )
    return value


def weights_per_card(spec: ModelSpec, size: int) -> int | None:
    """What one card of a pool of ``size`` holds of the model's weights.

    Under tensor parallelism vLLM shards every parallel layer across the ranks: the attention
    and MLP projections (``ColumnParallelLinear``/``RowParallelLinear``) and the embeddings and
    LM head too (``VocabParallelEmbedding``/``ParallelLMHead``, padded to divide by the TP
    size), per vLLM's ``vllm/model_executor/layers/linear.py`` and
    ``vocab_parallel_embedding.py``; only the small norms are kept whole on every rank.  So a
    card holds about 1/size of the weights, rounded up.  What each rank keeps besides
    (activations, graphs, the sampler's buffers) is ``runtime_overhead``, counted whole on
    every card.
    """
    if spec.weights_bytes is None:
        return None
    return -(-spec.weights_bytes // size)


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
    Over a pool (``vllm_tensor_parallel_size`` above 1) each card's share holds its shard of
    the weights (:func:`weights_per_card`).
    """
    size = _tensor_parallel_size(conf)
    weights = weights_per_card(spec, size)
    if weights is not None:
        share = int(card * Fraction(str(utilization)))
        if weights >= share:
            shard = "" if size == 1 else f", {human_size(weights)} on each of {size} cards"
            raise VllmTuningError(
                f"vllm_model: the weights of {spec.name} (about "
                f"{human_size(spec.weights_bytes or 0)}{shard}) do not fit the "
                f"{human_size(share)} vLLM may claim ({utilization:.2f} of {human_size(card)}), "
                "leaving nothing for the KV cache; pick a smaller or quantised model, or lower "
                "vllm_reservations"
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

    where ``weights`` is one card's shard over a pool (:func:`weights_per_card`; the KV term
    is kept whole, an upper bound where the KV heads split across the ranks too)
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
    weights = weights_per_card(spec, _tensor_parallel_size(conf))
    if spec.kv_bytes_per_token is None or weights is None:
        return ladder

    # target - step, target - 2 * step, ... while above the floor, then the floor itself
    contexts = chain(range(target - step, floor, -step), [floor] if floor < target else [])
    previous = Fraction(str(utilization))
    for context in contexts:
        need = weights + spec.runtime_overhead_bytes + spec.kv_bytes_per_token * context * sequences
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
