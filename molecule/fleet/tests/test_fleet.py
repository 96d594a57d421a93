"""Two boxes behind one patient proxy, read from the controller after converge (issue 33).

fleet-a runs the fleet's proxy (its own box on its local URLs, fleet-b by its address); each
box's arbiter lends its card to image jobs. The tests speak to the proxy with the agents' key
(the OpenAI SDK too), to each arbiter over the scenario's network, and read each box's vLLM
metrics to see which box answered. SIMULATION at the hardware and vendor edge.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import openai
import pytest
import requests
from labtest import wait_for

A, B = "cardshare-molecule-fleet-a", "cardshare-molecule-fleet-b"
AGENT_KEY = "csk-molecule-fleet-tests-lab-key"
AGENT_AUTH = {"Authorization": f"Bearer {AGENT_KEY}"}
MODEL = "Qwen2.5-7B-Instruct"
TOKEN_FILE = "/etc/cardshare/arbiter/token"
VLLM_KEY_FILE = "/etc/cardshare/vllm/api-key"


def workflow(steps: int) -> dict[str, Any]:
    """The arbiter scenario's text-to-image workflow; the ComfyUI stand-in's job lasts
    ``steps`` / 20 x its STANDIN_JOB_SECONDS (2 s)."""
    return {
        "1": {
            "class_type": "CheckpointLoaderSimple",
            "inputs": {"ckpt_name": "flux1-kontext-dev-fp8.safetensors"},
        },
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 512, "height": 512, "batch_size": 1},
        },
        "5": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["1", 0],
                "seed": 7,
                "steps": steps,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "simple",
                "positive": ["2", 0],
                "negative": ["3", 0],
                "latent_image": ["4", 0],
                "denoise": 1.0,
            },
        },
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {
            "class_type": "SaveImage",
            "inputs": {"images": ["6", 0], "filename_prefix": "fleet"},
        },
    }


def on(box: str, *argv: str) -> str:
    """A command's output on a lab host (the controller's engine runs both)."""
    return subprocess.run(
        ["docker", "exec", box, *argv], check=True, capture_output=True, text=True
    ).stdout


def address(box: str) -> str:
    out = subprocess.run(
        [
            "docker",
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            box,
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert out, f"{box} has no address on a bridge network"
    return out


@pytest.fixture(scope="module")
def proxy() -> str:
    return f"http://{address(A)}:8080"


@pytest.fixture(scope="module")
def arbiters() -> dict[str, str]:
    return {box: f"http://{address(box)}:8090" for box in (A, B)}


@pytest.fixture(scope="module")
def tokens() -> dict[str, str]:
    return {box: on(box, "cat", TOKEN_FILE).strip() for box in (A, B)}


def mode(arbiters: dict[str, str], box: str) -> str:
    resp = requests.get(f"{arbiters[box]}/v1/status", timeout=10)
    resp.raise_for_status()
    return str(resp.json()["mode"])


def modes(arbiters: dict[str, str]) -> dict[str, str]:
    return {box: mode(arbiters, box) for box in (A, B)}


def submit(arbiters: dict[str, str], tokens: dict[str, str], box: str, steps: int) -> str:
    resp = requests.post(
        f"{arbiters[box]}/v1/jobs",
        json={"workflow": workflow(steps)},
        headers={"Authorization": f"Bearer {tokens[box]}"},
        timeout=10,
    )
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def answered(box: str) -> float:
    """The requests a box's vLLM finished (vllm:request_success_total, every reason): its
    /metrics is open without the key, as vLLM's is; read on the box itself."""
    text = on(
        box,
        "python3",
        "-c",
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/metrics', "
        "timeout=5).read().decode())",
    )
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def complete(proxy: str, max_tokens: int = 4, timeout: float = 300) -> tuple[int, float]:
    started = time.monotonic()
    resp = requests.post(
        f"{proxy}/v1/completions",
        json={"model": MODEL, "prompt": "ping", "max_tokens": max_tokens},
        headers=AGENT_AUTH,
        timeout=timeout,
    )
    return resp.status_code, time.monotonic() - started


