"""The host's cards by address with their jobs (``xe_driver_card_jobs``): each refusal's
message, the per-card diagnosis by each card's own id, and what the roles that follow get.

The three-card host (two Arc Pro B70s, an Arc A380) is SIMULATION (``multicard_sim``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped,unused-ignore]
from ansible_collections.cardshare.gpuhost.plugins.filter.cards import xe_card_jobs
from ansible_collections.cardshare.gpuhost.plugins.module_utils._cards import (
    CardJobsError,
    check_card_jobs,
    parse_card_jobs,
    read_engine_classes,
    render_node_by_path,
    resolve_card_jobs,
)
from ansible_collections.cardshare.gpuhost.plugins.modules import xe_driver_info
from gpuhost_sim import BDF, Sim, build_sim, needs_mknod
from multicard_sim import A380, B70_A, B70_B, GIB, three_cards

JOBS: list[dict[str, Any]] = [
    {"pdev": B70_A, "device_id": "e223", "job": "llm"},
    {"pdev": B70_B, "device_id": "E223", "job": "llm"},
    {"pdev": A380, "device_id": "0x56a5", "job": "transcode"},
]


def _dev(bdf: str, ident: str, vram: int | None = 32 * GIB, engines: Any = None) -> dict[str, Any]:
    return {"bdf": bdf, "device_id": ident, "driver": "xe", "vram_bytes": vram, "engines": engines}


DEVICES = [
    _dev(B70_A, "e223", engines=["bcs", "ccs", "rcs", "vcs", "vecs"]),
    _dev(B70_B, "e223", engines=["bcs", "ccs", "rcs", "vcs", "vecs"]),
    _dev(A380, "56a5", 6 * GIB, engines=["bcs", "ccs", "rcs", "vcs", "vecs"]),
]


def test_shape_normalises_ids() -> None:
    assert [(j.pdev, j.device_id, j.job) for j in parse_card_jobs(JOBS)] == [
        (B70_A, "e223", "llm"),
        (B70_B, "e223", "llm"),
        (A380, "56a5", "transcode"),
    ]
    assert parse_card_jobs([]) == []
    assert parse_card_jobs(None) == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "0000:03:00.0",
            "xe_driver_card_jobs is '0000:03:00.0': give a list of cards, one mapping each, such "
            "as [{pdev: '0000:03:00.0', device_id: e223, job: llm}], or [] for a host whose one "
            "card does every job",
        ),
        (
            ["0000:03:00.0"],
            "xe_driver_card_jobs[0] is '0000:03:00.0': give a mapping with pdev, device_id and "
            "job, such as {pdev: '0000:03:00.0', device_id: e223, job: llm}",
        ),
        (
            [{"pdev": B70_A, "job": "llm", "role": "x"}],
            "xe_driver_card_jobs[0] is {'pdev': '0000:03:00.0', 'job': 'llm', 'role': 'x'}: "
            "unknown key(s) role; missing device_id; a card has pdev, device_id and job, such "
            "as {pdev: '0000:03:00.0', device_id: e223, job: llm}",
        ),
        (
            [{"pdev": "03:00.0", "device_id": "e223", "job": "llm"}],
            "xe_driver_card_jobs[0].pdev is '03:00.0': give the card's PCI address as sysfs "
            "spells it, domain first and lower case, such as '0000:03:00.0' (lspci -D -d 8086: "
            "lists them)",
        ),
        (
            [{"pdev": B70_A, "device_id": "B70", "job": "llm"}],
            "xe_driver_card_jobs[0].device_id is 'B70': give the card's PCI device id as 4 hex "
            "digits, such as e223 (Arc Pro B70) or 56a5 (Arc A380); lspci -nn -s 0000:03:00.0 "
            "shows it after 8086:",
        ),
        (
            [{"pdev": B70_A, "device_id": "e223", "job": "image"}],
            "xe_driver_card_jobs[0].job is 'image': give one of llm, transcode (llm: a card of "
            "vLLM's pool; transcode: the card Plex and the re-encode campaign use)",
        ),
        (
            [
                {"pdev": B70_A, "device_id": "e223", "job": "llm"},
                {"pdev": B70_A, "device_id": "e223", "job": "transcode"},
            ],
            "xe_driver_card_jobs gives 0000:03:00.0 two jobs (xe_driver_card_jobs[0] llm, "
            "xe_driver_card_jobs[1] transcode): a card does one job; keep one entry for it (a "
            "host whose one card does every job needs no xe_driver_card_jobs at all)",
        ),
        (
            [
                {"pdev": B70_A, "device_id": "e223", "job": "llm"},
                {"pdev": B70_A, "device_id": "e223", "job": "llm"},
            ],
            "xe_driver_card_jobs lists 0000:03:00.0 twice (xe_driver_card_jobs[0] and "
            "xe_driver_card_jobs[1]): list each card once",
        ),
        (
            [{"pdev": A380, "device_id": "56a5", "job": "transcode"}],
            "xe_driver_card_jobs names no llm card (0000:07:00.0 transcode): give vLLM's pool at "
            "least one card with job: llm",
        ),
        (
            [
                {"pdev": B70_A, "device_id": "e223", "job": "llm"},
                {"pdev": B70_B, "device_id": "e223", "job": "transcode"},
                {"pdev": A380, "device_id": "56a5", "job": "transcode"},
            ],
            "xe_driver_card_jobs gives transcodes 2 cards (0000:04:00.0, 0000:07:00.0): one "
            "card takes transcodes; keep one entry with job: transcode",
        ),
    ],
)
def test_shape_refusals(value: Any, message: str) -> None:
    with pytest.raises(CardJobsError) as err:
        parse_card_jobs(value)
    assert str(err.value) == message


def test_fitting_inventory_has_no_refusal() -> None:
    assert check_card_jobs(parse_card_jobs(JOBS), DEVICES, strict=True) == []


@pytest.mark.parametrize(
    ("devices", "strict", "message"),
    [
        (
            [DEVICES[0], DEVICES[2]],
            False,
            "xe_driver_card_jobs[1].pdev is '0000:04:00.0' (llm): no Intel display device at "
            "that address (found: 0000:03:00.0 (8086:e223), 0000:07:00.0 (8086:56a5)); give an "
            "address lspci -D -d 8086: lists, or seat and pass through the card",
        ),
        (
            [DEVICES[0], _dev(B70_B, "e211"), DEVICES[2]],
            False,
            "xe_driver_card_jobs[1].device_id is 'e223' but the card at 0000:04:00.0 is "
            "8086:e211: correct device_id, or the address if the cards are in other slots",
        ),
        (
            [DEVICES[0], _dev(B70_B, "e223", 24 * GIB), DEVICES[2]],
            False,
            "xe_driver_card_jobs: the llm pool's cards differ in memory (0000:03:00.0 32 GiB, "
            "0000:04:00.0 24 GiB); vLLM splits the model evenly over its pool and applies one "
            "memory share to every card, so the smallest card would bound them all: pool cards "
            "of one model (two Arc Pro B70s), and give the other card another job",
        ),
        (
            [DEVICES[0], DEVICES[1], _dev(A380, "56a5", 6 * GIB, ["bcs", "ccs", "rcs"])],
            False,
            "xe_driver_card_jobs[2] (0000:07:00.0, 8086:56a5) takes transcodes but has no video "
            "engine (vcs; engines: bcs, ccs, rcs): give job transcode to a card with a media "
            "engine (an Arc A380 or a B-series card), or drop the entry so the pool's first card "
            "takes transcodes",
        ),
        (
            [DEVICES[0], DEVICES[1], _dev(A380, "56a5", 6 * GIB, None)],
            True,
            "xe_driver_card_jobs[2] (0000:07:00.0) takes transcodes but its engines could not be "
            "read (no tile*/gt*/engines in its sysfs directory): run as root, on a kernel whose "
            "xe publishes them",
        ),
    ],
    ids=["not-found", "other-id", "memory-differs", "no-media-engine", "engines-unread"],
)
def test_refusals_against_the_cards_found(
    devices: list[dict[str, Any]], strict: bool, message: str
) -> None:
    assert check_card_jobs(parse_card_jobs(JOBS), devices, strict=strict) == [message]


def test_before_the_driver_binds_unknowns_are_not_judged() -> None:
    """Before xe drives a card its memory and engines are unknown: preflight judges what it
    knows (the address and the id) and leaves the rest to the checks after the driver's."""
    unbound = [
        {**_dev(B70_A, "e223", None), "driver": None},
        {**_dev(B70_B, "e223", None), "driver": None},
        {**_dev(A380, "56a5", None), "driver": "i915"},
    ]
    assert check_card_jobs(parse_card_jobs(JOBS), unbound, strict=False) == []
    assert check_card_jobs(parse_card_jobs(JOBS), unbound, strict=True) == []


