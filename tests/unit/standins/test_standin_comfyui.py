"""comfyui_standin.py: graph validation, jobs, history, PNG output, /free and the card."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
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
            {"type": "invalid_prompt",
             "message": "Cannot execute because node FancyUpscaler does not exist.",
             "details": "Node ID '#8'", "extra_info": {}},
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
            # upstream errors: ComfyUI's top-level details list only the outputs' own
            {"type": "prompt_outputs_failed_validation",
             "message": "Prompt outputs failed validation", "details": "", "extra_info": {}},
            {"2": {"errors": [{"type": "required_input_missing",
                               "message": "Required input is missing", "details": "text",
                               "extra_info": {"input_name": "text"}}],
                   "dependent_outputs": ["7"], "class_type": "CLIPTextEncode"}},
        ),
        (
            graph(**{"1": {"class_type": "CheckpointLoaderSimple",
                           "inputs": {"ckpt_name": "missing.safetensors"}}}),
            {"type": "prompt_outputs_failed_validation",
             "message": "Prompt outputs failed validation", "details": "", "extra_info": {}},
            {"1": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
                               "details": f"ckpt_name: 'missing.safetensors' not in ['{CKPT}']",
                               "extra_info": {"input_name": "ckpt_name",
                                              "input_config": [[CKPT], {}],
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


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("filename=../../etc/passwd&type=output", 400),  # ".." in the name
        ("filename=/etc/passwd", 400),
        ("filename=a..b.png", 400),  # ComfyUI refuses any ".." in the name
        ("filename=passwd&subfolder=../../etc", 403),  # a subfolder outside the directory
        ("filename=passwd&subfolder=lab/../../x", 403),
        ("filename=x.png&type=models", 400),  # not output, input or temp
        ("type=output", 404),  # no filename at all
        ("filename=nope.png&type=output", 404),
        ("filename=nope.png&subfolder=lab&type=output", 404),
    ],
)
def test_view_refuses_escapes_and_missing(
    comfy: tuple[int, cs.ComfyState], query: str, status: int
) -> None:
    port, _ = comfy
    assert request(port, "GET", f"/view?{query}")[0] == status


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


# --------------------------------------------------- ComfyUI 0.8 semantics (issue 8)


@contextlib.contextmanager
def running(dirs: cs.Dirs, **env: str) -> Iterator[tuple[int, cs.ComfyState]]:
    """A stand-in without a card; a second ``running`` on the same dirs is a restart."""
    state = cs.ComfyState(dirs, None, {"STANDIN_JOB_SECONDS": "0.05", **env})
    server = cs.ComfyServer(("127.0.0.1", 0), state)
    state.start()
    serve_in_thread(server)
    try:
        yield int(server.server_address[1]), state
    finally:
        server.shutdown()
        server.server_close()
        state.shutdown()


def save_node(prefix: str, source: str = "6") -> dict[str, Any]:
    return {"class_type": "SaveImage", "inputs": {"images": [source, 0], "filename_prefix": prefix}}


def node_errors_of(prompt: dict[str, Any], dirs: cs.Dirs) -> tuple[Any, dict[str, Any]]:
    error, outputs, node_errors = cs.validate_prompt(prompt, dirs)
    assert outputs == []
    return error, node_errors


def test_a_latent_linked_into_an_image_input_is_a_return_type_mismatch(dirs: cs.Dirs) -> None:
    bad = graph(**{"7": save_node("lab/job", source="5")})
    error, node_errors = node_errors_of(bad, dirs)
    mismatch = {
        "type": "return_type_mismatch",
        "message": "Return type mismatch between linked nodes",
        "details": "images, received_type(LATENT) mismatch input_type(IMAGE)",
        "extra_info": {
            "input_name": "images",
            "input_config": ["IMAGE", {}],
            "received_type": "LATENT",
            "linked_node": ["5", 0],
        },
    }
    assert node_errors == {
        "7": {"errors": [mismatch], "dependent_outputs": ["7"], "class_type": "SaveImage"}
    }
    assert error["details"] == (
        "Return type mismatch between linked nodes: "
        "images, received_type(LATENT) mismatch input_type(IMAGE)"
    )


def test_a_missing_load_image_file_is_custom_validation_failed(dirs: cs.Dirs) -> None:
    (dirs.input / "sub").mkdir()
    (dirs.input / "sub" / "there.png").write_bytes(cs.make_png("x"))
    (dirs.output / "made.png").write_bytes(cs.make_png("y"))

    def edit(name: str) -> dict[str, Any]:
        return graph(**{
            "8": {"class_type": "LoadImage", "inputs": {"image": name}},
            "9": save_node("e", source="8"),
        })  # fmt: skip

    _, _, node_errors = cs.validate_prompt(edit("render.png"), dirs)
    assert node_errors == {
        "8": {
            "errors": [
                {
                    "type": "custom_validation_failed",
                    "message": "Custom validation failed for node",
                    "details": "image - Invalid image file: render.png",
                    "extra_info": {"input_name": "image"},
                }
            ],
            "dependent_outputs": ["9"],
            "class_type": "LoadImage",
        }
    }
    # a file in a subfolder of input, or annotated with its directory, is valid
    assert cs.validate_prompt(edit("sub/there.png"), dirs)[2] == {}
    assert cs.validate_prompt(edit("made.png [output]"), dirs)[2] == {}


def test_range_errors_carry_extra_info(dirs: cs.Dirs) -> None:
    bad = graph()
    bad["5"]["inputs"].update(steps="0", cfg=101.5)
    _, node_errors = node_errors_of(bad, dirs)
    assert node_errors["5"]["errors"] == [
        {
            "type": "value_smaller_than_min",
            "message": "Value 0 smaller than min of 1",
            "details": "steps",
            "extra_info": {
                "input_name": "steps",
                "input_config": ["INT", {"default": 20, "min": 1, "max": 10000}],
                "received_value": 0,
            },
        },
        {
            "type": "value_bigger_than_max",
            "message": "Value 101.5 bigger than max of 100.0",
            "details": "cfg",
            "extra_info": {
                "input_name": "cfg",
                "input_config": ["FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0}],
                "received_value": 101.5,
            },
        },
    ]


def test_a_link_to_a_node_that_does_not_exist(dirs: cs.Dirs) -> None:
    # linked from the output node itself: the exception reaches validate_prompt
    bad = graph(**{"7": save_node("lab/job", source="99")})
    error, node_errors = node_errors_of(bad, dirs)
    (reason,) = node_errors["7"]["errors"]
    assert (reason["type"], reason["message"], reason["details"]) == (
        "exception_during_validation", "Exception when validating node", "'99'")  # fmt: skip
    assert reason["extra_info"]["exception_type"] == "KeyError"
    assert isinstance(reason["extra_info"]["traceback"], list)
    assert error["details"] == "Exception when validating node: '99'"
    # further upstream: the node that linked to it is reported by its caller's check
    deep = graph()
    deep["5"]["inputs"]["model"] = ["99", 0]
    error, node_errors = node_errors_of(deep, dirs)
    assert list(node_errors) == ["5"]
    (reason,) = node_errors["5"]["errors"]
    assert reason["type"] == "exception_during_inner_validation"
    assert reason["details"] == "'99'"
    extra = reason["extra_info"]
    assert (extra["input_name"], extra["linked_node"], extra["exception_type"]) == (
        "samples", ["5", 0], "KeyError")  # fmt: skip
    assert error["details"] == ""


def test_an_unknown_node_class_over_http(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    bad = graph(**{"8": {"class_type": "FancyUpscaler", "inputs": {}}})
    status, _, raw = request(port, "POST", "/prompt", {"prompt": bad})
    assert status == 400
    assert json.loads(raw) == {
        "error": {
            "type": "invalid_prompt",
            "message": "Cannot execute because node FancyUpscaler does not exist.",
            "details": "Node ID '#8'",
            "extra_info": {},
        },
        "node_errors": {},
    }


@pytest.mark.parametrize("raw", [b'{"prompt": ', b"", b"null", b"42"])
def test_a_body_that_is_no_json_object_is_a_plain_text_500(
    comfy: tuple[int, cs.ComfyState], raw: bytes
) -> None:
    port, state = comfy
    status, headers, body = request(
        port, "POST", "/prompt", headers={"Content-Type": "application/json"}, raw=raw
    )
    assert (status, body) == (500, b"500 Internal Server Error\n\nServer got itself in trouble")
    assert headers["content-type"].startswith("text/plain")
    assert state.queue() == {"queue_running": [], "queue_pending": []}


def test_a_chunked_prompt_body_is_read(comfy: tuple[int, cs.ComfyState]) -> None:
    port, _ = comfy
    data = json.dumps({"prompt": graph(), "prompt_id": "chunked-1"}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/prompt", body=iter([data[:10], data[10:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)  # fmt: skip
    response = conn.getresponse()
    assert (response.status, json.loads(response.read())["prompt_id"]) == (200, "chunked-1")
    conn.close()


def test_a_prompt_is_always_in_exactly_one_place(dirs: cs.Dirs) -> None:
    """Pending, running, history: each move is one step under one lock (ComfyUI's queue)."""
    with running(dirs, STANDIN_JOB_SECONDS="0.01") as (port, state):
        ids = [f"p{i}" for i in range(12)]
        seen: list[list[str]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                for prompt_id in ids:
                    known = prompt_id in accepted  # before looking: accepted means queued
                    places = state.where(prompt_id)
                    if places or known:
                        seen.append(places)

        accepted: set[str] = set()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for prompt_id in ids:
            status, _, _ = request(port, "POST", "/prompt",
                                   {"prompt": graph(), "prompt_id": prompt_id})  # fmt: skip
            assert status == 200
            accepted.add(prompt_id)
        wait_for(lambda: all(state.where(i) == ["history"] for i in ids), "all prompts done")
        done.set()
        watcher.join(5)
    assert seen and all(len(places) == 1 for places in seen), [p for p in seen if len(p) != 1]


def test_history_is_memory_only_and_outputs_survive_a_restart(dirs: cs.Dirs) -> None:
    with running(dirs) as (port, _):
        assert history(port, "never-submitted") == {}
        status, _, _ = request(port, "POST", "/prompt",
                               {"prompt": graph(), "prompt_id": "job-1"})  # fmt: skip
        assert status == 200
        wait_for(lambda: history(port, "job-1").get("job-1"), "job-1 done")
    with running(dirs) as (port, _):  # the restarted server has no history ...
        assert history(port, "job-1") == {}
        assert json.loads(request(port, "GET", "/history")[2]) == {}
        assert json.loads(request(port, "GET", "/queue")[2]) == {
            "queue_running": [], "queue_pending": []}  # fmt: skip
        # ... but the arbiter finds the job's output on disk through /view
        status, _, data = request(
            port, "GET", "/view?filename=job_00001_.png&subfolder=lab&type=output"
        )
        assert status == 200 and data.startswith(b"\x89PNG")


def test_interrupt_names_the_running_prompt(dirs: cs.Dirs) -> None:
    with running(dirs, STANDIN_JOB_SECONDS="60") as (port, state):
        for prompt_id in ("first", "second", "third"):
            request(port, "POST", "/prompt", {"prompt": graph(), "prompt_id": prompt_id})
        wait_for(lambda: state.where("first") == ["running"], "first running")
        # an interrupt naming a prompt that is not running does nothing
        assert request(port, "POST", "/interrupt", {"prompt_id": "second"})[0::2] == (200, b"")
        time.sleep(0.2)
        assert state.where("first") == ["running"]
        assert request(port, "POST", "/interrupt", {"prompt_id": "first"})[0::2] == (200, b"")
        entry = wait_for(lambda: history(port, "first").get("first"), "first interrupted")
        assert (entry["status"]["status_str"], entry["status"]["completed"]) == ("error", False)
        kinds = [m[0] for m in entry["status"]["messages"]]
        assert kinds[-1] == "execution_interrupted" and "execution_error" not in kinds
        assert entry["outputs"] == {}
        wait_for(lambda: state.where("second") == ["running"], "second running")
        assert request(port, "POST", "/queue", {"clear": True})[0::2] == (200, b"")
        assert state.where("third") == []
        assert request(port, "POST", "/interrupt")[0] == 200  # no body: whatever runs
        wait_for(lambda: history(port, "second").get("second"), "second interrupted")
        status, _, body = request(
            port, "POST", "/free", {"unload_models": True, "free_memory": True}
        )
        assert (status, body) == (200, b"")


def test_saved_files_are_named_as_comfyui_names_them(dirs: cs.Dirs) -> None:
    (dirs.output / "lab").mkdir()
    (dirs.output / "lab" / "job_00041_.webp").write_bytes(b"older, other format")
    (dirs.output / "lab" / "jobs_00077_.png").write_bytes(b"another prefix")
    batch = graph()
    batch["4"]["inputs"]["batch_size"] = 2
    with running(dirs) as (port, _):
        first = submit(port, batch)
        entry = wait_for(lambda: history(port, first).get(first), "batch job")
        assert entry["outputs"]["7"]["images"] == [
            {"filename": "job_00042_.png", "subfolder": "lab", "type": "output"},
            {"filename": "job_00043_.png", "subfolder": "lab", "type": "output"},
        ]
        for name in ("job_00042_.png", "job_00043_.png"):
            status, headers, data = request(
                port, "GET", f"/view?filename={name}&subfolder=lab&type=output"
            )
            assert (status, headers["content-type"]) == (200, "image/png")
            assert headers["content-disposition"] == f'filename="{name}"'
            assert decode_png(data)[:2] == cs.IMAGE_SIZE
        assert request(port, "GET", "/view?filename=job_00044_.png&subfolder=lab")[0] == 404
        second = submit(port, graph(**{"7": save_node("a/b/c")}))
        entry = wait_for(lambda: history(port, second).get(second), "nested prefix")
        assert entry["outputs"]["7"]["images"] == [
            {"filename": "c_00001_.png", "subfolder": "a/b", "type": "output"}]  # fmt: skip
        third = submit(port, graph(**{"7": save_node("../evil")}))
        entry = wait_for(lambda: history(port, third).get(third), "escaping prefix")
        kind, details = entry["status"]["messages"][-1]
        assert (kind, details["node_id"], entry["status"]["status_str"]) == (
            "execution_error",
            "7",
            "error",
        )
        assert details["exception_message"].startswith(
            "**** ERROR: Saving image outside the output folder is not allowed.")  # fmt: skip
        assert not (dirs.output.parent / "evil_00001_.png").exists()
        preview = graph(**{"7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}}})
        fourth = submit(port, preview)
        entry = wait_for(lambda: history(port, fourth).get(fourth), "preview")
        (image,) = entry["outputs"]["7"]["images"]
        assert (image["type"], image["subfolder"]) == ("temp", "")
        assert (dirs.temp / image["filename"]).is_file()


def test_save_image_path_counts_like_comfyui(tmp_path: Path) -> None:
    for name in ("x_00003_.png", "x_7.png", "x_.png", "x_00009", "xy_00050_.png", "X_00020_.png"):
        (tmp_path / name).write_bytes(b"")
    folder, name, counter, subfolder = cs.save_image_path("x", tmp_path)
    assert (folder, name, subfolder) == (tmp_path, "x", "")
    assert counter == 10  # x_00009 counts, whatever follows; xy_ and X_ do not (POSIX case)
    assert cs.save_image_path("new/y", tmp_path)[1:] == ("y", 1, "new")
    assert (tmp_path / "new").is_dir()


def test_executions_are_counted_from_disk_across_restarts(dirs: cs.Dirs) -> None:
    with running(dirs) as (port, _):
        status, headers, raw = request(port, "GET", "/standin/executions")
        assert (status, json.loads(raw)) == (200, {})
        assert "stand-in only" in headers["x-cardshare-simulation"]
        request(port, "POST", "/prompt", {"prompt": graph(), "prompt_id": "dup"})
        wait_for(lambda: history(port, "dup").get("dup"), "first run")
    with running(dirs) as (port, _):  # the client resubmits after the restart: a duplicate
        request(port, "POST", "/prompt", {"prompt": graph(), "prompt_id": "dup"})
        wait_for(lambda: history(port, "dup").get("dup"), "second run")

        def counts(query: str) -> Any:
            return json.loads(request(port, "GET", f"/standin/executions{query}")[2])

        assert counts("") == {"dup": 2}
        assert counts("?outcome=success") == {"dup": 2}
        assert counts("?outcome=interrupted") == {}
        assert counts("?by=filename_prefix") == {"lab/job": 2}
        assert request(port, "GET", "/standin/executions?by=nonsense")[0] == 400
    lines = (dirs.output / ".standin-executions.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "end", "start", "end"]
    assert json.loads(lines[1])["files"] == [
        {"filename": "job_00001_.png", "subfolder": "lab", "type": "output"}]  # fmt: skip


def test_latency_knobs(dirs: cs.Dirs) -> None:
    env = {"STANDIN_QUEUE_LATENCY_MS": "300", "STANDIN_HISTORY_LATENCY_MS": "300",
           "STANDIN_AFTER_SAVE_MS": "1500"}  # fmt: skip
    with running(dirs, **env) as (port, state):
        for path in ("/queue", "/history/x"):
            started = time.monotonic()
            assert request(port, "GET", path)[0] == 200
            assert time.monotonic() - started >= 0.3
        request(port, "POST", "/prompt", {"prompt": graph(), "prompt_id": "slow"})
        saved = dirs.output / "lab" / "job_00001_.png"
        wait_for(saved.is_file, "the file on disk")
        # the file is there while the prompt still runs: no history entry yet
        assert state.where("slow") == ["running"]
        wait_for(lambda: state.where("slow") == ["history"], "the history entry")


def test_sampling_time_follows_the_steps(dirs: cs.Dirs, sim_env: Path) -> None:
    """STANDIN_JOB_SECONDS is the time of 20 steps: a workflow asking 200 runs 10 times
    longer (the site scenario keeps the arbiter busy with one long job this way)."""
    state = cs.ComfyState(dirs, None, {"STANDIN_JOB_SECONDS": "2"})
    prompt = graph()
    sampler = next(n for n in prompt.values() if n["class_type"] == "KSampler")
    assert state._sampling_seconds(prompt) == 2 * sampler["inputs"]["steps"] / 20
    sampler["inputs"]["steps"] = 200
    assert state._sampling_seconds(prompt) == 20.0
    assert state._sampling_seconds({"1": {"class_type": "SaveImage", "inputs": {}}}) == 2.0
