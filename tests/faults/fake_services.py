"""The fake vLLM and the fake ComfyUI, each run as a process ("container") by fake_docker.py.

``python fake_services.py vllm --port P --run-dir D --model M``
    ``/health`` (200, empty), ``/metrics`` (``vllm:num_requests_running``/``waiting`` gauges,
    ``vllm:request_success_total`` counter), ``/v1/models``, ``/v1/completions``. Like vLLM,
    the port refuses connections until the model is "loaded" (``vllm_boot_seconds``).

``python fake_services.py comfyui --port P --run-dir D``
    ComfyUI 0.8's HTTP API as the arbiter uses it: ``/object_info``, ``POST /prompt`` (keeps
    the client's ``prompt_id``), ``GET /queue``, ``POST /queue {"clear": true}``,
    ``POST /interrupt``, ``GET /history[/<id>]`` (real shapes, ``execution_interrupted``),
    ``GET /view`` (from the output directory on disk, which survives restarts),
    ``POST /upload/image``. One worker runs one prompt at a time for ``comfyui_job_seconds``;
    a prompt moves pending -> running -> history each in one step under one lock; the
    history is in memory only (a restart forgets it). ``POST /free`` only sets a flag that
    the worker reads between prompts, as ComfyUI's prompt worker does: after
    ``comfyui_free_seconds`` it writes the VRAM it still holds (``comfyui_vram_after_free``,
    its baseline by default) to ``<run-dir>/comfyui-vram``, which the card writer reports;
    the next prompt loads its models again (the file goes). Save nodes write
    ``<subfolder>/<stem>_<counter:05>_.png`` (the counter continues after the highest file of
    that prefix). Every execution is appended to ``<run-dir>/executions.jsonl``
    (``start``, ``saved``, ``end``, ``crash``) so duplicates are counted across restarts.

Both read their tunables from ``<run-dir>/settings.json`` and their fault rules from
``<run-dir>/faults/<service>.json`` (see faultkit.py). Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import email.policy
import json
import os
import random
import signal
import struct
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultkit import App, FaultFile, Reply, Request, Route, Rule, Settings, TcpServer

# -- vLLM -----------------------------------------------------------------------------------


class Vllm(App):
    service = "vllm"

    def __init__(self, model: str) -> None:
        self.model = model
        self.success = 0
        self.lock = threading.Lock()

    def route(self, method: str, path: str, query: str) -> Route | None:
        table = {
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/completions"): self.completions,
        }
        handler = table.get((method, path))
        return None if handler is None else (f"{method} {path}", None, handler)

    def error_reply(self, status: int, rule: Rule) -> Reply:
        if rule.get("body") is not None:
            return super().error_reply(status, rule)
        if status >= 500:
            return Reply(status, b"", "text/plain")  # vLLM's /health answers an empty 503
        return Reply.json(
            {"object": "error", "message": "injected", "type": "BadRequestError", "code": status},
            status,
        )

    def health(self, _: Request) -> Reply:
        return Reply(200, b"", "application/json")

    def metrics(self, _: Request) -> Reply:
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} 0.0\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {self.success}.0\n'
            f'vllm:request_success_total{{{labels},finished_reason="stop"}} 0.0\n'
        )
        return Reply.text(text, content_type="text/plain; version=0.0.4")

    def models(self, _: Request) -> Reply:
        return Reply.json(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "max_model_len": 32768}],
            }
        )

    def completions(self, request: Request) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return Reply.json({"object": "error", "message": "bad JSON", "code": 400}, 400)
        if body.get("model") != self.model:
            return Reply.json(
                {
                    "object": "error",
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                },
                404,
            )
        with self.lock:
            self.success += 1
        return Reply.json(
            {
                "id": f"cmpl-{random.getrandbits(64):016x}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": "!", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1},
            }
        )


# -- ComfyUI --------------------------------------------------------------------------------

NODE_CLASSES = (
    "CheckpointLoaderSimple",
    "CLIPTextEncode",
    "EmptyLatentImage",
    "KSampler",
    "VAEDecode",
    "LoadImage",
    "SaveImage",
    "PreviewImage",
    "SaveAnimatedWEBP",
    "SaveAudio",
)
# what ComfyUI 0.8's savers write: <prefix>_<counter:05>_.<extension> (nodes.py,
# comfy_extras/nodes_images.py, comfy_extras/nodes_audio.py)
SAVER_EXTENSIONS = {"SaveAnimatedWEBP": "webp", "SaveAudio": "flac"}


def saved_bytes(extension: str, text: str) -> bytes:
    """A file of the saver's format carrying ``text`` (to tell outputs apart): a real PNG, a
    RIFF/WEBP container, a FLAC stream marker."""
    if extension == "webp":
        payload = b"VP8 " + text.encode()
        return b"RIFF" + struct.pack("<I", 4 + len(payload)) + b"WEBP" + payload
    if extension == "flac":
        return b"fLaC" + text.encode()
    return png(text)


def png(text: str) -> bytes:
    """A real 1x1 PNG carrying ``text`` in a tEXt chunk (to tell outputs apart)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"tEXt", b"cardshare\x00" + text.encode())
        + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00"))
        + chunk(b"IEND", b"")
    )