def test_every_refusal_is_reported_at_once() -> None:
    devices = [_dev(B70_A, "e223", 32 * GIB), _dev(A380, "56a5", 6 * GIB, ["rcs"])]
    refusals = check_card_jobs(parse_card_jobs(JOBS), devices, strict=True)
    assert [r.split(" ")[0] for r in refusals] == [
        "xe_driver_card_jobs[1].pdev",
        "xe_driver_card_jobs[2]",
    ]


def test_resolve_declared_and_default() -> None:
    cards = [{"bdf": d["bdf"], "device_id": d["device_id"]} for d in DEVICES]
    declared = resolve_card_jobs(parse_card_jobs(JOBS), cards)
    assert declared["declared"] is True
    assert [c["bdf"] for c in declared["llm"]] == [B70_A, B70_B]
    assert [c["render_node_by_path"] for c in declared["llm"]] == [
        "/dev/dri/by-path/pci-0000:03:00.0-render",
        "/dev/dri/by-path/pci-0000:04:00.0-render",
    ]
    assert declared["transcode"]["bdf"] == A380
    # the one-card host: its first card is the pool and takes transcodes
    default = resolve_card_jobs([], cards[:1])
    assert default == {
        "declared": False,
        "llm": [{**cards[0], "render_node_by_path": "/dev/dri/by-path/pci-0000:03:00.0-render"}],
        "transcode": {
            **cards[0],
            "render_node_by_path": "/dev/dri/by-path/pci-0000:03:00.0-render",
        },
    }
    assert resolve_card_jobs([], []) == {"declared": False, "llm": [], "transcode": None}
    # a pool without a transcode card: the pool's first card takes transcodes
    pool_only = resolve_card_jobs(parse_card_jobs(JOBS[:2]), cards)
    assert pool_only["transcode"]["bdf"] == B70_A
    # a card xe does not drive yet keeps its place in the pool, what is unknown null
    waiting = resolve_card_jobs(parse_card_jobs(JOBS), cards[:1])
    assert [c["bdf"] for c in waiting["llm"]] == [B70_A, B70_B]
    assert waiting["llm"][1] == {
        "bdf": B70_B,
        "device_id": "e223",
        "card": None,
        "render_node": None,
        "render_node_path": None,
        "vram_bytes": None,
        "guc_status": None,
        "huc_status": None,
        "fdinfo_status": None,
        "engines": None,
        "render_node_by_path": "/dev/dri/by-path/pci-0000:04:00.0-render",
    }
    assert waiting["transcode"]["vram_bytes"] is None


