"""SIMULATION: a stand-in for ComfyUI (FLUX.1 Kontext) in the cardshare lab.

This is not ComfyUI and runs no model.  It speaks ComfyUI's HTTP API closely enough for
the arbiter and the roles:

* ``POST /prompt {prompt, client_id[, prompt_id]}`` validates the API-format graph (known
  ``class_type``, required inputs present, links to existing nodes, list values such as
  ``ckpt_name`` among the files under ``<base>/models``) and answers
  ``{prompt_id, number, node_errors}`` or 400 ``{error, node_errors}`` in ComfyUI's shape;
* jobs run one at a time, each for ``STANDIN_JOB_SECONDS`` (default 2), and write a real
  PNG (64x40, a pattern derived from the prompt text and seed) for every ``SaveImage``;
* ``GET /history`` and ``/history/<id>`` (the entry appears once the job has finished:
  ``{}`` while it is queued or running), ``GET /view?filename=&subfolder=&type=``,
  ``GET/POST /queue``, ``POST /interrupt``, ``GET /object_info[/<class>]``,
  ``GET /system_stats`` (VRAM of the simulated card), ``POST /upload/image`` (multipart),
  ``POST /free`` (answers at once, frees after ``STANDIN_FREE_DELAY`` seconds, default 3).
* the first job "loads" the model: if the simulated card has less free VRAM than
  ``STANDIN_MODEL_VRAM_BYTES`` (default 20 GiB, FLUX.1 Kontext fp8) the job fails with an
  out-of-memory ``execution_error``; otherwise the stand-in registers on the card with that
  VRAM and ``ccs``/``rcs`` cycles advance while jobs run, until ``/free`` or exit.

Command line (subset of ComfyUI's ``main.py``): ``--listen [ADDR]``, ``--port``,
``--base-directory``, ``--output-directory``, ``--input-directory`` and a few performance
flags that are accepted and ignored.  Unknown flags exit 2.
"""

from __future__ import annotations

import argparse
import copy
import email.parser
import email.policy
import hashlib
import json
import os
import re
import signal
import struct
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import SimClient
from standin_http import Handler, StandinServer, serve_in_thread

__all__ = [
    "NODE_CLASSES",
    "ComfyServer",
    "ComfyState",
    "NodeClass",
    "build_parser",
    "main",
    "make_png",
    "object_info",
    "validate_prompt",
]

VERSION = "0.3.60+standin (SIMULATION)"
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


def _choices(spec: Any, dirs: Dirs) -> list[str] | None:
    if isinstance(spec, list):
        return spec
    if spec == "@input":
        return _list_files(dirs.input)
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


def _input_errors(prompt: Mapping[str, Any], node_id: str, dirs: Dirs) -> list[dict[str, Any]]:
    node = prompt[node_id]
    cls = NODE_CLASSES[node["class_type"]]
    inputs = node.get("inputs") or {}
    errors: list[dict[str, Any]] = []
    for name, (kind, options) in cls.required.items():
        if name not in inputs:
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
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
            if value[0] not in prompt:
                errors.append(
                    _error(
                        "exception_during_inner_validation",
                        "Exception when validating inner node",
                        f"'{value[0]}'",
                        {"input_name": name},
                    )
                )
            continue
        choices = _choices(kind, dirs)
        if choices is not None:
            if value not in choices:
                listed = str(choices) if len(choices) <= 20 else f"(list of length {len(choices)})"
                errors.append(
                    _error(
                        "value_not_in_list",
                        "Value not in list",
                        f"{name}: '{value}' not in {listed}",
                        {"input_name": name, "received_value": value},
                    )
                )
            continue
        if kind in ("INT", "FLOAT"):
            try:
                number = int(value) if kind == "INT" else float(value)
            except (TypeError, ValueError) as exc:
                errors.append(
                    _error(
                        "invalid_input_type",
                        f"Failed to convert an input value to a {kind} value",
                        f"{name}, {value}, {exc}",
                        {"input_name": name},
                    )
                )
                continue
            if "min" in options and number < options["min"]:
                errors.append(
                    _error(
                        "value_smaller_than_min",
                        f"Value {number} smaller than min of {options['min']}",
                        name,
                        {"input_name": name},
                    )
                )
            elif "max" in options and number > options["max"]:
                errors.append(
                    _error(
                        "value_bigger_than_max",
                        f"Value {number} bigger than max of {options['max']}",
                        name,
                        {"input_name": name},
                    )
                )
    return errors


def _upstream(prompt: Mapping[str, Any], start: str) -> list[str]:
    seen: list[str] = []
    stack = [start]
    while stack:
        node_id = stack.pop()
        if node_id in seen or node_id not in prompt:
            continue
        seen.append(node_id)
        for value in (prompt[node_id].get("inputs") or {}).values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                stack.append(value[0])
    return seen