def both_llm(arbiters: dict[str, str]) -> None:
    def llm() -> bool:
        try:
            return set(modes(arbiters).values()) == {"llm"}
        except requests.RequestException:  # an arbiter (re)starting refuses its port a while
            return False

    wait_for("both boxes in llm mode", llm, 240, 2)


# --- the fleet as the role rendered it -------------------------------------------------------


def test_the_proxy_routes_over_both_boxes_with_their_keys() -> None:
    conf = json.loads(
        on(A, "docker", "exec", "arbiter-proxy-1", "cat", "/etc/cardshare/proxy.json")
    )
    boxes = {box["name"]: box for box in conf["boxes"]}
    assert boxes[A]["upstream_url"] == "http://127.0.0.1:8000"
    assert boxes[B]["upstream_url"] == f"http://{address(B)}:8000"
    assert boxes[B]["arbiter_url"] == f"http://{address(B)}:8090"
    assert {box["models"][0] for box in boxes.values()} == {MODEL}
    # each box's arbiter judges its own requests at the fleet's proxy (its entry there)
    for box, url in ((A, "http://127.0.0.1:8080"), (B, f"http://{address(A)}:8080")):
        arbiter = json.loads(
            on(box, "docker", "exec", "arbiter-arbiter-1", "cat", "/etc/cardshare/arbiter.json")
        )
        assert (arbiter["proxy_url"], arbiter["proxy_box"]) == (url, box)
    # fleet-b's key, copied to the proxy's host (private), is the key fleet-b's vLLM takes
    copied = on(A, "stat", "-c", "%a %U", f"/etc/cardshare/fleet-keys/{B}").split()
    assert copied == ["600", "root"]
    assert on(A, "cat", f"/etc/cardshare/fleet-keys/{B}") == on(B, "cat", VLLM_KEY_FILE)


def test_a_box_vllm_asks_for_its_key() -> None:
    vllm = f"http://{address(B)}:8000"
    assert requests.get(f"{vllm}/health", timeout=10).status_code == 200
    refused = requests.get(f"{vllm}/v1/models", timeout=10)
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    key = on(B, "cat", VLLM_KEY_FILE).strip()
    models = requests.get(
        f"{vllm}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert [m["id"] for m in models.json()["data"]] == [MODEL]


def test_openai_client_through_the_fleet_proxy(proxy: str) -> None:
    client = openai.OpenAI(base_url=f"{proxy}/v1", api_key=AGENT_KEY, timeout=60)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert reply.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=8,
            stream=True,
        )
    )
    assert len(chunks) > 2 and "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices
    )


def test_each_status_page_links_to_the_fleet_view(proxy: str, arbiters: dict[str, str]) -> None:
    view = f"{proxy}/proxy/fleet"
    for box in (A, B):
        page = requests.get(f"{arbiters[box]}/", timeout=10).text
        assert f'<a href="{view}" data-fleet>' in page, box
    fleet = requests.get(view, timeout=10)
    assert fleet.status_code == 200
    assert A in fleet.text and B in fleet.text


# --- routing by each box's mode ---------------------------------------------------------------


def test_one_box_in_image_mode_the_other_answers_at_once(
    proxy: str, arbiters: dict[str, str], tokens: dict[str, str]
) -> None:
    both_llm(arbiters)
    submit(arbiters, tokens, B, steps=300)  # about 30 s of image work on fleet-b
    wait_for("fleet-b in image mode", lambda: mode(arbiters, B) == "image", 120, 1)
    before = answered(A)
    results = [complete(proxy) for _ in range(6)]
    assert mode(arbiters, B) == "image", "fleet-b handed back before the requests ended"
    # no hold: each answered in seconds, where a hold lasts until fleet-b's job ends
    assert [code for code, _ in results] == [200] * 6, results
    assert max(seconds for _, seconds in results) < 5, results
    assert answered(A) - before == 6
    both_llm(arbiters)