def test_render_node_by_path_refuses_a_non_address() -> None:
    with pytest.raises(CardJobsError, match="'renderD128' is not a PCI address"):
        render_node_by_path("renderD128")


def test_engine_classes_read_per_gt(tmp_path: Path) -> None:
    sim = three_cards(tmp_path)
    assert read_engine_classes(str(sim.root), B70_A) == ["bcs", "ccs", "rcs", "vcs", "vecs"]
    assert read_engine_classes(str(sim.root), A380) == ["bcs", "ccs", "rcs", "vcs", "vecs"]
    assert read_engine_classes(str(sim.root), "0000:05:00.0") is None  # no tile: not on xe
    assert read_engine_classes(str(sim.root), "0000:09:00.0") is None  # no such device


def _args(sim: Sim, **extra: Any) -> dict[str, Any]:
    return {"host_root": str(sim.root), "modules_dir": str(sim.modules_dir), **extra}


@needs_mknod
def test_module_checks_every_card_by_its_own_id(
    tmp_path: Path, run_module: Callable[..., dict[str, Any]]
) -> None:
    sim = three_cards(tmp_path)
    result = run_module(xe_driver_info.main, _args(sim, expected_ids=["e223"], cards=JOBS))
    assert result["problems"] == []
    by_bdf = {d["bdf"]: d for d in result["xe_devices"]}
    assert by_bdf[A380]["engines"] == ["bcs", "ccs", "rcs", "vcs", "vecs"]
    assert by_bdf[A380]["render_node"] == "renderD130"
    assert sorted(result["id_knowledge"]) == ["56a5", "e223"]
    resolved = xe_card_jobs(JOBS, result, ["e223", "56a5"])
    assert [c["render_node_by_path"] for c in resolved["llm"]] == [
        "/dev/dri/by-path/pci-0000:03:00.0-render",
        "/dev/dri/by-path/pci-0000:04:00.0-render",
    ]
    assert resolved["transcode"]["bdf"] == A380
    assert resolved["transcode"]["render_node"] == "renderD130"


