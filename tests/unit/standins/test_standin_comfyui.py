"""comfyui_standin.py: graph validation, jobs, history, PNG output, /free and the card."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import comfyui_standin as cs
import pytest
import simcard
from standin_http import serve_in_thread
from standin_testlib import VRAM_TOTAL, decode_png, request, wait_for

GIB = 1024**3
CKPT = "flux1-kontext-dev-fp8.safetensors"


def graph(**changes: Any) -> dict[str, Any]:
    nodes: dict[str, Any] = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CKPT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage",
              "inputs": {"width": 1328, "height": 800, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "seed": 42, "steps": 24, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0],
            "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage",
              "inputs": {"images": ["6", 0], "filename_prefix": "lab/job"}},
    }  # fmt: skip
    for node_id, value in changes.items():
        if value is None:
            del nodes[node_id]
        else:
            nodes[node_id] = value
    return nodes


@pytest.fixture
def dirs(tmp_path: Path) -> cs.Dirs:
    base = tmp_path / "comfy"
    (base / "models" / "checkpoints").mkdir(parents=True)
    (base / "models" / "checkpoints" / CKPT).write_bytes(b"")
    args = cs.build_parser().parse_args(["--base-directory", str(base)])
    return cs.make_dirs(args)


@pytest.mark.parametrize(
    ("prompt", "error", "node_errors"),
    [
        (graph(), None, {}),
        (
            graph(**{"8": {"class_type": "FancyUpscaler", "inputs": {}}}),
            {"type": "missing_node_type",
             "message": "Node 'FancyUpscaler' not found. The custom node may not be installed.",
             "details": "Node ID '#8'",
             "extra_info": {"node_id": "8", "class_type": "FancyUpscaler",
                            "node_title": "FancyUpscaler"}},
            {},
        ),
        (
            graph(**{"8": {"inputs": {}}}),
            {"type": "invalid_prompt",
             "message": "Cannot execute because a node is missing the class_type property.",
             "details": "Node ID '#8'", "extra_info": {}},
            {},
        ),
        (
            graph(**{"7": None}),
            {"type": "prompt_no_outputs", "message": "Prompt has no outputs", "details": "",
             "extra_info": {}},
            {},
        ),
        (
            graph(**{"2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1]}}}),
            {"type": "prompt_outputs_failed_validation",
             "message": "Prompt outputs failed validation",
             "details": "Required input is missing: text", "extra_info": {}},
            {"2": {"errors": [{"type": "required_input_missing",
                               "message": "Required input is missing", "details": "text",
                               "extra_info": {"input_name": "text"}}],
                   "dependent_outputs": ["7"], "class_type": "CLIPTextEncode"}},
        ),
        (
            graph(**{"1": {"class_type": "CheckpointLoaderSimple",
                           "inputs": {"ckpt_name": "missing.safetensors"}}}),
            {"type": "prompt_outputs_failed_validation",
             "message": "Prompt outputs failed validation",
             "details": f"Value not in list: ckpt_name: 'missing.safetensors' not in ['{CKPT}']",
             "extra_info": {}},
            {"1": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
                               "details": f"ckpt_name: 'missing.safetensors' not in ['{CKPT}']",
                               "extra_info": {"input_name": "ckpt_name",
                                              "received_value": "missing.safetensors"}}],
                   "dependent_outputs": ["7"], "class_type": "CheckpointLoaderSimple"}},
        ),
    ],
)  # fmt: skip
def test_validate_prompt(
    dirs: cs.Dirs, prompt: dict[str, Any], error: Any, node_errors: dict[str, Any]
) -> None:
    got_error, outputs, got_node_errors = cs.validate_prompt(prompt, dirs)
    assert (got_error, got_node_errors) == (error, node_errors)
    assert outputs == ([] if error else ["7"])


def test_value_out_of_range_is_reported(dirs: cs.Dirs) -> None:
    bad = graph()
    bad["5"]["inputs"]["steps"] = 0
    _, _, node_errors = cs.validate_prompt(bad, dirs)
    assert node_errors["5"]["errors"][0]["message"] == "Value 0 smaller than min of 1"


def test_make_png_is_a_valid_deterministic_png() -> None:
    first = cs.make_png("a photo|42", text={"Software": "x"})
    assert first == cs.make_png("a photo|42", text={"Software": "x"})
    assert first != cs.make_png("a photo|43", text={"Software": "x"})
    assert decode_png(first)[:2] == cs.IMAGE_SIZE


@pytest.fixture
def comfy(dirs: cs.Dirs, sim_env: Path) -> Iterator[tuple[int, cs.ComfyState]]:
    card = simcard.SimClient("python3", ["python3", "main.py"], root=sim_env, container_id=None)
    env = {"STANDIN_JOB_SECONDS": "0.05", "STANDIN_FREE_DELAY": "0.2"}
    state = cs.ComfyState(dirs, card, env)
    server = cs.ComfyServer(("127.0.0.1", 0), state)
    state.start()
    serve_in_thread(server)
    yield int(server.server_address[1]), state
    server.shutdown()
    server.server_close()
    state.shutdown()
    card.close()


def history(port: int, prompt_id: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(request(port, "GET", f"/history/{prompt_id}")[2])
    return result


def submit(port: int, prompt: dict[str, Any]) -> str:
    status, _, raw = request(port, "POST", "/prompt", {"prompt": prompt, "client_id": "lab"})
    reply = json.loads(raw)
    assert status == 200, reply
    assert set(reply) == {"prompt_id", "number", "node_errors"}
    return str(reply["prompt_id"])


def test_job_history_and_view(comfy: tuple[int, cs.ComfyState], sim_env: Path) -> None:
    port, state = comfy
    assert history(port, "unknown") == {}
    prompt_id = submit(port, graph())
    entry = wait_for(lambda: history(port, prompt_id).get(prompt_id), "history entry")
    assert entry["status"]["status_str"] == "success"
    assert entry["status"]["completed"] is True
    assert [m[0] for m in entry["status"]["messages"]] == [
        "execution_start", "execution_cached", "execution_success"]  # fmt: skip
    image = entry["outputs"]["7"]["images"][0]
    assert image == {"filename": "job_00001_.png", "subfolder": "lab", "type": "output"}
    status, headers, data = request(
        port, "GET", "/view?filename=job_00001_.png&subfolder=lab&type=output"
    )
    assert (status, headers["content-type"]) == (200, "image/png")
    assert decode_png(data)[:2] == cs.IMAGE_SIZE
    assert prompt_id in json.loads(request(port, "GET", "/history")[2])
    # the model stays loaded on the card after the job
    assert state.card is not None and state.card.registered
    stats = json.loads(request(port, "GET", "/system_stats")[2])
    device = stats["devices"][0]
    assert "SIMULATION" in device["name"]
    assert (device["vram_total"], device["vram_free"]) == (VRAM_TOTAL, VRAM_TOTAL - 20 * GIB)
    snap = state.card.snapshot()
    assert snap is not None and snap.cycles["ccs"] > 0 and snap.cycles["vcs"] == 0


def test_second_job_numbers_the_file(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    ids = [submit(port, graph()) for _ in range(2)]
    entries = [wait_for(lambda i=i: history(port, i).get(i), "history") for i in ids]
    names = [e["outputs"]["7"]["images"][0]["filename"] for e in entries]
    assert names == ["job_00001_.png", "job_00002_.png"]


def test_prompt_errors_are_400(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    bad = graph(**{"2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1]}}})
    status, _, raw = request(port, "POST", "/prompt", {"prompt": bad})
    reply = json.loads(raw)
    assert status == 400
    assert reply["error"]["type"] == "prompt_outputs_failed_validation"
    assert reply["node_errors"]["2"]["errors"][0]["type"] == "required_input_missing"
    status, _, raw = request(port, "POST", "/prompt", {"client_id": "x"})
    assert (status, json.loads(raw)["error"]["message"]) == (400, "No prompt provided")


def test_view_refuses_escapes_and_missing(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    assert request(port, "GET", "/view?filename=../../etc/passwd&type=output")[0] == 403
    assert request(port, "GET", "/view?filename=nope.png&type=output")[0] == 404


def test_interrupt_and_queue(dirs: cs.Dirs, sim_env: Path) -> None:
    state = cs.ComfyState(dirs, None, {"STANDIN_JOB_SECONDS": "60"})
    server = cs.ComfyServer(("127.0.0.1", 0), state)
    state.start()
    serve_in_thread(server)
    port = int(server.server_address[1])
    try:
        first, second = submit(port, graph()), submit(port, graph())
        queue = wait_for(
            lambda: (q := json.loads(request(port, "GET", "/queue")[2]))["queue_running"] and q,
            "a running job",
        )
        assert [item[1] for item in queue["queue_running"]] == [first]
        assert [item[1] for item in queue["queue_pending"]] == [second]
        assert history(port, first) == {}
        assert request(port, "POST", "/queue", {"delete": [second]})[0] == 200
        assert request(port, "POST", "/interrupt")[0] == 200
        entry = wait_for(lambda: history(port, first).get(first), "interrupted entry")
        assert entry["status"]["status_str"] == "error"
        assert entry["status"]["completed"] is False
        assert entry["status"]["messages"][-1][0] == "execution_interrupted"
        assert json.loads(request(port, "GET", "/queue")[2]) == {
            "queue_running": [], "queue_pending": []}  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
        state.shutdown()


def test_free_releases_later(comfy: tuple[int, cs.ComfyState]) -> None:
    port, state = comfy
    prompt_id = submit(port, graph())
    wait_for(lambda: history(port, prompt_id).get(prompt_id), "job")
    assert state.card is not None
    status, _, body = request(port, "POST", "/free", {"unload_models": True, "free_memory": True})
    assert (status, body) == (200, b"")
    assert state.card.registered  # answered at once, still holding the memory
    card = state.card
    wait_for(lambda: not card.registered, "the delayed free")
    assert not any(p.name.isdigit() for p in (state.card.root / "proc").iterdir())


def test_out_of_memory_when_the_card_is_taken(
    comfy: tuple[int, cs.ComfyState], sim_env: Path
) -> None:
    port, state = comfy
    vllm = simcard.SimClient("VLLM::EngineCor", ["vllm"], root=sim_env, container_id=None)
    vllm.register(vram=int(VRAM_TOTAL * 0.85))
    try:
        prompt_id = submit(port, graph())
        entry = wait_for(lambda: history(port, prompt_id).get(prompt_id), "failed job")
    finally:
        vllm.close()
    assert entry["status"]["status_str"] == "error"
    kind, details = entry["status"]["messages"][-1]
    assert kind == "execution_error"
    assert details["exception_type"] == "torch.OutOfMemoryError"
    assert details["node_type"] == "CheckpointLoaderSimple"
    assert details["exception_message"] == (
        "XPU out of memory. Tried to allocate 20.00 GiB (GPU 0; 32.00 GiB total capacity; "
        "4.80 GiB free)"
    )
    assert state.card is not None and not state.card.registered


def test_upload_then_load_image(comfy: tuple[int, cs.ComfyState], dirs: cs.Dirs) -> None:
    port, _ = comfy
    boundary = uuid.uuid4().hex
    png = cs.make_png("input")
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="in.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + png
        + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="overwrite"\r\n\r\ntrue'
            f"\r\n--{boundary}--\r\n"
        ).encode()
    )
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, _, raw = request(port, "POST", "/upload/image", headers=headers, raw=body)
    assert (status, json.loads(raw)) == (200, {"name": "in.png", "subfolder": "", "type": "input"})
    assert (dirs.input / "in.png").read_bytes() == png
    info = json.loads(request(port, "GET", "/object_info/LoadImage")[2])
    assert info["LoadImage"]["input"]["required"]["image"][0] == ["in.png"]
    edit = graph(**{
        "8": {"class_type": "LoadImage", "inputs": {"image": "in.png"}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "e"}},
    })  # fmt: skip
    assert cs.validate_prompt(edit, dirs)[0] is None


def test_object_info_lists_the_nodes(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    info = json.loads(request(port, "GET", "/object_info")[2])
    for name in (
        "CheckpointLoaderSimple",
        "UNETLoader",
        "CLIPTextEncode",
        "KSampler",
        "VAEDecode",
        "SaveImage",
        "LoadImage",
        "EmptyLatentImage",
        "ReferenceLatent",
    ):
        assert name in info  # fmt: skip
    assert info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0] == [CKPT]
    assert info["SaveImage"]["output_node"] is True
    assert info["KSampler"]["output"] == ["LATENT"]


def test_comfyui_argv_refuses_unknown_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cs.build_parser().parse_args(["--listen", "--port", "8188", "--bogus"])
    assert caught.value.code == 2
    assert "main.py: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_threads_are_not_left_running() -> None:
    assert all(t.name != "prompt-worker" or not t.is_alive() for t in threading.enumerate())
