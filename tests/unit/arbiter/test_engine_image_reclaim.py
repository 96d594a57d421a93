"""Image jobs and the card: ComfyUI's peak VRAM learned per workflow from the card data, and
ComfyUI asked to free another workflow's models before a job that would not fit beside
them; the release proven by the card data, never by /free's answer, and never asked while a
prompt runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from arbiter_fakes import PNG, WORKFLOW, FakeClock, World, make_engine, run_until

from cardshare.arbiter.cardview import CardClient
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.plans import image_reclaim, workflow_signature
from cardshare.arbiter.store import JobState

GIB = 2**30

MODEL_A: dict[str, Any] = {
    "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "a.safetensors"}},
    "2": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 20}},
    "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024}},
    "4": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "x"}},
}


def other_models(workflow: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(workflow)
    changed["1"]["inputs"]["ckpt_name"] = "b.safetensors"
    return changed


def test_the_signature_ignores_prompts_seeds_and_names_but_not_models_or_sizes() -> None:
    same = copy.deepcopy(MODEL_A)
    same["2"]["inputs"]["seed"] = 99
    same["4"]["inputs"]["filename_prefix"] = "other"
    assert workflow_signature(same) == workflow_signature(MODEL_A)
    assert workflow_signature(other_models(MODEL_A)) != workflow_signature(MODEL_A)
    larger = copy.deepcopy(MODEL_A)
    larger["3"]["inputs"]["width"] = 2048
    assert workflow_signature(larger) != workflow_signature(MODEL_A)


@pytest.mark.parametrize(
    ("peak", "comfy", "others", "same", "free_first"),
    [
        (None, 20 * GIB, 0, False, False),  # never run: nothing to compare
        (20 * GIB, 0, 4 * GIB, False, False),  # fits
        (20 * GIB, 20 * GIB, 4 * GIB, True, False),  # its own models, loaded: fits
        (20 * GIB, 20 * GIB, 4 * GIB, False, True),  # another workflow's models: free them
        (20 * GIB, 20 * GIB, 14 * GIB, True, False),  # others hold it: /free cannot help
        (20 * GIB, 0, 14 * GIB, False, False),
    ],
)
def test_when_to_free_comfyuis_memory(
    peak: int | None, comfy: int, others: int, same: bool, free_first: bool
) -> None:
    got = image_reclaim(peak, 32 * GIB, comfy, others, GIB, same)
    assert got.free_first is free_first, got.reason


def submit(engine: Engine, workflow: dict[str, Any]) -> str:
    return engine.submit_job(workflow, {}).id


def done(engine: Engine, ids: list[str]) -> bool:
    return all(engine.store.job(i).state is JobState.DONE for i in ids)  # type: ignore[union-attr]


async def test_a_peak_is_learned_then_another_workflows_models_are_freed_first(
    tmp_path: Path,
) -> None:
    world = World(FakeClock())
    world.card_total = 32 * GIB
    world.others.append(CardClient("retrieval/ovms", 6 * GIB, ()))
    engine = make_engine(
        tmp_path, world, idle_seconds=1.0, resident_client_names=("retrieval/ovms",)
    )
    first = submit(engine, MODEL_A)
    await run_until(engine, lambda e: done(e, [first]))
    assert engine.store.workflow_peak(workflow_signature(MODEL_A)) == 20 * GIB
    assert not any(c.startswith("free") for c in world.calls)
    # the same workflow again: its models are loaded and fit, no /free
    again = submit(engine, MODEL_A)
    await run_until(engine, lambda e: done(e, [again]))
    assert not any(c.startswith("free") for c in world.calls)
    # a workflow with other models, learned in an earlier run...
    engine.store.record_workflow_peak(workflow_signature(other_models(MODEL_A)), 20 * GIB, 0.0)
    other = submit(engine, other_models(MODEL_A))
    await run_until(engine, lambda e: done(e, [other]))
    frees = [c for c in world.calls if c.startswith("free")]
    assert frees == ["free (queue 0)"]  # asked once, with no prompt in ComfyUI
    # ComfyUI then holds the other workflow's models
    assert engine.reclaim.comfy_signature == workflow_signature(other_models(MODEL_A))


async def test_the_release_is_awaited_in_the_card_data_not_in_free_s_answer(
    tmp_path: Path,
) -> None:
    world = World(FakeClock())
    world.card_total = 32 * GIB
    world.free_delay = 4.0  # /free answers at once, the memory goes 4 s later
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    engine.store.record_workflow_peak(workflow_signature(other_models(MODEL_A)), 20 * GIB, 0.0)
    first = submit(engine, MODEL_A)
    await run_until(engine, lambda e: done(e, [first]))
    world.calls.clear()
    asked_at: list[float] = []
    submitted_at: list[float] = []
    original_free, original_submit = engine.comfy.free, engine.comfy.submit

    async def free() -> None:
        asked_at.append(world.clock.now())
        await original_free()

    async def submit_prompt(workflow: dict[str, Any], prompt_id: str) -> str:
        submitted_at.append(world.clock.now())
        return await original_submit(workflow, prompt_id)

    engine.comfy.free = free  # type: ignore[method-assign]
    engine.comfy.submit = submit_prompt  # type: ignore[method-assign]
    second = submit(engine, other_models(MODEL_A))
    await run_until(engine, lambda e: done(e, [second]))
    assert len(asked_at) == 1 and len(submitted_at) == 1
    assert submitted_at[0] - asked_at[0] >= world.free_delay


async def test_a_workflow_never_run_before_is_never_held_back(tmp_path: Path) -> None:
    world = World(FakeClock())
    world.card_total = 32 * GIB
    engine = make_engine(tmp_path, world, idle_seconds=1.0)
    ids = [submit(engine, MODEL_A), submit(engine, other_models(MODEL_A)), submit(engine, WORKFLOW)]
    await run_until(engine, lambda e: done(e, ids))
    assert not any(c.startswith("free") for c in world.calls)
    assert PNG  # the fakes' image, unused here: jobs without inputs
