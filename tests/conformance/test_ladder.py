"""Every rung of the ladder the ``vllm`` role renders starts on real vLLM and answers.

The ladders are the role's own: its preflight (render_ladder.yml) with its settings and its
filters, for the example inventory and for the lab's (inventories/lab, which the demo and the
site scenario use). What differs from a real host, and why:

* the model: the tiny Qwen2 linked as the catalog entry's directory under a model root given
  as both ``vllm_model_dir`` and ``vllm_container_model_root`` (no container here), so the
  rung's model argument is the tiny model's path;
* ``vllm_port``: a free port of this machine;
* the card's memory (``xe_driver_cards``, 32 GiB, what the xe_driver role reads from a B70)
  and ``docker_engine_render_gid`` (0): what the roles before vllm would publish;
* vLLM's environment on the CPU (conftest.py): ``VLLM_CPU_KVCACHE_SPACE=1`` and a HOME of its own.

Each rung's argument list is passed to ``vllm serve`` as it is. Identical rungs (the two
inventories compute the same ladder today) start once. Each rung must answer ``/health``,
the arbiter's own one-token probe (``HttpLlm.one_token``) and ``/v1/models`` with the rung's
``max_model_len``. The result per rung is written to .cache/conformance/ladder.txt.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import CACHE, SERVED_NAME, free_port, run_playbook, vllm_env

from cardshare.arbiter.config import Config
from cardshare.arbiter.edges import HttpLlm

pytestmark = pytest.mark.conformance

INVENTORIES = ("example", "lab")
CARD_BYTES = 32 * 1024**3


def render_ladder(inventory: str, model_root: Path, port: int, out: Path) -> list[dict[str, Any]]:
    """The ladder the role computes for the inventory's host (render_ladder.yml)."""
    extra = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "vllm_model_dir": str(model_root),
        "vllm_container_model_root": str(model_root),
        "vllm_port": port,
        "xe_driver_cards": [{"vram_bytes": CARD_BYTES}],
        "docker_engine_render_gid": 0,
        "conformance_ladder_file": str(out),
        "conformance_model": SERVED_NAME,
    }
    run = run_playbook(f"inventories/{inventory}", "tests/conformance/render_ladder.yml", extra)
    assert run.returncode == 0, f"rendering {inventory}'s ladder failed:\n{run.stdout[-3000:]}"
    ladder = json.loads(out.read_text(encoding="utf-8"))["ladder"]
    assert isinstance(ladder, list) and ladder, f"{inventory}: an empty ladder"
    return ladder


@pytest.fixture(scope="module")
def rungs(model_root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The rungs of both inventories' ladders, each distinct argument list once."""
    port = free_port()
    out = tmp_path_factory.mktemp("ladders")
    unique: dict[tuple[str, ...], dict[str, Any]] = {}
    for inventory in INVENTORIES:
        for rung in render_ladder(inventory, model_root, port, out / f"{inventory}.json"):
            key = tuple(rung["args"])
            entry = unique.setdefault(key, {"rung": rung, "from": []})
            entry["from"].append(f"{inventory}#{rung['rung']}")
    return list(unique.values())


def arbiter_config(url: str, tmp: Path) -> Config:
    """The arbiter's settings as far as its vLLM edge reads them."""
    return Config(
        data_dir=tmp / "arbiter",
        vllm_url=url,
        served_model_name=SERVED_NAME,
        comfyui_url="http://127.0.0.1:9",
        card_current_json=tmp / "current.json",
        token_file=tmp / "token",
    )


async def arbiter_probe(url: str, tmp: Path) -> None:
    async with aiohttp.ClientSession() as session:
        await HttpLlm(session, arbiter_config(url, tmp)).one_token()


def models(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        doc: dict[str, Any] = json.load(resp)
        return doc


def test_both_inventories_render_the_three_rungs(rungs: list[dict[str, Any]]) -> None:
    # 65536 with YaRN 2.0, 49152 with YaRN 1.5, the native 32768 (issue 28); a rung more or
    # less changes what this lane starts, and its time
    for inventory in INVENTORIES:
        lengths = sorted(
            e["rung"]["max_model_len"]
            for e in rungs
            if any(f.startswith(inventory + "#") for f in e["from"])
        )
        assert lengths == [32768, 49152, 65536], (inventory, lengths)


def test_every_rung_starts_and_answers(
    rungs: list[dict[str, Any]], serve: Any, tmp_path: Path
) -> None:
    lines = []
    failures = []
    for entry in sorted(rungs, key=lambda e: e["rung"]["rung"]):
        rung = entry["rung"]
        name = f"rung {rung['rung']} ({rung['max_model_len']} tokens; {', '.join(entry['from'])})"
        server = serve(rung["args"], f"rung{rung['rung']}-{rung['max_model_len']}.log")
        if not server.wait_ready():
            tail = [line for line in server.log().splitlines() if "Error:" in line][-2:]
            failures.append(f"{name} did not start: {' | '.join(tail)}")
            lines.append(f"{name}: did not start (exit {server.proc.returncode})")
            continue
        try:
            assert server.health() == 200
            asyncio.run(arbiter_probe(server.url, tmp_path))
            doc = models(server.url)
            served = {m["id"]: m.get("max_model_len") for m in doc["data"]}
            assert served == {SERVED_NAME: rung["max_model_len"]}, served
        except (AssertionError, Exception) as exc:
            failures.append(f"{name} started but: {type(exc).__name__}: {exc}")
            lines.append(f"{name}: started in {server.ready_seconds:.0f}s, then failed: {exc}")
        else:
            lines.append(f"{name}: started in {server.ready_seconds:.0f}s; health, probe, models")
        server.stop()
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "ladder.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


# Run by the conformance virtualenv's Python: the RoPE settings vLLM's own config loader
# (the one `vllm serve` uses for --hf-overrides) ends with, for each override on stdin.
ROPE_PROBE = """
import json, sys
from vllm.transformers_utils.config import get_config
path, overrides = json.load(sys.stdin)
out = []
for o in overrides:
    config = get_config(path, False, hf_overrides_kw=json.loads(o))
    rope = dict(getattr(config, "rope_parameters", None) or {})
    out.append({"rope_parameters": rope, "rope_theta": getattr(config, "rope_theta", None)})
print("ROPE " + json.dumps(out))
"""


def test_yarn_overrides_keep_the_models_rope_base(
    rungs: list[dict[str, Any]], vllm_bin: Path, model_root: Path
) -> None:
    """The tiny model's RoPE base (250000) survives each rung's --hf-overrides in vLLM."""
    model = model_root / "Qwen2.5-7B-Instruct"
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    assert theta == 250000.0
    overrides = [
        (e["rung"], e["rung"]["args"][e["rung"]["args"].index("--hf-overrides") + 1])
        for e in rungs
        if "--hf-overrides" in e["rung"]["args"]
    ]
    if not overrides:
        return  # no YaRN rung: nothing replaces the model's RoPE settings
    run = subprocess.run(
        [str(vllm_bin / "python"), "-c", ROPE_PROBE],
        input=json.dumps([str(model), [o for _, o in overrides]]),
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("ROPE "))
    results = json.loads(line.removeprefix("ROPE "))
    lost = [
        f"rung {rung['rung']} ({rung['max_model_len']}): {o} -> {r}"
        for (rung, o), r in zip(overrides, results, strict=True)
        if (r["rope_parameters"].get("rope_theta") or r["rope_theta"]) != theta
    ]
    assert not lost, "the override drops the model's rope_theta 250000:\n" + "\n".join(lost)
