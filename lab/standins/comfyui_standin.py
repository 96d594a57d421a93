"""SIMULATION: a stand-in for ComfyUI 0.8 (FLUX.1 Kontext) in the cardshare lab.

This is not ComfyUI and runs no model.  It speaks ComfyUI's HTTP API, with ComfyUI's
semantics where a client can observe them, for the arbiter and the roles:

* ``POST /prompt {prompt, client_id[, prompt_id, number, front, extra_data,
  partial_execution_targets]}`` validates the API-format graph as ComfyUI 0.8 does and
  answers ``{prompt_id, number, node_errors}`` or 400 ``{error, node_errors}``: unknown
  ``class_type`` (``invalid_prompt``), missing required inputs, linked output types
  (``return_type_mismatch``), links to nodes that do not exist (an exception during
  validation), number conversion and ranges, list values such as ``ckpt_name`` among the
  files under ``<base>/models``, and ``LoadImage``'s own check (``custom_validation_failed``,
  "Invalid image file: ...").  A body that is not JSON gets aiohttp's plain-text 500;
* a PromptQueue: one worker; a prompt moves from the pending queue to "running" and from
  "running" into the history each in one step under one lock, so it is always in exactly
  one of the three; the history lives in memory only (a restarted server has none);
* jobs take ``STANDIN_JOB_SECONDS`` (default 2) for the default 20 sampling steps, in
  proportion to the KSampler's ``steps`` (more steps, a longer job, as on a real card), and
  then every save node (any output node
  with a ``filename_prefix`` input, e.g. ``SaveImage``) writes real PNGs named as ComfyUI
  names them: ``<subfolder>/<name>_<counter:05>_.png``, one per batch image, the counter
  continuing after the highest existing file of that prefix; ``PreviewImage`` writes to the
  temp directory (``type: temp``);
* ``GET /history[/<id>]`` (``{}`` for an id it does not know), ``GET /view`` (400/403 on
  path escapes, 404 when missing, as ComfyUI), ``GET/POST /queue`` (``clear``, ``delete``),
  ``POST /interrupt`` (optionally ``{"prompt_id"}``: only that prompt, if it is running;
  its history then says ``execution_interrupted``), ``GET /object_info[/<class>]``,
  ``GET /system_stats`` (VRAM of the simulated card), ``POST /upload/image`` (multipart),
  ``POST /free`` (answers at once, frees after ``STANDIN_FREE_DELAY`` seconds, default 3);
* the first job "loads" the model: if the simulated card has less free VRAM than
  ``STANDIN_MODEL_VRAM_BYTES`` (default 20 GiB, FLUX.1 Kontext fp8) the job fails with an
  out-of-memory ``execution_error``; otherwise the stand-in registers on the card with that
  VRAM and ``ccs``/``rcs`` cycles advance while jobs run, until ``/free`` or exit.

Stand-in only (not ComfyUI API; for test harnesses): every execution is appended to a
JSON-lines file (``STANDIN_EXECUTIONS_FILE``, default ``<output>/.standin-executions.jsonl``)
and ``GET /standin/executions[?by=prompt_id|filename_prefix][&outcome=...]`` counts them
from that file, so duplicates across restarts show.  Latency knobs to make races
reproducible: ``STANDIN_QUEUE_LATENCY_MS`` (``GET /queue``, ``GET /prompt``),
``STANDIN_HISTORY_LATENCY_MS`` (``GET /history``), ``STANDIN_AFTER_SAVE_MS`` (files on disk,
prompt still running).

Command line (subset of ComfyUI's ``main.py``): ``--listen [ADDR]``, ``--port``,
``--base-directory``, ``--output-directory``, ``--input-directory`` and a few performance
flags that are accepted and ignored.  Unknown flags exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import email.parser
import email.policy
import hashlib
import json
import mimetypes
import os
import random
import shutil
import signal
import string
import struct
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import SimClient
from standin_http import BadChunkedBody, Handler, StandinServer, read_chunked, serve_in_thread

__all__ = [
    "NODE_CLASSES",
    "ComfyServer",
    "ComfyState",
    "NodeClass",
    "build_parser",
    "count_executions",
    "main",
    "make_png",
    "object_info",
    "save_image_path",
    "validate_prompt",
]

VERSION = "0.8.0+standin (SIMULATION)"
DEVICE_NAME = "xpu:0 Intel(R) Arc(TM) Pro B70 (SIMULATION) : native"
GIB = 1024**3
IMAGE_SIZE = (64, 40)
SAMPLERS = ["euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde", "ddim", "uni_pc"]
SCHEDULERS = ["normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta"]
MODEL_FOLDERS: Mapping[str, tuple[str, ...]] = {
    "checkpoints": ("checkpoints",),
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
}
EXECUTIONS_FILE = ".standin-executions.jsonl"
# aiohttp's answer when a handler raises (ComfyUI's /prompt on a body that is not JSON)
INTERNAL_ERROR = b"500 Internal Server Error\n\nServer got itself in trouble"
STANDIN_ONLY = {"X-Cardshare-Simulation": "stand-in only endpoint, not part of ComfyUI's API"}


@dataclass(frozen=True, slots=True)
class NodeClass:
    """A node class as ``/object_info`` describes it.

    Input specs: ``("INT", {...})`` for a typed input, ``("@folder", {...})`` for a list of
    model files from a folder key of :data:`MODEL_FOLDERS`, ``("@input", {})`` for the
    files in the input directory, ``(["a", "b"], {})`` for a fixed list.
    """

    name: str
    category: str
    required: Mapping[str, tuple[Any, dict[str, Any]]]
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    optional: Mapping[str, tuple[Any, dict[str, Any]]] = field(default_factory=dict)
    output_node: bool = False
    display_name: str = ""


def _int(default: int, lo: int, hi: int) -> tuple[str, dict[str, Any]]:
    return ("INT", {"default": default, "min": lo, "max": hi})


def _float(default: float, lo: float, hi: float) -> tuple[str, dict[str, Any]]:
    return ("FLOAT", {"default": default, "min": lo, "max": hi})


NODE_CLASSES: Mapping[str, NodeClass] = {
    n.name: n
    for n in (
        NodeClass(
            "CheckpointLoaderSimple",
            "loaders",
            {"ckpt_name": ("@checkpoints", {})},
            ("MODEL", "CLIP", "VAE"),
            ("MODEL", "CLIP", "VAE"),
            display_name="Load Checkpoint",
        ),
        NodeClass(
            "UNETLoader",
            "advanced/loaders",
            {
                "unet_name": ("@diffusion_models", {}),
                "weight_dtype": (["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"], {}),
            },
            ("MODEL",),
            ("MODEL",),
            display_name="Load Diffusion Model",
        ),
        NodeClass(
            "DualCLIPLoader",
            "advanced/loaders",
            {
                "clip_name1": ("@text_encoders", {}),
                "clip_name2": ("@text_encoders", {}),
                "type": (["sdxl", "sd3", "flux", "hunyuan_video", "hidream"], {}),
            },
            ("CLIP",),
            ("CLIP",),
        ),
        NodeClass(
            "VAELoader",
            "loaders",
            {"vae_name": ("@vae", {})},
            ("VAE",),
            ("VAE",),
            display_name="Load VAE",
        ),
        NodeClass(
            "CLIPTextEncode",
            "conditioning",
            {"text": ("STRING", {"multiline": True}), "clip": ("CLIP", {})},
            ("CONDITIONING",),
            ("CONDITIONING",),
            display_name="CLIP Text Encode (Prompt)",
        ),
        NodeClass(
            "ConditioningZeroOut",
            "advanced/conditioning",
            {"conditioning": ("CONDITIONING", {})},
            ("CONDITIONING",),
            ("CONDITIONING",),
        ),
        NodeClass(
            "FluxGuidance",
            "advanced/conditioning/flux",
            {"conditioning": ("CONDITIONING", {}), "guidance": _float(3.5, 0.0, 100.0)},
            ("CONDITIONING",),
            ("CONDITIONING",),
        ),
        NodeClass(
            "ReferenceLatent",
            "advanced/conditioning/edit_models",
            {"conditioning": ("CONDITIONING", {})},
            ("CONDITIONING",),
            ("CONDITIONING",),
            optional={"latent": ("LATENT", {})},
        ),
        NodeClass(
            "FluxKontextImageScale",
            "advanced/conditioning/flux",
            {"image": ("IMAGE", {})},
            ("IMAGE",),
            ("IMAGE",),
        ),
        NodeClass(
            "EmptyLatentImage",
            "latent",
            {
                "width": _int(1024, 16, 16384),
                "height": _int(1024, 16, 16384),
                "batch_size": _int(1, 1, 4096),
            },
            ("LATENT",),
            ("LATENT",),
            display_name="Empty Latent Image",
        ),
        NodeClass(
            "KSampler",
            "sampling",
            {
                "model": ("MODEL", {}),
                "seed": _int(0, 0, 0xFFFFFFFFFFFFFFFF),
                "steps": _int(20, 1, 10000),
                "cfg": _float(8.0, 0.0, 100.0),
                "sampler_name": (SAMPLERS, {}),
                "scheduler": (SCHEDULERS, {}),
                "positive": ("CONDITIONING", {}),
                "negative": ("CONDITIONING", {}),
                "latent_image": ("LATENT", {}),
                "denoise": _float(1.0, 0.0, 1.0),
            },
            ("LATENT",),
            ("LATENT",),
        ),
        NodeClass(
            "VAEDecode",
            "latent",
            {"samples": ("LATENT", {}), "vae": ("VAE", {})},
            ("IMAGE",),
            ("IMAGE",),
            display_name="VAE Decode",
        ),
        NodeClass(
            "VAEEncode",
            "latent",
            {"pixels": ("IMAGE", {}), "vae": ("VAE", {})},
            ("LATENT",),
            ("LATENT",),
            display_name="VAE Encode",
        ),
        NodeClass(
            "LoadImage",
            "image",
            {"image": ("@input", {"image_upload": True})},
            ("IMAGE", "MASK"),
            ("IMAGE", "MASK"),
            display_name="Load Image",
        ),
        NodeClass(
            "SaveImage",
            "image",
            {"images": ("IMAGE", {}), "filename_prefix": ("STRING", {"default": "ComfyUI"})},
            output_node=True,
            display_name="Save Image",
        ),
        NodeClass(
            "PreviewImage",
            "image",
            {"images": ("IMAGE", {})},
            output_node=True,
            display_name="Preview Image",
        ),
    )
}


# --------------------------------------------------------------------------- PNG


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def make_png(
    seed_text: str,
    width: int = IMAGE_SIZE[0],
    height: int = IMAGE_SIZE[1],
    text: Mapping[str, str] | None = None,
) -> bytes:
    """A real 8-bit RGB PNG whose pattern is derived from ``seed_text`` (deterministic)."""
    digest = hashlib.sha256(seed_text.encode()).digest()
    a, b = digest[0:3], digest[3:6]
    stripe = 4 + digest[6] % 8
    rows = bytearray()
    for y in range(height):
        rows.append(0)  # filter type: none
        for x in range(width):
            t = (x + y) / (width + height)
            mix = 1.0 if ((x + digest[7]) // stripe + y // stripe) % 2 else 0.6
            for channel in range(3):
                rows.append(int((a[channel] * (1 - t) + b[channel] * t) * mix) & 0xFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = [_png_chunk(b"IHDR", header)]
    for key, value in (text or {}).items():
        chunks.append(
            _png_chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1", "replace"))
        )
    chunks.append(_png_chunk(b"IDAT", zlib.compress(bytes(rows), 9)))
    chunks.append(_png_chunk(b"IEND", b""))
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


# --------------------------------------------------------------------------- validation


def _list_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    )


def _input_images(folder: Path) -> list[str]:
    """The files ``LoadImage`` offers: image files directly in the input directory."""
    if not folder.is_dir():
        return []
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and (mimetypes.guess_type(p.name)[0] or "").startswith("image/")
    )


@dataclass(frozen=True, slots=True)
class Dirs:
    base: Path
    output: Path
    input: Path
    temp: Path

    def model_files(self, key: str) -> list[str]:
        names: list[str] = []
        for folder in MODEL_FOLDERS[key]:
            names.extend(_list_files(self.base / "models" / folder))
        return sorted(set(names))

    def by_type(self, kind: str) -> Path | None:
        """ComfyUI's ``get_directory_by_type``: ``output``, ``input``, ``temp`` or nothing."""
        return {"output": self.output, "input": self.input, "temp": self.temp}.get(kind)

    def annotated(self, name: str) -> tuple[str, Path | None]:
        """A name with a ``[output]``/``[input]``/``[temp]`` suffix names its directory."""
        for kind in ("output", "input", "temp"):
            suffix = f"[{kind}]"
            if name.endswith(suffix):
                return name[: -len(suffix) - 1], self.by_type(kind)
        return name, None