def save_nodes(prompt: dict[str, Any]) -> list[str]:
    return sorted(
        (
            k
            for k, v in prompt.items()
            if isinstance(v, dict)
            and (v.get("class_type") == "SaveImage" or "filename_prefix" in (v.get("inputs") or {}))
        ),
        key=lambda k: (len(k), k),
    )


def now_ms() -> int:
    return int(time.time() * 1000)


FREED_VRAM_BYTES = 384 * 2**20  # what ComfyUI keeps after /free: the XPU context, no models


class Comfy(App):
    service = "comfyui"

    def __init__(self, run_dir: Path, settings: Settings, faults: FaultFile) -> None:
        self.output = run_dir / "comfy-output"
        self.input = run_dir / "comfy-input"
        self.output.mkdir(parents=True, exist_ok=True)
        self.input.mkdir(parents=True, exist_ok=True)
        self.executions = run_dir / "executions.jsonl"
        self.settings = settings
        self.faults = faults
        self.lock = threading.Condition()
        self.pending: list[list[Any]] = []  # queue items [number, id, prompt, extra, outputs]
        self.running: list[Any] | None = None
        self.history: dict[str, dict[str, Any]] = {}
        self.number = 0
        self.interrupt = threading.Event()
        self.vram_file = run_dir / "comfyui-vram"
        self.free_flag = False
        threading.Thread(target=self._work, name="prompt-worker", daemon=True).start()

    # routes -------------------------------------------------------------------------------

    def route(self, method: str, path: str, query: str) -> Route | None:
        table = {
            ("GET", "/object_info"): self.object_info,
            ("POST", "/prompt"): self.prompt,
            ("GET", "/queue"): self.queue,
            ("POST", "/queue"): self.queue_post,
            ("POST", "/interrupt"): self.interrupt_post,
            ("GET", "/view"): self.view,
            ("POST", "/upload/image"): self.upload,
            ("GET", "/system_stats"): self.system_stats,
            ("POST", "/free"): self.free,
        }
        handler = table.get((method, path))
        if handler is not None:
            return f"{method} {path}", None, handler
        if method == "GET" and (path == "/history" or path.startswith("/history/")):
            return "GET /history", None, self.history_get
        return None

    def error_reply(self, status: int, rule: Rule) -> Reply:
        if rule.get("body") is not None:
            return super().error_reply(status, rule)
        if status == 400:
            return Reply.json(
                {
                    "error": {
                        "type": "invalid_prompt",
                        "message": "Cannot execute because node Injected does not exist.",
                        "details": "Node ID '#2'",
                        "extra_info": {},
                    },
                    "node_errors": {},
                },
                400,
            )
        if status == 404:
            return Reply.text("404: Not Found", 404)
        return Reply.text("500 Internal Server Error\n\nServer got itself in trouble", status)

    def object_info(self, _: Request) -> Reply:
        return Reply.json(
            {
                name: {
                    "input": {"required": {}},
                    "output": [],
                    "name": name,
                    "display_name": name,
                    "category": "fake",
                    "output_node": name in ("SaveImage", "PreviewImage"),
                }
                for name in NODE_CLASSES
            }
        )

    def system_stats(self, _: Request) -> Reply:
        return Reply.json(
            {
                "system": {"os": "posix", "comfyui_version": "0.8.0-fake"},
                "devices": [{"name": "xpu:0", "type": "xpu", "vram_total": 32 * 2**30}],
            }
        )

    def prompt(self, request: Request) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return Reply.text("500 Internal Server Error\n\nServer got itself in trouble", 500)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, dict):
            return Reply.json(
                {
                    "error": {
                        "type": "no_prompt",
                        "message": "No prompt provided",
                        "details": "",
                        "extra_info": {},
                    },
                    "node_errors": {},
                },
                400,
            )
        for node_id, node in prompt.items():
            if not isinstance(node, dict) or node.get("class_type") not in NODE_CLASSES:
                kind = node.get("class_type") if isinstance(node, dict) else None
                return Reply.json(
                    {
                        "error": {
                            "type": "invalid_prompt",
                            "message": f"Cannot execute because node {kind} does not exist.",
                            "details": f"Node ID '#{node_id}'",
                            "extra_info": {},
                        },
                        "node_errors": {},
                    },
                    400,
                )
        outputs = save_nodes(prompt)
        if not outputs:
            return Reply.json(
                {
                    "error": {
                        "type": "prompt_no_outputs",
                        "message": "Prompt has no outputs",
                        "details": "",
                        "extra_info": {},
                    },
                    "node_errors": [],
                },
                400,
            )
        prompt_id = str(body.get("prompt_id") or os.urandom(16).hex())
        with self.lock:
            number = self.number
            self.number += 1
            extra = {"client_id": body.get("client_id")}
            self.pending.append([number, prompt_id, prompt, extra, outputs])
            self.lock.notify_all()
        return Reply.json({"prompt_id": prompt_id, "number": number, "node_errors": {}})

    def queue(self, _: Request) -> Reply:
        with self.lock:  # one consistent snapshot
            doc = {
                "queue_running": [self.running] if self.running else [],
                "queue_pending": list(self.pending),
            }
            text = json.dumps(doc)
        return Reply(200, text.encode())

    def queue_post(self, request: Request) -> Reply:
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            return Reply.text("500 Internal Server Error", 500)
        with self.lock:
            if body.get("clear"):
                self.pending.clear()
            drop = {str(d) for d in body.get("delete") or []}
            self.pending[:] = [p for p in self.pending if p[1] not in drop]
        return Reply(200, b"", "text/plain")

    def interrupt_post(self, request: Request) -> Reply:
        """As ComfyUI since 0.3.4x: with a ``prompt_id``, only when that prompt runs."""
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            body = {}
        wanted = body.get("prompt_id") if isinstance(body, dict) else None
        with self.lock:
            if wanted and (self.running is None or self.running[1] != wanted):
                return Reply(200, b"", "text/plain")
            self.interrupt.set()
        return Reply(200, b"", "text/plain")

    def history_get(self, request: Request) -> Reply:
        prompt_id = request.url.path[len("/history/") :] if "/history/" in request.url.path else ""
        with self.lock:
            if prompt_id:
                entry = self.history.get(prompt_id)
                text = json.dumps({prompt_id: entry} if entry is not None else {})
            else:
                text = json.dumps(self.history)
        return Reply(200, text.encode())

    def view(self, request: Request) -> Reply:
        q = parse_qs(request.url.query)
        filename = (q.get("filename") or [""])[0]
        subfolder = (q.get("subfolder") or [""])[0]
        kind = (q.get("type") or ["output"])[0]
        base = {"output": self.output, "input": self.input}.get(kind)
        if base is None or not filename or "/" in filename or filename.startswith(".."):
            return Reply.text("400: Bad Request", 400)
        path = (base / subfolder / filename).resolve()
        if not str(path).startswith(str(base.resolve()) + os.sep):
            return Reply.text("403: Forbidden", 403)
        try:
            data = path.read_bytes()
        except OSError:
            return Reply.text("404: Not Found", 404)
        return Reply(200, data, "image/png")

    def upload(self, request: Request) -> Reply:
        head = f"Content-Type: {request.headers.get('Content-Type', '')}\r\n\r\n".encode()
        msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + request.body)
        image: tuple[str, bytes] | None = None
        for part in msg.iter_parts():
            if part.get_param("name", header="content-disposition") == "image":
                image = (str(part.get_filename() or "upload.png"), part.get_payload(decode=True))
        if image is None:
            return Reply.text("400: no image", 400)
        name, data = image
        (self.input / os.path.basename(name)).write_bytes(data or b"")
        return Reply.json({"name": os.path.basename(name), "subfolder": "", "type": "input"})

    # the worker ---------------------------------------------------------------------------

    def _log(self, **record: Any) -> None:
        record = {"t": time.time(), "pid": os.getpid(), **record}
        line = json.dumps(record, sort_keys=True) + "\n"
        fd = os.open(self.executions, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _save(self, prompt: dict[str, Any], node_id: str, prompt_id: str) -> dict[str, str]:
        prefix = str((prompt[node_id].get("inputs") or {}).get("filename_prefix", "ComfyUI"))
        subfolder, _, stem = prefix.rpartition("/")
        folder = self.output / subfolder
        folder.mkdir(parents=True, exist_ok=True)
        numbers = [0]
        for entry in os.listdir(folder):
            if entry.startswith(stem + "_"):
                with contextlib.suppress(ValueError):
                    numbers.append(int(entry[len(stem) + 1 :].split("_")[0]))
        extension = SAVER_EXTENSIONS.get(str(prompt[node_id].get("class_type")), "png")
        filename = f"{stem}_{max(numbers) + 1:05}_.{extension}"
        text = json.dumps({"prefix": prefix, "prompt": prompt_id})
        (folder / filename).write_bytes(saved_bytes(extension, text))
        return {"filename": filename, "subfolder": subfolder, "type": "output"}

    def free(self, request: Request) -> Reply:
        """ComfyUI answers at once and frees later, in its prompt worker (facts.md); a body
        that is not JSON fails its ``request.json()``: a plain-text 500."""
        try:
            body = json.loads(request.body)
        except ValueError:
            return Reply.text("500 Internal Server Error\n\nServer got itself in trouble", 500)
        if isinstance(body, dict) and (body.get("unload_models") or body.get("free_memory")):
            with self.lock:
                self.free_flag = True
                self.lock.notify_all()
        return Reply(200, b"", "text/plain")

    def _work(self) -> None:
        while True:
            with self.lock:
                while not self.pending and not self.free_flag:
                    self.lock.wait()
                freeing, self.free_flag = self.free_flag, False
                item = None if freeing else self.pending.pop(0)
                self.running = item  # out of the queue and running: one step
                self.interrupt.clear()
            if item is None:  # the flags, read between prompts: unload, then empty the cache
                time.sleep(self.settings.seconds("comfyui_free_seconds", 0.05))
                tmp = self.vram_file.with_name(f".{self.vram_file.name}.tmp")
                kept = int(self.settings.get("comfyui_vram_after_free", FREED_VRAM_BYTES))
                tmp.write_text(str(kept), encoding="utf-8")
                tmp.replace(self.vram_file)
                continue
            self.vram_file.unlink(missing_ok=True)  # the prompt loads its models again
            _, prompt_id, prompt, _, outputs = item
            prefixes = [
                str((prompt[n].get("inputs") or {}).get("filename_prefix", "ComfyUI"))
                for n in outputs
            ]
            self._log(event="start", prompt_id=prompt_id, prefixes=prefixes)
            fault, _ = self.faults.take("execute")
            kind = fault["kind"] if fault else None
            seconds = self.settings.seconds("comfyui_job_seconds", 0.05)
            messages: list[list[Any]] = [
                ["execution_start", {"prompt_id": prompt_id, "timestamp": now_ms()}],
                ["execution_cached", {"nodes": [], "prompt_id": prompt_id, "timestamp": now_ms()}],
            ]
            entry: dict[str, Any] = {
                "prompt": item,
                "outputs": {},
                "status": {"status_str": "error", "completed": False, "messages": messages},
                "meta": {},
            }
            if kind == "crash_before_save":
                time.sleep(seconds / 2)
                self._log(event="crash", prompt_id=prompt_id, prefixes=prefixes, saved=False)
                os._exit(139)
            interrupted = self.interrupt.wait(3600.0 if kind == "exec_hang" else seconds)
            outcome = "success"
            if interrupted:
                outcome = "interrupted"
                messages.append(
                    [
                        "execution_interrupted",
                        {
                            "prompt_id": prompt_id,
                            "node_id": "3",
                            "node_type": "KSampler",
                            "executed": [],
                            "timestamp": now_ms(),
                        },
                    ]
                )
            elif kind == "exec_error":
                outcome = "error"
                messages.append(
                    [
                        "execution_error",
                        {
                            "prompt_id": prompt_id,
                            "node_id": "3",
                            "node_type": "KSampler",
                            "executed": [],
                            "exception_message": str(fault.get("message", "injected")),
                            "exception_type": "RuntimeError",
                            "traceback": [],
                            "current_inputs": {},
                            "current_outputs": {},
                            "timestamp": now_ms(),
                        },
                    ]
                )
            else:
                for node_id in outputs:
                    image = self._save(prompt, node_id, prompt_id)
                    entry["outputs"][node_id] = {"images": [image]}
                    entry["meta"][node_id] = {
                        "node_id": node_id,
                        "display_node": node_id,
                        "parent_node": None,
                        "real_node_id": node_id,
                    }
                self._log(
                    event="saved",
                    prompt_id=prompt_id,
                    prefixes=prefixes,
                    files=[i["images"][0]["filename"] for i in entry["outputs"].values()],
                )
                if kind == "crash_after_save":
                    self._log(event="crash", prompt_id=prompt_id, prefixes=prefixes, saved=True)
                    os._exit(139)
                messages.append(
                    ["execution_success", {"prompt_id": prompt_id, "timestamp": now_ms()}]
                )
                entry["status"].update(status_str="success", completed=True)
            with self.lock:
                self.history[prompt_id] = entry  # out of running, into the history: one step
                self.running = None
            self._log(event="end", prompt_id=prompt_id, prefixes=prefixes, outcome=outcome)


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("service", choices=("vllm", "comfyui"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model", default="m")
    args = parser.parse_args()
    settings = Settings(args.run_dir / "settings.json")
    faults = FaultFile(args.run_dir / "faults", args.service)

    def on_term(signum: int, frame: Any) -> None:
        delay = settings.seconds(f"{args.service}_term_seconds", 0.0)

        def leave() -> None:
            time.sleep(delay)
            os._exit(0)

        threading.Thread(target=leave, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    time.sleep(settings.seconds(f"{args.service}_boot_seconds", 0.0))  # the port refuses
    app: App = Vllm(args.model) if args.service == "vllm" else Comfy(args.run_dir, settings, faults)
    server = TcpServer(args.port, app, faults)
    print(f"{args.service} listening on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
