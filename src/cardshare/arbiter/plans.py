"""vLLM's plans and the card's tenants, as pure functions (no I/O).

The vllm role computes a ladder of plans: the full plan first, then smaller ones (less of
the card, a shorter context) down to the floor the user set. Before every start of vLLM the
engine measures what the card has free (its size minus what every other client holds, as
the recorder saw it) and asks :func:`choose_plan` for the largest plan that fits with the
headroom. A start that fails for want of VRAM goes through :func:`vram_pass`: the first
failure reclaims and retries the same plan, the second steps down one plan, the third ends
the series (the arbiter stays out of ``llm`` until the card changes). While a smaller plan
serves, :func:`should_restore` says when a larger one fits again at an idle moment.

Tenants by kind: ``owner`` (vLLM and ComfyUI, traded whole), ``resident`` (stays through
every swap: the retrieval tier), ``yielding`` (work that steps aside when asked) and
``foreign`` (Plex, and anything the arbiter does not know).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cardshare.arbiter.cardview import CardView
from cardshare.errors import VRAM_MAX_ATTEMPTS


class TenantKind(StrEnum):
    OWNER = "owner"
    RESIDENT = "resident"
    YIELDING = "yielding"
    FOREIGN = "foreign"


@dataclass(frozen=True)
class Tenant:
    name: str
    kind: TenantKind
    vram_bytes: int
    busy_engines: tuple[str, ...]


def tenants(
    view: CardView,
    owners: Sequence[str],
    residents: Sequence[str] = (),
    yielding: Sequence[str] = (),
) -> list[Tenant]:
    """Every client of the view with its kind; a name the arbiter does not know is foreign."""
    kinds: dict[str, TenantKind] = {}
    for names, kind in (
        (yielding, TenantKind.YIELDING),
        (residents, TenantKind.RESIDENT),
        (owners, TenantKind.OWNER),
    ):
        kinds.update(dict.fromkeys(names, kind))
    return [
        Tenant(c.name, kinds.get(c.name, TenantKind.FOREIGN), c.vram_bytes, c.busy_engines)
        for c in view.clients
    ]


@dataclass(frozen=True)
class LlmPlan:
    """One rung of the ladder: the compose service that runs it and what it asks of the card.

    ``reservation_bytes`` is what vLLM wants free at start (its utilisation of the card's
    size); 0 when unknown (a single plan from an older config: always started)."""

    service: str
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    reservation_bytes: int = 0
    project: str | None = None  # its compose project; None: the llm container's


@dataclass(frozen=True)
class FreeVram:
    total: int | None  # the card's size (the driver's, or the config's); None: unknown
    held: int  # what the other clients hold
    holders: tuple[tuple[str, int], ...]  # (name, bytes) of each other client holding VRAM

    @property
    def free(self) -> int | None:
        return None if self.total is None else max(0, self.total - self.held)

    def describe_holders(self) -> str:
        return (
            ", ".join(f"{name} {_gib(size)}" for name, size in self.holders)
            or "nobody else holds VRAM"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def measure_free(view: CardView, llm_names: Sequence[str], total: int | None = None) -> FreeVram:
    """The card's size minus what every client but vLLM itself holds (vLLM's own memory is
    what a start replaces). On a pool, the tightest card's: vLLM asks the same share of
    every card, so the card with the least free decides (unknown when a card's size is)."""
    mine = set(llm_names)
    frees = []
    for pdev, card in view.per_card():
        on = "" if pdev is None else f" on {pdev}"
        holders = tuple(
            (c.name + on, c.vram_bytes)
            for c in card.clients
            if c.name not in mine and c.vram_bytes > 0
        )
        size = total if total is not None else card.vram_total_bytes
        frees.append(FreeVram(size, sum(b for _, b in holders), holders))
    unknown = [f for f in frees if f.free is None]
    return unknown[0] if unknown else min(frees, key=lambda f: f.free or 0)


@dataclass(frozen=True)
class PlanChoice:
    index: int
    reason: str


def choose_plan(plans: Sequence[LlmPlan], free: FreeVram, headroom: int) -> PlanChoice:
    """The largest plan (the lowest index) whose reservation plus the headroom fits what is
    free. When none fits, the smallest: vLLM refuses by itself when memory is short, and that
    failure goes through the bounded passes of :func:`vram_pass`."""
    if not plans:
        raise ValueError("no plan to choose from")
    if free.free is None:
        return PlanChoice(0, "the card's size is unknown: the full plan")
    for index, plan in enumerate(plans):
        if plan.reservation_bytes + headroom <= free.free:
            return PlanChoice(
                index,
                f"{_gib(free.free)} free ({free.describe_holders()}): "
                f"plan {index} needs {_gib(plan.reservation_bytes)} + {_gib(headroom)} headroom",
            )
    last = len(plans) - 1
    return PlanChoice(
        last,
        f"{_gib(free.free)} free ({free.describe_holders()}): no plan fits with "
        f"{_gib(headroom)} headroom; trying the smallest (plan {last}, "
        f"{_gib(plans[last].reservation_bytes)})",
    )


class PassAction(StrEnum):
    RETRY_AFTER_RECLAIM = "retry_after_reclaim"  # reclaim, then the same plan again
    STEP_DOWN = "step_down"  # the next smaller plan
    GIVE_UP = "give_up"  # the series ends: stay out of llm until the card changes


@dataclass(frozen=True)
class VramPass:
    action: PassAction
    plan: int  # the plan of the next attempt (the failed one for GIVE_UP)


# vLLM's own words when the KV cache for max_model_len does not fit the memory it got: a
# shorter context is the fix, not the same plan again (errors.py names the patterns)
CONTEXT_BOUND_PATTERNS = frozenset(
    {"vllm_kv_cache_too_small", "vllm_max_seq_len_over_kv_cache", "vllm_no_cache_memory"}
)


def vram_pass(
    failed_plan: int, failures: int, plan_count: int, context_bound: bool = False
) -> VramPass:
    """What follows the ``failures``-th insufficient-VRAM failure of a start series.

    1: reclaim and retry the same plan; 2: one plan down (the same when it is the smallest);
    ``VRAM_MAX_ATTEMPTS`` (3) or more: give up. Never more than three attempts a series.
    ``context_bound`` (the KV cache for the plan's context did not fit): one plan down at
    once, and give up when there is none (retrying the same context cannot help)."""
    if failures < 1:
        raise ValueError(f"failures is {failures}: a pass follows a failure")
    if failures >= VRAM_MAX_ATTEMPTS:
        return VramPass(PassAction.GIVE_UP, failed_plan)
    if context_bound:
        if failed_plan + 1 >= plan_count:
            return VramPass(PassAction.GIVE_UP, failed_plan)
        return VramPass(PassAction.STEP_DOWN, failed_plan + 1)
    if failures == 1:
        return VramPass(PassAction.RETRY_AFTER_RECLAIM, failed_plan)
    return VramPass(PassAction.STEP_DOWN, min(failed_plan + 1, plan_count - 1))


def card_changed(before: FreeVram, now: FreeVram, margin: int) -> bool:
    """After a series gave up: has the card changed enough to try again? More free memory
    than at the give-up by at least ``margin``, or another set of holders."""
    if before.free is not None and now.free is not None and now.free >= before.free + margin:
        return True
    return {n for n, _ in before.holders} != {n for n, _ in now.holders}


def should_restore(
    plans: Sequence[LlmPlan], current: int, free: FreeVram, headroom: int
) -> PlanChoice | None:
    """While plan ``current`` > 0 serves: the larger plan that fits now, else None. ``free``
    is measured without vLLM's own memory (which the restart gives back)."""
    if current <= 0 or free.free is None:
        return None
    choice = choose_plan(plans[:current], free, headroom)
    fits = plans[choice.index].reservation_bytes + headroom <= free.free
    return choice if fits else None


# -- image jobs: what a workflow needs, and when to ask ComfyUI to free its memory ----------

MODEL_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".onnx")
SIZE_INPUTS = frozenset({"width", "height", "batch_size", "length", "megapixels", "upscale_by"})