def _choices(spec: Any, dirs: Dirs) -> list[str] | None:
    if isinstance(spec, list):
        return spec
    if spec == "@input":
        return _input_images(dirs.input)
    if isinstance(spec, str) and spec.startswith("@"):
        return dirs.model_files(spec[1:])
    return None


def object_info(dirs: Dirs) -> dict[str, Any]:
    """``GET /object_info``: every node class with its inputs and outputs."""
    info: dict[str, Any] = {}
    for node in NODE_CLASSES.values():

        def render(specs: Mapping[str, tuple[Any, dict[str, Any]]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, (kind, options) in specs.items():
                choices = _choices(kind, dirs)
                out[name] = (
                    [choices if choices is not None else kind, options]
                    if options
                    else [choices if choices is not None else kind]
                )
            return out

        inputs: dict[str, Any] = {"required": render(node.required)}
        if node.optional:
            inputs["optional"] = render(node.optional)
        info[node.name] = {
            "input": inputs,
            "input_order": {
                k: list(v)
                for k, v in (("required", node.required), ("optional", node.optional))
                if v
            },
            "output": list(node.outputs),
            "output_is_list": [False] * len(node.outputs),
            "output_name": list(node.output_names or node.outputs),
            "name": node.name,
            "display_name": node.display_name or node.name,
            "description": "",
            "python_module": "nodes",
            "category": node.category,
            "output_node": node.output_node,
        }
    return info


def _error(
    kind: str, message: str, details: str = "", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"type": kind, "message": message, "details": details, "extra_info": extra or {}}


def _type_name(exc: BaseException) -> str:
    """``full_type_name``: ``KeyError`` for builtins, ``module.Class`` otherwise."""
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _types_match(received: Any, wanted: Any) -> bool:
    """A linked output fits an input: same type, ``*``, or a shared member of a ``A,B`` union."""
    if received == wanted:
        return True
    if not isinstance(received, str) or not isinstance(wanted, str):
        return False
    got = {t.strip() for t in received.split(",")}
    want = {t.strip() for t in wanted.split(",")}
    return "*" in got or "*" in want or bool(got & want)


def _convert(kind: Any, value: Any) -> Any:
    if kind == "INT":
        return int(value)
    if kind == "FLOAT":
        return float(value)
    if kind == "STRING":
        return str(value)
    if kind == "BOOLEAN":
        return bool(value)
    return value


def _check_load_image(value: Any, dirs: Dirs) -> bool | str:
    """``LoadImage``'s own input check: the file must exist (an annotated name picks the dir)."""
    name, base = dirs.annotated(str(value))
    if os.path.exists(os.path.join(base or dirs.input, name)):
        return True
    return f"Invalid image file: {value}"


# Node classes whose inputs are checked by the class itself instead of the list check
CUSTOM_CHECKS: Mapping[str, Mapping[str, Callable[[Any, Dirs], bool | str]]] = {
    "LoadImage": {"image": _check_load_image},
}

Validated = dict[Any, tuple[bool, list[dict[str, Any]], Any]]


def _validate_node(
    prompt: Any, node_id: Any, validated: Validated, dirs: Dirs
) -> tuple[bool, list[dict[str, Any]], Any]:
    """One node and, through its links, everything upstream (ComfyUI's ``validate_inputs``).

    Looking up a linked node or its output slot raises (``KeyError`` for a node that does
    not exist) exactly where ComfyUI raises: the caller that linked here records it as
    ``exception_during_inner_validation`` on this node, ``validate_prompt`` as
    ``exception_during_validation`` when this is the output node itself.
    """
    if node_id in validated:
        return validated[node_id]
    node = prompt[node_id]
    inputs = node["inputs"]
    cls = NODE_CLASSES[node["class_type"]]
    checks = CUSTOM_CHECKS.get(cls.name, {})
    errors: list[dict[str, Any]] = []
    valid = True
    specs = [(n, s, True) for n, s in cls.required.items()]
    specs += [(n, s, False) for n, s in cls.optional.items()]
    for name, (kind, options), required in specs:
        if name not in inputs:
            if required:
                errors.append(
                    _error(
                        "required_input_missing",
                        "Required input is missing",
                        name,
                        {"input_name": name},
                    )
                )
            continue
        value = inputs[name]
        choices = _choices(kind, dirs)
        wanted = choices if choices is not None else kind
        config = [wanted, dict(options)]
        if isinstance(value, list):
            if len(value) != 2:
                errors.append(
                    _error(
                        "bad_linked_input",
                        "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                        name,
                        {"input_name": name, "input_config": config, "received_value": value},
                    )
                )
                continue
            source_id, slot = value
            source = prompt[source_id]  # KeyError when the linked node does not exist
            received = NODE_CLASSES[source["class_type"]].outputs[slot]
            if not _types_match(received, wanted):
                errors.append(
                    _error(
                        "return_type_mismatch",
                        "Return type mismatch between linked nodes",
                        f"{name}, received_type({received}) mismatch input_type({wanted})",
                        {
                            "input_name": name,
                            "input_config": config,
                            "received_type": received,
                            "linked_node": value,
                        },
                    )
                )
                continue
            try:
                upstream_ok = _validate_node(prompt, source_id, validated, dirs)[0]
            except Exception as exc:
                valid = False
                inner = _error(
                    "exception_during_inner_validation",
                    "Exception when validating inner node",
                    str(exc),
                    {
                        "input_name": name,
                        "input_config": config,
                        "exception_message": str(exc),
                        "exception_type": _type_name(exc),
                        "traceback": traceback.format_tb(exc.__traceback__),
                        "linked_node": value,
                    },
                )
                validated[source_id] = (False, [inner], source_id)
                continue
            if not upstream_ok:
                valid = False
            continue
        try:
            value = _convert(kind, value)
        except Exception as exc:
            errors.append(
                _error(
                    "invalid_input_type",
                    f"Failed to convert an input value to a {kind} value",
                    f"{name}, {value}, {exc}",
                    {
                        "input_name": name,
                        "input_config": config,
                        "received_value": value,
                        "exception_message": str(exc),
                    },
                )
            )
            continue
        if name in checks:
            continue
        extra = {"input_name": name, "input_config": config, "received_value": value}
        if "min" in options and value < options["min"]:
            message = f"Value {value} smaller than min of {options['min']}"
            errors.append(_error("value_smaller_than_min", message, name, extra))
            continue
        if "max" in options and value > options["max"]:
            message = f"Value {value} bigger than max of {options['max']}"
            errors.append(_error("value_bigger_than_max", message, name, extra))
            continue
        if choices is not None and value not in choices:
            big = len(choices) > 20
            listed = f"(list of length {len(choices)})" if big else str(choices)
            errors.append(
                _error(
                    "value_not_in_list",
                    "Value not in list",
                    f"{name}: '{value}' not in {listed}",
                    {
                        "input_name": name,
                        "input_config": None if big else config,
                        "received_value": value,
                    },
                )
            )
    for name, check in checks.items():
        if name not in inputs or isinstance(inputs[name], list):
            continue
        verdict = check(inputs[name], dirs)
        if verdict is not True:
            details = name if verdict is False else f"{name} - {verdict}"
            errors.append(
                _error(
                    "custom_validation_failed",
                    "Custom validation failed for node",
                    details,
                    {"input_name": name},
                )
            )
    result = (not errors and valid, errors, node_id)
    validated[node_id] = result
    return result


def validate_prompt(
    prompt: Any, dirs: Dirs, targets: Sequence[Any] | None = None
) -> tuple[dict[str, Any] | None, list[str], dict[str, Any]]:
    """``(error, good_outputs, node_errors)`` as ComfyUI's ``validate_prompt`` reports them.

    A ``prompt`` that is not a mapping of nodes raises (the server answers 500), as in
    ComfyUI.  ``targets`` is ``partial_execution_targets``.  The top-level ``details`` only
    list the output nodes' own errors (ComfyUI's, so upstream errors leave it empty).
    """
    outputs: list[Any] = []
    for node_id in prompt:
        node = prompt[node_id]
        if "class_type" not in node:
            return (
                _error(
                    "invalid_prompt",
                    "Cannot execute because a node is missing the class_type property.",
                    f"Node ID '#{node_id}'",
                ),
                [],
                {},
            )
        class_type = node["class_type"]
        cls = NODE_CLASSES.get(class_type) if isinstance(class_type, str) else None
        if cls is None:
            return (
                _error(
                    "invalid_prompt",
                    f"Cannot execute because node {class_type} does not exist.",
                    f"Node ID '#{node_id}'",
                ),
                [],
                {},
            )
        if cls.output_node and (targets is None or node_id in targets):
            outputs.append(node_id)
    if not outputs:
        return _error("prompt_no_outputs", "Prompt has no outputs"), [], {}
    validated: Validated = {}
    good: list[str] = []
    failures: list[dict[str, Any]] = []
    node_errors: dict[str, Any] = {}
    for output in sorted(outputs, key=str):
        try:
            ok, reasons, _ = _validate_node(prompt, output, validated, dirs)
        except Exception as exc:
            ok = False
            reasons = [
                _error(
                    "exception_during_validation",
                    "Exception when validating node",
                    str(exc),
                    {
                        "exception_type": _type_name(exc),
                        "traceback": traceback.format_tb(exc.__traceback__),
                    },
                )
            ]
            validated[output] = (False, reasons, output)
        if ok:
            good.append(output)
            continue
        failures.extend(reasons)
        # as ComfyUI: every failed node seen so far lists this output as dependent
        for node_id, (node_ok, node_reasons, _) in validated.items():
            if node_ok or not node_reasons:
                continue
            entry = node_errors.setdefault(
                node_id,
                {
                    "errors": node_reasons,
                    "dependent_outputs": [],
                    "class_type": prompt[node_id]["class_type"],
                },
            )
            entry["dependent_outputs"].append(output)
    if not good:
        details = "\n".join(f"{e['message']}: {e['details']}" for e in failures)
        error = _error(
            "prompt_outputs_failed_validation", "Prompt outputs failed validation", details
        )
        return error, [], node_errors
    return None, good, node_errors


# --------------------------------------------------------------------------- jobs


@dataclass(slots=True)
class Job:
    number: float
    prompt_id: str
    prompt: dict[str, Any]
    extra: dict[str, Any]
    outputs: list[str]

    def queue_item(self) -> list[Any]:
        return [self.number, self.prompt_id, self.prompt, self.extra, self.outputs]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _substitute(prefix: str, width: int, height: int) -> str:
    """The ``%width%``-style variables a ``filename_prefix`` may hold."""
    if "%" not in prefix:
        return prefix
    now = time.localtime()
    values = {
        "width": str(width),
        "height": str(height),
        "year": str(now.tm_year),
        "month": f"{now.tm_mon:02d}",
        "day": f"{now.tm_mday:02d}",
        "hour": f"{now.tm_hour:02d}",
        "minute": f"{now.tm_min:02d}",
        "second": f"{now.tm_sec:02d}",
    }
    for key, value in values.items():
        prefix = prefix.replace(f"%{key}%", value)
    return prefix


def save_image_path(
    prefix: str, output_dir: Path, width: int = IMAGE_SIZE[0], height: int = IMAGE_SIZE[1]
) -> tuple[Path, str, int, str]:
    """``(folder, name, first counter, subfolder)`` for a save node's ``filename_prefix``.

    What ComfyUI does: the part of the prefix before its last ``/`` is a subfolder of the
    output directory (leaving it is an error), and the counter continues after the highest
    number among the files named ``<name>_<digits>...`` there (whatever their extension).
    """
    normal = os.path.normpath(_substitute(prefix, width, height))
    subfolder, name = os.path.dirname(normal), os.path.basename(normal)
    root = os.path.abspath(output_dir)
    folder = os.path.join(root, subfolder)
    common = os.path.commonpath((root, os.path.abspath(folder)))
    if common != root:
        raise Exception(
            "**** ERROR: Saving image outside the output folder is not allowed."
            f"\n full_output_folder: {os.path.abspath(folder)}"
            f"\n         output_dir: {root}"
            f"\n         commonpath: {common}"
        )
    try:
        entries = os.listdir(folder)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        entries = []
    numbers = []
    for entry in entries:
        head = entry[: len(name) + 1]
        if os.path.normcase(head[:-1]) != os.path.normcase(name) or not head.endswith("_"):
            continue
        try:
            numbers.append(int(entry[len(name) + 1 :].split("_")[0]))
        except ValueError:
            numbers.append(0)
    counter = max(numbers) + 1 if numbers else 1
    return Path(folder), name, counter, subfolder


def _batch_size(prompt: Mapping[str, Any], node_id: str) -> int:
    """How many images reach a save node: the largest ``EmptyLatentImage`` batch upstream."""
    seen: set[str] = set()
    stack = [node_id]
    size = 1
    while stack:
        current = stack.pop()
        if current in seen or current not in prompt:
            continue
        seen.add(current)
        node = prompt[current]
        inputs = node.get("inputs") or {}
        if node["class_type"] == "EmptyLatentImage":
            with contextlib.suppress(TypeError, ValueError):
                size = max(size, int(inputs.get("batch_size", 1)))
        for value in inputs.values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                stack.append(value[0])
    return size


def count_executions(path: Path, by: str = "prompt_id", outcome: str = "started") -> dict[str, int]:
    """Count the executions logged in ``path`` (stand-in only, for test harnesses).

    ``by``: ``prompt_id`` or ``filename_prefix``; ``outcome``: ``started`` (every execution
    the worker began, also those a restart cut short), ``success``, ``error``,
    ``interrupted`` or ``finished`` (any of the three).
    """
    counts: dict[str, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return counts
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if outcome == "started":
            if event != "start":
                continue
        elif event != "end" or (outcome != "finished" and record.get("outcome") != outcome):
            continue
        keys = (
            [record.get("prompt_id")] if by == "prompt_id" else record.get("filename_prefixes", [])
        )
        for key in keys:
            counts[str(key)] = counts.get(str(key), 0) + 1
    return counts


class Interrupted(Exception):
    """``POST /interrupt`` reached the running prompt."""


class ComfyState:
    """ComfyUI's PromptQueue and worker, the history (memory only) and the model residency.

    A prompt is in exactly one of ``pending``, ``running`` and ``history`` from the moment
    ``/prompt`` accepts it: each move happens in one step under ``lock``.
    """

    def __init__(self, dirs: Dirs, card: SimClient | None, env: Mapping[str, str]) -> None:
        self.dirs = dirs
        self.card = card
        self.job_seconds = float(env.get("STANDIN_JOB_SECONDS", "2"))
        self.free_delay = float(env.get("STANDIN_FREE_DELAY", "3"))
        self.model_vram = int(env.get("STANDIN_MODEL_VRAM_BYTES", str(20 * GIB)))
        self.fallback_total = int(env.get("STANDIN_VRAM_BYTES", str(32 * GIB)))
        self.queue_latency = float(env.get("STANDIN_QUEUE_LATENCY_MS", "0")) / 1000
        self.history_latency = float(env.get("STANDIN_HISTORY_LATENCY_MS", "0")) / 1000
        self.after_save = float(env.get("STANDIN_AFTER_SAVE_MS", "0")) / 1000
        self.executions = Path(env.get("STANDIN_EXECUTIONS_FILE") or dirs.output / EXECUTIONS_FILE)
        self.lock = threading.Condition()
        self.pending: list[Job] = []
        self.running: Job | None = None
        self.history: dict[str, dict[str, Any]] = {}
        self.number = 0
        self.loaded = False
        self.free_due: float | None = None
        self.interrupt = threading.Event()
        self.stop = threading.Event()
        self.worker = threading.Thread(target=self._work, name="prompt-worker", daemon=True)

    def start(self) -> None:
        self.worker.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.interrupt.set()
        with self.lock:
            self.lock.notify_all()
        self.worker.join(timeout=5)

    def vram(self) -> tuple[int, int]:
        """``(total, free)`` of the device for ``/system_stats``."""
        if self.card is not None and self.card.card is not None:
            free, total = self.card.free_vram()
            return total, free
        own = self.model_vram if self.loaded else 0
        return self.fallback_total, self.fallback_total - own

    def next_number(self, front: bool) -> int:
        """``/prompt``'s number: counts every request, also those refused later."""
        with self.lock:
            number = -self.number if front else self.number
            self.number += 1
            return number

    def enqueue(
        self,
        prompt: dict[str, Any],
        extra: dict[str, Any],
        outputs: list[str],
        prompt_id: str | None,
        front: bool = False,
        number: float | None = None,
    ) -> Job:
        if number is None:
            number = self.next_number(front)
        with self.lock:
            job = Job(number, prompt_id or str(uuid.uuid4()), prompt, extra, outputs)
            self.pending.append(job)
            self.pending.sort(key=lambda j: j.number)
            self.lock.notify_all()
            return job

    def queue(self) -> dict[str, Any]:
        with self.lock:
            running = [self.running.queue_item()] if self.running else []
            return copy.deepcopy(
                {
                    "queue_running": running,
                    "queue_pending": [j.queue_item() for j in self.pending],
                }
            )

    def where(self, prompt_id: str) -> list[str]:
        """Where a prompt is: ``["pending"]``, ``["running"]``, ``["history"]`` or ``[]``."""
        with self.lock:
            places = []
            if any(j.prompt_id == prompt_id for j in self.pending):
                places.append("pending")
            if self.running is not None and self.running.prompt_id == prompt_id:
                places.append("running")
            if prompt_id in self.history:
                places.append("history")
            return places

    def clear_pending(self) -> None:
        with self.lock:
            self.pending.clear()

    def delete_pending(self, prompt_ids: Sequence[Any]) -> None:
        with self.lock:
            drop = list(prompt_ids)  # compared as sent, as ComfyUI does
            self.pending[:] = [j for j in self.pending if j.prompt_id not in drop]

    def interrupt_prompt(self, prompt_id: str | None = None) -> bool:
        """Interrupt the running prompt (only ``prompt_id`` when given, if it is the one running).

        As in ComfyUI, an interrupt with nothing running is forgotten when the next prompt
        starts.
        """
        with self.lock:
            if prompt_id and (self.running is None or self.running.prompt_id != prompt_id):
                return False
            self.interrupt.set()
            return True

    def request_free(self) -> None:
        with self.lock:
            self.free_due = time.monotonic() + self.free_delay
            self.lock.notify_all()

    # worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                job = self.pending.pop(0) if self.pending else None
                if job is None:
                    if self.free_due is not None and time.monotonic() >= self.free_due:
                        self.free_due = None
                        self._unload()
                    self.lock.wait(timeout=0.05)
                    continue
                self.running = job  # out of the queue and running: one step
                self.interrupt.clear()
            try:
                entry = self._execute(job)
            except Exception:  # never leave a prompt in neither place
                traceback.print_exc()
                entry = self._entry(job)
                entry["status"]["messages"].append(
                    self._failure(job, job.outputs[0], sys.exc_info()[1])
                )
            with self.lock:
                self.history[job.prompt_id] = entry  # out of running, into the history: one step
                self.running = None
                self.lock.notify_all()

    def _unload(self) -> None:
        self.loaded = False
        if self.card is not None:
            self.card.close()

    def _log(self, record: dict[str, Any]) -> None:
        """Append one line to the executions file (stand-in only)."""
        record = {"time": time.time(), "pid": os.getpid(), **record}
        try:
            self.executions.parent.mkdir(parents=True, exist_ok=True)
            with self.executions.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError:
            traceback.print_exc()

    def _entry(self, job: Job) -> dict[str, Any]:
        messages: list[list[Any]] = [
            ["execution_start", {"prompt_id": job.prompt_id, "timestamp": _now_ms()}],
            ["execution_cached", {"nodes": [], "prompt_id": job.prompt_id, "timestamp": _now_ms()}],
        ]
        return {
            "prompt": job.queue_item(),
            "outputs": {},
            "status": {"status_str": "error", "completed": False, "messages": messages},
            "meta": {},
        }

    def _failure(
        self, job: Job, node_id: str, exc: BaseException | None, **extra: Any
    ) -> list[Any]:
        details = {
            "prompt_id": job.prompt_id,
            "node_id": node_id,
            "node_type": job.prompt[node_id]["class_type"],
            "executed": [],
            "exception_message": str(exc),
            "exception_type": _type_name(exc) if exc is not None else "Exception",
            "traceback": ["SIMULATION: cardshare lab stand-in for ComfyUI\n"],
            "current_inputs": {},
            "current_outputs": {},
            "timestamp": _now_ms(),
        }
        details.update(extra)
        return ["execution_error", details]

    def _prefixes(self, job: Job) -> list[str]:
        return [
            str(job.prompt[n]["inputs"].get("filename_prefix", "ComfyUI"))
            for n in job.outputs
            if "filename_prefix" in NODE_CLASSES[job.prompt[n]["class_type"]].required
        ]

    def _execute(self, job: Job) -> dict[str, Any]:
        prefixes = self._prefixes(job)
        self._log({"event": "start", "prompt_id": job.prompt_id, "filename_prefixes": prefixes})
        entry = self._entry(job)
        outcome, files = "error", []
        try:
            outcome = self._run(job, entry)
            files = [i for o in entry["outputs"].values() for i in o.get("images", [])]
        finally:
            self._log(
                {
                    "event": "end",
                    "prompt_id": job.prompt_id,
                    "filename_prefixes": prefixes,
                    "outcome": outcome,
                    "files": files,
                }
            )
        return entry

    def _run(self, job: Job, entry: dict[str, Any]) -> str:
        messages = entry["status"]["messages"]
        loader = next(
            (
                k
                for k, v in job.prompt.items()
                if v["class_type"] in ("CheckpointLoaderSimple", "UNETLoader")
            ),
            None,
        )
        oom = self._load()
        if oom is not None:
            node_id = loader or job.outputs[0]
            messages.append(
                self._failure(
                    job,
                    node_id,
                    None,
                    exception_message=oom,
                    exception_type="torch.OutOfMemoryError",
                )
            )
            return "error"
        if self.card is not None:
            self.card.set_busy({"ccs": 1.0, "rcs": 0.5})
        try:
            interrupted = self.interrupt.wait(self._sampling_seconds(job.prompt))
        finally:
            if self.card is not None:
                self.card.set_busy({})
        if interrupted:
            node_id = next(
                (k for k, v in job.prompt.items() if v["class_type"] == "KSampler"), job.outputs[0]
            )
            messages.append(
                [
                    "execution_interrupted",
                    {
                        "prompt_id": job.prompt_id,
                        "node_id": node_id,
                        "node_type": job.prompt[node_id]["class_type"],
                        "executed": [],
                        "timestamp": _now_ms(),
                    },
                ]
            )
            return "interrupted"
        for node_id in job.outputs:
            try:
                images = self._save(job, node_id)
            except Exception as exc:
                messages.append(self._failure(job, node_id, exc))
                return "error"
            entry["outputs"][node_id] = {"images": images}
            entry["meta"][node_id] = {
                "node_id": node_id,
                "display_node": node_id,
                "parent_node": None,
                "real_node_id": node_id,
            }
        if self.after_save > 0:
            self.stop.wait(self.after_save)  # files on disk, the prompt still running
        messages.append(["execution_success", {"prompt_id": job.prompt_id, "timestamp": _now_ms()}])
        entry["status"].update(status_str="success", completed=True)
        return "success"

    def _sampling_seconds(self, prompt: dict[str, Any]) -> float:
        """STANDIN_JOB_SECONDS for 20 sampling steps, in proportion to the steps asked."""
        steps = [
            node["inputs"].get("steps")
            for node in prompt.values()
            if node.get("class_type") == "KSampler"
        ]
        asked = sum(int(s) for s in steps if isinstance(s, int | float) and not isinstance(s, bool))
        return self.job_seconds * (asked / 20 if asked else 1.0)

    def _load(self) -> str | None:
        """Load the model onto the card; an out-of-memory message when it does not fit."""
        if self.loaded:
            return None
        if self.card is not None and self.card.card is not None:
            free, total = self.card.free_vram()
            if free < self.model_vram:
                return (
                    f"XPU out of memory. Tried to allocate {self.model_vram / GIB:.2f} GiB "
                    f"(GPU 0; {total / GIB:.2f} GiB total capacity; {free / GIB:.2f} GiB free)"
                )
            self.card.register(vram=self.model_vram)
        self.loaded = True
        return None

    def _save(self, job: Job, node_id: str) -> list[dict[str, str]]:
        """Write an output node's images as ComfyUI names them; their history records."""
        node = job.prompt[node_id]
        inputs = node.get("inputs") or {}
        if "filename_prefix" in NODE_CLASSES[node["class_type"]].required:
            prefix, base, kind = (
                str(inputs.get("filename_prefix", "ComfyUI")),
                self.dirs.output,
                "output",
            )
        elif node["class_type"] == "PreviewImage":
            letters = "".join(random.choices(string.ascii_lowercase, k=5))
            prefix, base, kind = f"ComfyUI_temp_{letters}", self.dirs.temp, "temp"
        else:
            return []
        folder, name, counter, subfolder = save_image_path(prefix, base)
        texts = [
            str(v["inputs"].get("text", ""))
            for v in job.prompt.values()
            if v["class_type"] == "CLIPTextEncode" and isinstance(v.get("inputs"), dict)
        ]
        seeds = [
            str(v["inputs"].get("seed", ""))
            for v in job.prompt.values()
            if v["class_type"] == "KSampler" and isinstance(v.get("inputs"), dict)
        ]
        images = []
        for batch in range(_batch_size(job.prompt, node_id)):
            filename = f"{name.replace('%batch_num%', str(batch))}_{counter:05}_.png"
            seed_text = "|".join(texts + seeds) + (f"|{batch}" if batch else "")
            data = make_png(
                seed_text,
                text={
                    "prompt": json.dumps(job.prompt),
                    "Software": "cardshare lab ComfyUI stand-in (SIMULATION)",
                },
            )
            (folder / filename).write_bytes(data)
            images.append({"filename": filename, "subfolder": subfolder, "type": kind})
            counter += 1
        return images


# --------------------------------------------------------------------------- HTTP


def _json_object(raw: bytes) -> dict[str, Any]:
    """A request body as ComfyUI's handlers see it: not JSON raises (500); a JSON list or
    string has none of the keys they look for; other JSON values raise too."""
    body = json.loads(raw)
    if isinstance(body, dict):
        return body
    if isinstance(body, (list, str)):
        return {}
    raise TypeError(f"argument of type '{type(body).__name__}' is not iterable")


def _safe_path(base: Path, subfolder: str, filename: str) -> Path | None:
    root = base.resolve()
    path = (root / subfolder / filename).resolve()
    return path if path.is_relative_to(root) and path != root else None


class ComfyHandler(Handler):
    server: ComfyServer

    @property
    def state(self) -> ComfyState:
        return self.server.state

    def read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return read_chunked(self.rfile)
        return super().read_body()

    def _guarded(self, handler: Callable[[], None]) -> None:
        """Run a handler as aiohttp would: an exception is a plain-text 500."""
        try:
            handler()
        except BadChunkedBody:
            self.close_connection = True
            self.send_bytes(
                400, b"Bad Request", "text/plain; charset=utf-8", {"Connection": "close"}
            )
        except Exception:
            traceback.print_exc()
            self.close_connection = True
            self.send_bytes(
                500, INTERNAL_ERROR, "text/plain; charset=utf-8", {"Connection": "close"}
            )

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _get(self) -> None:
        path = self.path_only
        state = self.state
        if path == "/":
            self.send_bytes(
                200, b"<html><body>ComfyUI stand-in (SIMULATION)</body></html>", "text/html"
            )
        elif path == "/object_info":
            self.send_json(200, object_info(state.dirs))
        elif path.startswith("/object_info/"):
            name = path.removeprefix("/object_info/")
            info = object_info(state.dirs)
            self.send_json(200, {name: info[name]} if name in info else {})
        elif path == "/system_stats":
            self.send_json(200, self._system_stats())
        elif path == "/queue":
            time.sleep(state.queue_latency)
            self.send_json(200, state.queue())
        elif path == "/prompt":
            time.sleep(state.queue_latency)
            with state.lock:
                remaining = len(state.pending) + (1 if state.running else 0)
            self.send_json(200, {"exec_info": {"queue_remaining": remaining}})
        elif path == "/history":
            time.sleep(state.history_latency)
            with state.lock:
                history = copy.deepcopy(state.history)
            limit = self.query.get("max_items")
            if limit and limit.isdigit():
                history = dict(list(history.items())[-int(limit) :])
            self.send_json(200, history)
        elif path.startswith("/history/"):
            time.sleep(state.history_latency)
            prompt_id = path.removeprefix("/history/")
            with state.lock:
                found = copy.deepcopy(state.history.get(prompt_id))
            self.send_json(200, {prompt_id: found} if found is not None else {})
        elif path == "/view":
            self._view()
        elif path == "/standin/executions":
            self._executions()
        else:
            self.send_bytes(404, b"404: Not Found", "text/plain")

    def _post(self) -> None:
        path = self.path_only
        state = self.state
        if path == "/prompt":
            self._prompt()
        elif path == "/interrupt":
            try:
                body = self.read_json()
            except ValueError:
                body = {}
            state.interrupt_prompt(body.get("prompt_id"))
            self.send_bytes(200, b"", "")
        elif path == "/free":
            body = _json_object(self.read_body())
            if body.get("unload_models") or body.get("free_memory"):
                state.request_free()
            self.send_bytes(200, b"", "")
        elif path == "/queue":
            body = _json_object(self.read_body())
            if body.get("clear"):
                state.clear_pending()
            state.delete_pending(list(body.get("delete", [])))
            self.send_bytes(200, b"", "")
        elif path == "/history":
            body = _json_object(self.read_body())
            with state.lock:
                if body.get("clear"):
                    state.history.clear()
                for prompt_id in body.get("delete", []):
                    state.history.pop(prompt_id, None)
            self.send_bytes(200, b"", "")
        elif path == "/upload/image":
            self._upload()
        else:
            self.send_bytes(404, b"404: Not Found", "text/plain")

    def _prompt(self) -> None:
        """``POST /prompt`` in ComfyUI's order (a body that is not JSON raises: 500)."""
        state = self.state
        body = _json_object(self.read_body())
        if "number" in body:
            number = float(body["number"])
        else:
            number = state.next_number(bool(body.get("front")))
        if "prompt" not in body:
            missing = _error("no_prompt", "No prompt provided", "No prompt provided")
            self.send_json(400, {"error": missing, "node_errors": {}})
            return
        prompt = body["prompt"]
        prompt_id = str(body.get("prompt_id", uuid.uuid4()))
        targets = body.get("partial_execution_targets")
        error, outputs, node_errors = validate_prompt(prompt, state.dirs, targets)
        extra = body.get("extra_data", {})
        if "client_id" in body:
            extra["client_id"] = body["client_id"]
        if error is not None:
            self.send_json(400, {"error": error, "node_errors": node_errors})
            return
        for key in ("auth_token_comfy_org", "api_key_comfy_org"):
            extra.pop(key, None)
        extra["create_time"] = _now_ms()
        job = state.enqueue(prompt, extra, outputs, prompt_id, number=number)
        self.send_json(
            200, {"prompt_id": job.prompt_id, "number": job.number, "node_errors": node_errors}
        )

    def _executions(self) -> None:
        """Stand-in only: executions counted from the on-disk log (survives restarts)."""
        query = self.query
        by = query.get("by", "prompt_id")
        outcome = query.get("outcome", "started")
        outcomes = ("started", "success", "error", "interrupted", "finished")
        if by not in ("prompt_id", "filename_prefix") or outcome not in outcomes:
            message = f"by: prompt_id|filename_prefix; outcome: {'|'.join(outcomes)}"
            self.send_bytes(400, message.encode(), "text/plain", STANDIN_ONLY)
            return
        counts = count_executions(self.state.executions, by, outcome)
        self.send_bytes(200, json.dumps(counts).encode(), "application/json", STANDIN_ONLY)

    def _system_stats(self) -> dict[str, Any]:
        total, free = self.state.vram()
        return {
            "system": {
                "os": "posix",
                "ram_total": 64 * GIB,
                "ram_free": 48 * GIB,
                "comfyui_version": VERSION,
                "python_version": sys.version,
                "pytorch_version": "none (SIMULATION: no torch in the stand-in)",
                "embedded_python": False,
                "argv": sys.argv,
            },
            "devices": [
                {
                    "name": DEVICE_NAME,
                    "type": "xpu",
                    "index": 0,
                    "vram_total": total,
                    "vram_free": free,
                    "torch_vram_total": self.state.model_vram if self.state.loaded else 0,
                    "torch_vram_free": 0,
                }
            ],
        }

    def _view(self) -> None:
        """``GET /view`` with ComfyUI's checks: 400 for ``..`` or ``/`` in front of the name
        or an unknown type, 403 for a subfolder outside the directory, 404 when missing."""
        query = {
            k: v[-1] for k, v in parse_qs(urlsplit(self.path).query, keep_blank_values=True).items()
        }
        if "filename" not in query:
            self.send_bytes(404, b"", "")
            return
        filename, base = self.state.dirs.annotated(query["filename"])
        if not filename or filename.startswith("/") or ".." in filename:
            self.send_bytes(400, b"", "")
            return
        if base is None:
            base = self.state.dirs.by_type(query.get("type", "output"))
        if base is None:
            self.send_bytes(400, b"", "")
            return
        folder = os.path.abspath(base)
        if "subfolder" in query:
            full = os.path.join(folder, query["subfolder"])
            if os.path.commonpath((os.path.abspath(full), folder)) != folder:
                self.send_bytes(403, b"", "")
                return
            folder = full
        name = os.path.basename(filename)
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            self.send_bytes(404, b"", "")
            return
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if content_type in ("text/html", "application/xhtml+xml", "text/javascript", "text/css"):
            content_type = "application/octet-stream"  # download, never render
        with open(path, "rb") as fh:
            data = fh.read()
        self.send_bytes(200, data, content_type, {"Content-Disposition": f'filename="{name}"'})

    def _upload(self) -> None:
        content_type = self.headers.get("Content-Type", "")
        body = self.read_body()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
        )
        fields: dict[str, str] = {}
        image: tuple[str, bytes] | None = None
        if message.is_multipart():
            for part in message.iter_parts():
                name = part.get_param("name", header="content-disposition")
                payload = part.get_payload(decode=True)
                data = payload if isinstance(payload, bytes) else b""
                filename = part.get_filename()
                if name == "image" and filename:
                    image = (Path(str(filename)).name, data)
                elif isinstance(name, str):
                    fields[name] = data.decode(errors="replace")
        if image is None:
            self.send_bytes(400, b"", "")
            return
        kind = fields.get("type", "input")
        base = {
            "input": self.state.dirs.input,
            "temp": self.state.dirs.temp,
            "output": self.state.dirs.output,
        }.get(kind, self.state.dirs.input)
        subfolder = fields.get("subfolder", "")
        name, data = image
        path = _safe_path(base, subfolder, name)
        if path is None:
            self.send_bytes(400, b"", "")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and fields.get("overwrite", "").lower() not in ("true", "1"):
            stem, suffix, counter = path.stem, path.suffix, 1
            while path.exists():
                path = path.with_name(f"{stem} ({counter}){suffix}")
                counter += 1
        path.write_bytes(data)
        self.send_json(200, {"name": path.name, "subfolder": subfolder, "type": kind})


class ComfyServer(StandinServer):
    def __init__(self, address: tuple[str, int], state: ComfyState) -> None:
        self.state = state
        super().__init__(address, ComfyHandler)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="main.py", description="SIMULATION of ComfyUI")
    parser.add_argument("--listen", nargs="?", const="0.0.0.0", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8188)
    parser.add_argument("--base-directory", default="/opt/ComfyUI")
    parser.add_argument("--output-directory", default=None)
    parser.add_argument("--input-directory", default=None)
    parser.add_argument("--temp-directory", default=None)
    parser.add_argument("--preview-method", default="none")
    parser.add_argument("--reserve-vram", type=float, default=None)
    parser.add_argument("--enable-cors-header", nargs="?", const="*", default=None)
    parser.add_argument("--verbose", nargs="?", const="DEBUG", default="INFO")
    for flag in (
        "--lowvram",
        "--highvram",
        "--normalvram",
        "--novram",
        "--cpu",
        "--disable-smart-memory",
        "--disable-auto-launch",
        "--force-fp16",
        "--use-pytorch-cross-attention",
        "--use-split-cross-attention",
        "--disable-xformers",
        "--bf16-unet",
        "--fp8_e4m3fn-unet",
        "--dont-print-server",
    ):
        parser.add_argument(flag, action="store_true")
    return parser


def make_dirs(args: argparse.Namespace) -> Dirs:
    base = Path(args.base_directory)
    dirs = Dirs(
        base=base,
        output=Path(args.output_directory or base / "output"),
        input=Path(args.input_directory or base / "input"),
        temp=Path(args.temp_directory or base / "temp"),
    )
    for folder in (dirs.output, dirs.input, dirs.temp):
        folder.mkdir(parents=True, exist_ok=True)
    return dirs


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    print("SIMULATION: cardshare lab stand-in for ComfyUI (no model runs here)", flush=True)
    dirs = make_dirs(args)
    shutil.rmtree(dirs.temp, ignore_errors=True)  # ComfyUI empties its temp dir at start
    dirs.temp.mkdir(parents=True, exist_ok=True)
    card = SimClient(comm="python3", cmdline=["python3", "main.py", *(argv or sys.argv[1:])])
    state = ComfyState(dirs, card, os.environ)
    server = ComfyServer((args.listen.split(",")[0], args.port), state)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    state.start()
    serve_in_thread(server)
    print(f"To see the GUI go to: http://{args.listen}:{args.port}", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        state.shutdown()
        try:
            card.close(float(os.environ.get("STANDIN_RELEASE_SECONDS", "1")))
        except OSError:
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