def validate_prompt(
    prompt: Any, dirs: Dirs
) -> tuple[dict[str, Any] | None, list[str], dict[str, Any]]:
    """``(error, good_outputs, node_errors)`` as ComfyUI's ``validate_prompt`` reports them."""
    if not isinstance(prompt, dict):
        return _error("invalid_prompt", "Cannot execute because the prompt is not a dict"), [], {}
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
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
        if class_type not in NODE_CLASSES:
            return (
                _error(
                    "missing_node_type",
                    f"Node '{class_type}' not found. The custom node may not be installed.",
                    f"Node ID '#{node_id}'",
                    {"node_id": node_id, "class_type": class_type, "node_title": class_type},
                ),
                [],
                {},
            )
    outputs = [k for k, v in prompt.items() if NODE_CLASSES[v["class_type"]].output_node]
    if not outputs:
        return _error("prompt_no_outputs", "Prompt has no outputs"), [], {}
    node_errors: dict[str, Any] = {}
    good: list[str] = []
    messages: list[str] = []
    for output in sorted(outputs):
        failed = False
        for node_id in _upstream(prompt, output):
            errors = _input_errors(prompt, node_id, dirs)
            if not errors:
                continue
            failed = True
            entry = node_errors.setdefault(
                node_id,
                {
                    "errors": errors,
                    "dependent_outputs": [],
                    "class_type": prompt[node_id]["class_type"],
                },
            )
            entry["dependent_outputs"].append(output)
            messages.extend(f"{e['message']}: {e['details']}" for e in errors)
        if not failed:
            good.append(output)
    if not good:
        error = _error(
            "prompt_outputs_failed_validation",
            "Prompt outputs failed validation",
            "\n".join(dict.fromkeys(messages)),
        )
        return error, [], node_errors
    return None, good, node_errors


# --------------------------------------------------------------------------- jobs


@dataclass(slots=True)
class Job:
    number: int
    prompt_id: str
    prompt: dict[str, Any]
    extra: dict[str, Any]
    outputs: list[str]

    def queue_item(self) -> list[Any]:
        return [self.number, self.prompt_id, self.prompt, self.extra, self.outputs]


def _now_ms() -> int:
    return int(time.time() * 1000)


class ComfyState:
    """The queue, the single worker, history and the simulated model residency."""

    def __init__(self, dirs: Dirs, card: SimClient | None, env: Mapping[str, str]) -> None:
        self.dirs = dirs
        self.card = card
        self.job_seconds = float(env.get("STANDIN_JOB_SECONDS", "2"))
        self.free_delay = float(env.get("STANDIN_FREE_DELAY", "3"))
        self.model_vram = int(env.get("STANDIN_MODEL_VRAM_BYTES", str(20 * GIB)))
        self.fallback_total = int(env.get("STANDIN_VRAM_BYTES", str(32 * GIB)))
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

    def enqueue(
        self,
        prompt: dict[str, Any],
        extra: dict[str, Any],
        outputs: list[str],
        prompt_id: str | None,
        front: bool,
    ) -> Job:
        with self.lock:
            number = -self.number if front else self.number
            self.number += 1
            job = Job(number, prompt_id or str(uuid.uuid4()), prompt, extra, outputs)
            self.pending.append(job)
            self.pending.sort(key=lambda j: j.number)
            self.lock.notify_all()
            return job

    def queue(self) -> dict[str, Any]:
        with self.lock:
            running = [self.running.queue_item()] if self.running else []
            return {
                "queue_running": running,
                "queue_pending": [j.queue_item() for j in self.pending],
            }

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
                self.running = job
                self.interrupt.clear()
            entry = self._execute(job)
            with self.lock:
                self.history[job.prompt_id] = entry
                self.running = None
                self.lock.notify_all()

    def _unload(self) -> None:
        self.loaded = False
        if self.card is not None:
            self.card.close()

    def _execute(self, job: Job) -> dict[str, Any]:
        messages: list[list[Any]] = [
            ["execution_start", {"prompt_id": job.prompt_id, "timestamp": _now_ms()}],
            ["execution_cached", {"nodes": [], "prompt_id": job.prompt_id, "timestamp": _now_ms()}],
        ]
        entry: dict[str, Any] = {
            "prompt": job.queue_item(),
            "outputs": {},
            "status": {"status_str": "error", "completed": False, "messages": messages},
            "meta": {},
        }
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
                [
                    "execution_error",
                    {
                        "prompt_id": job.prompt_id,
                        "node_id": node_id,
                        "node_type": job.prompt[node_id]["class_type"],
                        "executed": [],
                        "exception_message": oom,
                        "exception_type": "torch.OutOfMemoryError",
                        "traceback": ["SIMULATION: cardshare lab stand-in for ComfyUI\n"],
                        "current_inputs": {},
                        "current_outputs": {},
                        "timestamp": _now_ms(),
                    },
                ]
            )
            return entry
        if self.card is not None:
            self.card.set_busy({"ccs": 1.0, "rcs": 0.5})
        try:
            interrupted = self.interrupt.wait(self.job_seconds)
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
            return entry
        for node_id in job.outputs:
            node = job.prompt[node_id]
            if node["class_type"] != "SaveImage":
                entry["outputs"][node_id] = {"images": []}
                continue
            entry["outputs"][node_id] = {"images": [self._save(job, node)]}
            entry["meta"][node_id] = {
                "node_id": node_id,
                "display_node": node_id,
                "parent_node": None,
                "real_node_id": node_id,
            }
        messages.append(["execution_success", {"prompt_id": job.prompt_id, "timestamp": _now_ms()}])
        entry["status"].update(status_str="success", completed=True)
        return entry

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

    def _save(self, job: Job, node: Mapping[str, Any]) -> dict[str, str]:
        prefix = str((node.get("inputs") or {}).get("filename_prefix", "ComfyUI"))
        subfolder, _, name = prefix.rpartition("/")
        folder = self.dirs.output / subfolder
        folder.mkdir(parents=True, exist_ok=True)
        pattern = re.compile(rf"^{re.escape(name)}_(\d{{5}})_\.png$")
        numbers = [int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name))]
        filename = f"{name}_{max(numbers, default=0) + 1:05}_.png"
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
        seed_text = "|".join(texts + seeds)
        data = make_png(
            seed_text,
            text={
                "prompt": json.dumps(job.prompt),
                "Software": "cardshare lab ComfyUI stand-in (SIMULATION)",
            },
        )
        (folder / filename).write_bytes(data)
        return {"filename": filename, "subfolder": subfolder, "type": "output"}