@needs_mknod
def test_module_names_cause_and_fix_per_card(
    tmp_path: Path, run_module: Callable[..., dict[str, Any]]
) -> None:
    sim = three_cards(tmp_path)
    # the A380 on i915 (DG2 needs xe.force_probe), the second B70 missing its firmware
    (sim.root / "sys/bus/pci/devices" / A380 / "driver").unlink()
    (sim.root / "sys/bus/pci/devices" / A380 / "driver").symlink_to("../../../bus/pci/drivers/i915")
    (sim.root / "sys/kernel/debug/dri/1/gt0/uc/guc_info").write_text(
        "GuC firmware: xe/bmg_guc_70.bin\n\tstatus: MISSING\n"
    )
    moved = [*JOBS[:2], {"pdev": "0000:08:00.0", "device_id": "56a5", "job": "transcode"}]
    result = run_module(xe_driver_info.main, _args(sim, cards=JOBS))
    assert [(p["code"], p["device"]) for p in result["problems"]] == [
        ("guc_not_running", B70_B),
        ("bound_other_driver", A380),
    ]
    assert result["problems"][1]["fix"].startswith("boot with xe.force_probe=56a5 ")
    result = run_module(xe_driver_info.main, _args(sim, cards=moved))
    missing = result["problems"][-1]
    assert missing["code"] == "no_device"
    assert missing["message"].startswith(
        "no PCI device at 0000:08:00.0 (xe_driver_card_jobs[2], transcode, expected 8086:56a5); "
        "found: 0000:03:00.0 (8086:e223), 0000:04:00.0 (8086:e223), 0000:07:00.0 (8086:56a5)"
    )
    assert missing["fix"] == (
        "check that the card is seated and passed through to this machine "
        "(lspci -nn -D -d 8086:56a5), or correct xe_driver_card_jobs[2].pdev"
    )


@needs_mknod
def test_module_without_cards_is_unchanged(
    tmp_path: Path, run_module: Callable[..., dict[str, Any]]
) -> None:
    """No inventory: the one-card diagnosis by expected_ids, as before."""
    sim = build_sim(tmp_path)
    result = run_module(xe_driver_info.main, _args(sim, expected_ids=["e223"]))
    assert result["problems"] == []
    [dev] = result["xe_devices"]
    assert dev["bdf"] == BDF
    assert dev["engines"] is None  # build_sim publishes no engines
    resolved = xe_card_jobs([], result, ["e223"])
    assert resolved["declared"] is False
    assert [c["bdf"] for c in resolved["llm"]] == [BDF]


def test_filter_refuses_with_every_message(tmp_path: Path) -> None:
    info = {"xe_devices": [DEVICES[0], _dev(B70_B, "e223", 24 * GIB), DEVICES[2]]}
    with pytest.raises(AnsibleFilterError, match=r"^xe_driver_card_jobs: the llm pool's cards"):
        xe_card_jobs(JOBS, info, ["e223", "56a5"])
    with pytest.raises(AnsibleFilterError, match=r"^xe_driver_card_jobs\[0\].job is 'gpu'"):
        xe_card_jobs([{"pdev": B70_A, "device_id": "e223", "job": "gpu"}])
    assert xe_card_jobs(JOBS) == [
        {"pdev": B70_A, "device_id": "e223", "job": "llm"},
        {"pdev": B70_B, "device_id": "e223", "job": "llm"},
        {"pdev": A380, "device_id": "56a5", "job": "transcode"},
    ]
