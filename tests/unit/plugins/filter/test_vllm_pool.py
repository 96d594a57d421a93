"""vLLM over a pool of cards: the TP size, the share per card from each card's own
reservations (the tightest card wins), the render nodes by PCI path, and the one-card host's
plan unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped,unused-ignore]
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.vllm_pool import FilterModule
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_inputs import VllmTuningError
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_plan import (
    LADDER_SETTINGS_KEYS,
    SETTINGS_KEYS,
    vllm_plan,
    vllm_plan_ladder,
)
from ansible_collections.cardshare.gpuhost.plugins.plugin_utils._vllm_pool import (
    card_shares,
    pool_ladder,
    pool_plan,
    pool_render_nodes,
)

ROOT = Path(__file__).resolve().parents[4]
DEFAULTS: dict[str, Any] = yaml.safe_load(
    (ROOT / "roles" / "vllm" / "defaults" / "main.yml").read_text(encoding="utf-8")
)
# test data: the fields of Qwen2.5-7B-Instruct's config.json that YaRN's override carries
MODEL_CONFIG = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1000000.0}
B70_A, B70_B, A380 = "0000:03:00.0", "0000:04:00.0", "0000:07:00.0"
PLEX = {"name": "plex-4k-hdr-transcode", "bytes": "2GiB", "count": 2}
BASE = {key: DEFAULTS[key] for key in (*SETTINGS_KEYS, *LADDER_SETTINGS_KEYS)} | {
    "vllm_card_memory": "32GiB",
    "vllm_model_config": MODEL_CONFIG,
}
POOL = BASE | {"vllm_pool": [B70_A, B70_B], "vllm_transcode_pdev": A380}


def _args_after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_one_card_host_plan_is_unchanged() -> None:
    """No pool (the xe_driver role's default): the plan and the ladder are vllm_plan's."""
    for settings in (BASE, BASE | {"vllm_pool": [], "vllm_transcode_pdev": None}):
        assert pool_plan(settings) == vllm_plan(BASE)
        assert pool_ladder(settings) == vllm_plan_ladder(BASE)
    assert "--tensor-parallel-size" not in pool_plan(BASE)["args"]


def _desk(pdev: str) -> dict[str, Any]:
    return {"name": "desktop", "bytes": "1GiB", "pdev": pdev}


def _retrieval(pdev: str, size: str = "3GiB") -> dict[str, Any]:
    return {"name": "retrieval", "bytes": size, "pdev": pdev}


@pytest.mark.parametrize(
    ("reservations", "shares", "tightest"),
    [
        # Plex on the A380 leaves the pool; the retrieval tier on the first B70 bounds it:
        # (32 - 3 - 0.8) / 32 = 0.88 there, (32 - 1 - 0.8) / 32 = 0.94 on the second
        ([PLEX, _retrieval(B70_A), _desk(B70_B)], [0.88, 0.94], B70_A),
        # the same tenants the other way round: the second card is the tightest
        ([PLEX, _desk(B70_A), _retrieval(B70_B)], [0.94, 0.88], B70_B),
    ],
)
def test_tightest_card_wins(
    reservations: list[dict[str, Any]], shares: list[float], tightest: str
) -> None:
    settings = POOL | {"vllm_reservations": reservations}
    plan = pool_plan(settings)
    assert [card["gpu_memory_utilization"] for card in plan["pool"]] == shares
    assert plan["tightest_pdev"] == tightest
    assert plan["gpu_memory_utilization"] == min(shares)
    assert plan["tensor_parallel_size"] == 2
    args = plan["args"]
    assert _args_after(args, "--gpu-memory-utilization") == f"{min(shares):.2f}"
    assert _args_after(args, "--tensor-parallel-size") == "2"
    # the plan is the tightest card's own plan with the pool's size added
    on_tightest = [r for r in reservations if r.get("pdev") == tightest]
    alone = vllm_plan(BASE | {"vllm_reservations": on_tightest})
    assert [a for a in args if a not in ("--tensor-parallel-size", "2")] == alone["args"]


def test_a_pool_card_without_tenants_meets_the_ceiling() -> None:
    """As on one card, a share above vllm_gpu_memory_utilization_max is refused, not cut."""
    with pytest.raises(VllmTuningError) as err:
        pool_plan(POOL | {"vllm_reservations": [PLEX, _retrieval(B70_A)]})
    assert str(err.value).startswith(
        "on pool card 0000:04:00.0: vllm_gpu_memory_utilization: the computed share 0.97 is "
        "outside (0, 0.95]"
    )


def test_reservation_without_pdev_sits_on_the_transcode_card() -> None:
    # the A380 takes transcodes: Plex's reservation leaves the pool (the ceiling refuses a
    # card kept with only the headroom, so the desktop stays on both)
    both = [_desk(B70_A), _desk(B70_B)]
    on_a380 = pool_plan(POOL | {"vllm_reservations": [PLEX, *both]})
    assert [c["reservations"] for c in on_a380["pool"]] == [["desktop"], ["desktop"]]
    assert on_a380["gpu_memory_utilization"] == 0.94
    # no transcode card of its own: the pool's first card takes transcodes, Plex's on it
    first = pool_plan(POOL | {"vllm_transcode_pdev": B70_A, "vllm_reservations": [PLEX, *both]})
    assert [c["reservations"] for c in first["pool"]] == [
        ["plex-4k-hdr-transcode", "desktop"],
        ["desktop"],
    ]
    # (32 - 4 - 1 - 0.8) / 32 = 0.81875
    assert first["gpu_memory_utilization"] == 0.81
    assert first["tightest_pdev"] == B70_A


def test_pool_of_one_has_no_tp_flag() -> None:
    plan = pool_plan(BASE | {"vllm_pool": [B70_A], "vllm_transcode_pdev": B70_A})
    assert "--tensor-parallel-size" not in plan["args"]
    assert plan["tensor_parallel_size"] == 1
    assert plan["args"] == vllm_plan(BASE)["args"]


def test_every_rung_of_the_ladder_carries_the_pool() -> None:
    settings = POOL | {"vllm_reservations": [PLEX, _retrieval(B70_A), _desk(B70_B)]}
    ladder = pool_ladder(settings)
    alone = vllm_plan_ladder(BASE | {"vllm_reservations": [_retrieval(B70_A)]})
    assert len(ladder) > 1
    assert ladder[0]["reservation_bytes"] == alone[0]["reservation_bytes"]
    for rung in ladder:
        assert _args_after(rung["args"], "--tensor-parallel-size") == "2"
        assert rung["tensor_parallel_size"] == 2


GIB = 2**30
# test data: a model whose weights fill more than one B70, as Qwen3-32B-AWQ's entry otherwise
BIG = DEFAULTS["vllm_model_catalog"]["Qwen3-32B-AWQ"] | {"weights": "40GiB"}
BIG_SETTINGS = {
    "vllm_model": "Big-40G",
    "vllm_model_catalog_extra": {"Big-40G": BIG},
    # no tenant shares a pool card: the driver's headroom alone (the README's poolbox)
    "vllm_gpu_memory_utilization_max": 0.97,
}


def test_the_weights_are_checked_per_card_under_tp() -> None:
    """Under TP=2 each card holds half the weights: 40 GiB fits two B70s, not one."""
    with pytest.raises(VllmTuningError, match=r"the weights of Big-40G \(about 40 GiB\) do not"):
        pool_plan(BASE | BIG_SETTINGS)
    plan = pool_plan(POOL | BIG_SETTINGS | {"vllm_reservations": [PLEX]})
    assert plan["tensor_parallel_size"] == 2
    assert plan["gpu_memory_utilization"] == 0.97
    # a pool of two still refuses weights whose half fills a card, and says so
    huge = BIG_SETTINGS | {"vllm_model_catalog_extra": {"Big-40G": BIG | {"weights": "64GiB"}}}
    with pytest.raises(VllmTuningError, match=r"\(about 64 GiB, 32 GiB on each of 2 cards\)"):
        pool_plan(POOL | huge)


def test_the_ladder_sizes_each_rung_with_one_card_s_shard_of_the_weights() -> None:
    """A rung of c tokens needs weights / 2 + overhead + KV on each card of a TP=2 pool."""
    settings = POOL | {
        "vllm_model": "Qwen3-32B-AWQ",
        "vllm_reservations": [PLEX],
        "vllm_gpu_memory_utilization_max": 0.97,
    }
    ladder = pool_ladder(settings)
    spec = DEFAULTS["vllm_model_catalog"]["Qwen3-32B-AWQ"]
    weights, kv = 19 * GIB, 256 * 1024
    assert (spec["weights"], spec["kv_bytes_per_token"]) == ("19GiB", "256KiB")
    card, sequences = 32 * GIB, BASE["vllm_ladder_sequences"]
    assert len(ladder) > 1
    for rung in ladder[1:]:
        need = -(-weights // 2) + GIB + kv * rung["max_model_len"] * sequences  # 1 GiB: overhead
        assert rung["gpu_memory_utilization"] == -(-100 * need // card) / 100, rung["rung"]
    # one card holding the whole model leaves no smaller plan at all: 19 + 1 + 16 GiB at 32k
    assert len(vllm_plan_ladder(BASE | {"vllm_model": "Qwen3-32B-AWQ"})) == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            POOL | {"vllm_reservations": [_desk(B70_A), _retrieval(B70_B, "40GiB")]},
            "on pool card 0000:04:00.0: vllm_reservations: the reservations add up to 40 GiB "
            "(retrieval 1 x 40 GiB), more than the card's 32 GiB (vllm_card_memory); lower the "
            "reservations or correct vllm_card_memory",
        ),
        (
            POOL | {"vllm_reservations": [{"name": "x", "bytes": "1GiB", "pdev": "0000:09:00.0"}]},
            "vllm_reservations[0].pdev is '0000:09:00.0', not a card of xe_driver_card_jobs "
            "(0000:03:00.0, 0000:04:00.0, 0000:07:00.0): name the card the tenant uses, or drop "
            "pdev to put it on the card that takes transcodes",
        ),
        (
            BASE | {"vllm_reservations": [{"name": "x", "bytes": "1GiB", "pdev": B70_A}]},
            "vllm_reservations[0].pdev is '0000:03:00.0', but xe_driver_card_jobs names no "
            "cards: on a one-card host every reservation is on the card; drop pdev, or list the "
            "host's cards in xe_driver_card_jobs",
        ),
        (
            POOL | {"vllm_reservations": [{"name": "x", "bytes": "1GiB", "pdev": "03:00.0"}]},
            "vllm_reservations[0].pdev is '03:00.0': expected a PCI address such as "
            "'0000:03:00.0'; the xe_driver role publishes it from xe_driver_card_jobs "
            "(xe_driver_jobs.llm)",
        ),
        (
            POOL | {"vllm_pool": [B70_A, B70_A]},
            "vllm_pool is ['0000:03:00.0', '0000:03:00.0']: a card is listed twice; the "
            "xe_driver role publishes it from xe_driver_card_jobs (xe_driver_jobs.llm)",
        ),
        (
            POOL
            | {
                "vllm_reservations": [_desk(B70_A), _desk(B70_B)],
                "vllm_extra_args": ["--tensor-parallel-size=4"],
            },
            "vllm_extra_args[0]: --tensor-parallel-size is computed by the role; the pool's "
            "size: list its cards in xe_driver_card_jobs instead",
        ),
    ],
    ids=["card-overbooked", "unknown-card", "pdev-on-one-card-host", "bad-pdev", "twice", "tp-arg"],
)
def test_refusals(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(VllmTuningError) as err:
        pool_plan(settings)
    assert str(err.value) == message


def test_override_is_checked_on_every_card() -> None:
    settings = POOL | {
        "vllm_gpu_memory_utilization": 0.9,
        "vllm_reservations": [_retrieval(B70_B, "6GiB")],
    }
    with pytest.raises(VllmTuningError, match=r"^on pool card 0000:04:00.0: vllm_gpu_memory_"):
        pool_plan(settings)
    shares = card_shares(settings | {"vllm_gpu_memory_utilization": 0.8})
    assert [s.gpu_memory_utilization for s in shares] == [0.8, 0.8]


def test_render_nodes_by_pci_path() -> None:
    assert pool_render_nodes([B70_A, B70_B]) == [
        "/dev/dri/by-path/pci-0000:03:00.0-render",
        "/dev/dri/by-path/pci-0000:04:00.0-render",
    ]
    assert pool_render_nodes([]) == []
    with pytest.raises(VllmTuningError, match=r"^vllm_pool\[0\] is 'renderD128': expected"):
        pool_render_nodes(["renderD128"])


def test_filters_and_their_docs() -> None:
    filters = FilterModule().filters()
    assert sorted(filters) == ["vllm_pool_ladder", "vllm_pool_plan", "vllm_pool_render_nodes"]
    for name in filters:
        doc = yaml.safe_load((ROOT / "plugins" / "filter" / f"{name}.yml").read_text())
        assert doc["DOCUMENTATION"]["name"] == name
        assert f"cardshare.gpuhost.{name}" in doc["EXAMPLES"]
    with pytest.raises(AnsibleFilterError, match="a card is listed twice"):
        filters["vllm_pool_render_nodes"]([B70_A, B70_A])