# --------------------------------------------------------------------------- HTTP


def _safe_path(base: Path, subfolder: str, filename: str) -> Path | None:
    root = base.resolve()
    path = (root / subfolder / filename).resolve()
    return path if path.is_relative_to(root) and path != root else None


class ComfyHandler(Handler):
    server: ComfyServer

    @property
    def state(self) -> ComfyState:
        return self.server.state

    def do_GET(self) -> None:
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
            self.send_json(200, state.queue())
        elif path == "/prompt":
            with state.lock:
                remaining = len(state.pending) + (1 if state.running else 0)
            self.send_json(200, {"exec_info": {"queue_remaining": remaining}})
        elif path == "/history":
            with state.lock:
                history = copy.deepcopy(state.history)
            limit = self.query.get("max_items")
            if limit and limit.isdigit():
                history = dict(list(history.items())[-int(limit) :])
            self.send_json(200, history)
        elif path.startswith("/history/"):
            prompt_id = path.removeprefix("/history/")
            with state.lock:
                found = copy.deepcopy(state.history.get(prompt_id))
            self.send_json(200, {prompt_id: found} if found is not None else {})
        elif path == "/view":
            self._view()
        else:
            self.send_bytes(404, b"404: Not Found", "text/plain")

    def do_POST(self) -> None:
        path = self.path_only
        state = self.state
        if path == "/prompt":
            self._prompt()
        elif path == "/interrupt":
            self.read_body()
            state.interrupt.set()
            self.send_bytes(200, b"", "")
        elif path == "/free":
            body = self._json_or_empty()
            if body.get("unload_models") or body.get("free_memory"):
                state.request_free()
            self.send_bytes(200, b"", "")
        elif path in ("/queue", "/history"):
            body = self._json_or_empty()
            with state.lock:
                if path == "/queue":
                    if body.get("clear"):
                        state.pending.clear()
                    drop = set(body.get("delete") or [])
                    state.pending[:] = [j for j in state.pending if j.prompt_id not in drop]
                else:
                    if body.get("clear"):
                        state.history.clear()
                    for prompt_id in body.get("delete") or []:
                        state.history.pop(prompt_id, None)
            self.send_bytes(200, b"", "")
        elif path == "/upload/image":
            self._upload()
        else:
            self.send_bytes(404, b"404: Not Found", "text/plain")

    def _json_or_empty(self) -> dict[str, Any]:
        try:
            body = self.read_json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    def _prompt(self) -> None:
        try:
            body = self.read_json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "prompt" not in body:
            missing = _error("no_prompt", "No prompt provided", "No prompt provided")
            self.send_json(400, {"error": missing, "node_errors": {}})
            return
        prompt = body["prompt"]
        error, outputs, node_errors = validate_prompt(prompt, self.state.dirs)
        if error is not None:
            self.send_json(400, {"error": error, "node_errors": node_errors})
            return
        extra = dict(body.get("extra_data") or {})
        if "client_id" in body:
            extra["client_id"] = body["client_id"]
        job = self.state.enqueue(
            prompt, extra, outputs, body.get("prompt_id"), bool(body.get("front"))
        )
        self.send_json(
            200, {"prompt_id": job.prompt_id, "number": job.number, "node_errors": node_errors}
        )

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
        query = self.query
        kind = query.get("type", "output")
        bases = {
            "output": self.state.dirs.output,
            "input": self.state.dirs.input,
            "temp": self.state.dirs.temp,
        }
        base = bases.get(kind)
        filename = query.get("filename", "")
        path = _safe_path(base, query.get("subfolder", ""), filename) if base and filename else None
        if path is None:
            self.send_bytes(400 if base is None or not filename else 403, b"", "")
            return
        if not path.is_file():
            self.send_bytes(404, b"404: Not Found", "text/plain")
            return
        content_type = "image/png" if path.suffix == ".png" else "application/octet-stream"
        self.send_bytes(
            200, path.read_bytes(), content_type, {"Content-Disposition": f'filename="{path.name}"'}
        )

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