def test_both_boxes_in_image_mode_hold_until_the_first_returns(
    proxy: str, arbiters: dict[str, str], tokens: dict[str, str]
) -> None:
    both_llm(arbiters)
    submit(arbiters, tokens, A, steps=200)  # about 20 s
    submit(arbiters, tokens, B, steps=200)
    wait_for("both boxes in image mode", lambda: set(modes(arbiters).values()) == {"image"}, 120, 1)
    returned: list[float] = []
    result: list[tuple[int, float]] = []
    sent = time.monotonic()
    agent = threading.Thread(target=lambda: result.append(complete(proxy)))
    agent.start()
    time.sleep(3)
    assert agent.is_alive(), f"answered while both boxes were lent out: {result}"

    def first_back() -> bool:
        if "llm" in modes(arbiters).values():
            returned.append(time.monotonic() - sent)
            return True
        return False

    wait_for("one box back in llm mode", first_back, 240, 0.5)
    agent.join(timeout=240)
    assert result and result[0][0] == 200, result
    # held until a box came back, then answered by it (within the proxy's poll of its arbiter)
    assert result[0][1] >= returned[0] - 2, (result, returned)
    both_llm(arbiters)


# --- a box lost mid-run ------------------------------------------------------------------------


def running(box: str) -> float:
    """vllm:num_requests_running of a box's vLLM, read over the network (/metrics is open)."""
    text = requests.get(f"http://{address(box)}:8000/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def load(
    proxy: str, agents: int, rounds: int, log: list[tuple[float, float, int]]
) -> list[threading.Thread]:
    """``agents`` threads each sending ``rounds`` completions through the proxy, one after
    the other (the stand-in's canned reply takes it about 0.15 s), logging (sent, answered,
    status) on the controller's monotonic clock."""
    lock = threading.Lock()

    def agent() -> None:
        for _ in range(rounds):
            sent = time.monotonic()
            code, _ = complete(proxy, max_tokens=200, timeout=120)
            with lock:
                log.append((sent, time.monotonic(), code))

    threads = [threading.Thread(target=agent) for _ in range(agents)]
    for t in threads:
        t.start()
    return threads


def test_a_box_whose_arbiter_is_killed_loses_no_request(
    proxy: str, arbiters: dict[str, str]
) -> None:
    both_llm(arbiters)
    log: list[tuple[float, float, int]] = []
    threads = load(proxy, 8, 20, log)
    wait_for("requests running on fleet-b", lambda: running(B) > 0, 30, 0.1)
    on(B, "docker", "kill", "arbiter-arbiter-1")
    for t in threads:
        t.join(timeout=300)
    try:
        # fleet-b's vLLM still answers what it runs; the proxy takes fleet-b out of rotation
        assert [code for _, _, code in log] == [200] * 160, log
    finally:
        on(B, "docker", "start", "arbiter-arbiter-1")


def test_a_box_whose_vllm_is_killed_loses_no_request(proxy: str, arbiters: dict[str, str]) -> None:
    both_llm(arbiters)
    log: list[tuple[float, float, int]] = []
    threads = load(proxy, 8, 20, log)
    # fleet-b's vLLM dies under requests it is running (none of them streams)
    wait_for("requests running on fleet-b", lambda: running(B) > 0, 30, 0.1)
    killed = time.monotonic()
    on(B, "docker", "kill", "vllm-vllm-1")
    for t in threads:
        t.join(timeout=300)
    assert len(log) == 160
    # every request sent once fleet-b's vLLM was gone ends on fleet-a (a refused connection
    # moves to the other box)
    after = [code for sent, _, code in log if sent > killed + 0.5]
    assert after and after == [200] * len(after), log
    # the ones fleet-b was running when it died had sent nothing to their clients: the proxy
    # moved them to fleet-a (a reset before any answer moves as a refused connection does)
    assert [code for _, _, code in log] == [200] * 160, [
        (sent - killed, code) for sent, _, code in log if code != 200
    ]