def workflow_signature(workflow: Mapping[str, Any]) -> str:
    """What decides a workflow's VRAM, as a short hash: each node's class, the model files it
    loads and the sizes it renders at. Seeds, prompts, input images and file names do not
    count: two jobs of one workflow with other prompts share their peak."""
    nodes = []
    for node_id in sorted(workflow, key=str):
        node = workflow[node_id]
        if not isinstance(node, Mapping):
            continue
        raw = node.get("inputs")
        inputs: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        kept = {
            key: value
            for key, value in sorted(inputs.items())
            if (isinstance(value, str) and value.lower().endswith(MODEL_SUFFIXES))
            or (
                key in SIZE_INPUTS
                and isinstance(value, int | float)
                and not isinstance(value, bool)
            )
        }
        nodes.append([str(node.get("class_type")), kept])
    text = json.dumps(nodes, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ImageReclaim:
    free_first: bool  # POST /free and wait for the release before the job
    reason: str


def image_reclaim(
    peak: int | None,
    total: int | None,
    comfy_holds: int,
    others_hold: int,
    headroom: int,
    same_models: bool,
) -> ImageReclaim:
    """Before a job: does it fit what is free, counting ComfyUI's own cached models as free
    only when the previous job loaded the same ones (``same_models``)? When it does not and
    ComfyUI holds memory it could give back, free it first. ComfyUI's memory is the only one
    the arbiter can reclaim here (the others are foreign or resident); a job that still does
    not fit runs anyway, and an insufficient-VRAM failure is retried in bounded passes."""
    if peak is None:
        return ImageReclaim(False, "a workflow never run before: no peak to compare")
    if total is None:
        return ImageReclaim(False, "the card's size is unknown")
    usable = total - others_hold - (0 if same_models else comfy_holds)
    need = peak + headroom
    if usable >= need:
        return ImageReclaim(False, f"its peak {_gib(peak)} fits {_gib(usable)} free")
    if same_models or comfy_holds <= 0:
        return ImageReclaim(
            False,
            f"its peak {_gib(peak)} + {_gib(headroom)} headroom is more than the "
            f"{_gib(usable)} free, held by others: run it, bounded retries if it fails",
        )
    return ImageReclaim(
        True,
        f"its peak {_gib(peak)} + {_gib(headroom)} headroom is more than the {_gib(usable)} "
        f"free while ComfyUI holds {_gib(comfy_holds)} of another workflow's models",
    )
