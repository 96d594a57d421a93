"""simcard.py: fdinfo text in xe's format, container ids, registration on the simulated card."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import simcard
import simcard_reaper
from standin_testlib import PDEV, VRAM_TOTAL, parse_fdinfo

CID = "a" * 64


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (4097, "4097"),
        (1024, "1 KiB"),
        (192 * 1024, "192 KiB"),
        (16 * 1024**2, "16 MiB"),
        (20 * 1024**3, "20480 MiB"),
        (1024**2 + 1024, "1025 KiB"),
    ],
)
def test_format_size_divides_while_aligned_up_to_mib(value: int, text: str) -> None:
    assert simcard.format_size(value) == text


def test_format_size_refuses_negative() -> None:
    with pytest.raises(ValueError, match=r"^negative size: -1$"):
        simcard.format_size(-1)


@pytest.mark.parametrize(
    ("text", "size"),
    [("0x800000000\n", 34359738368), ("34359738368", 34359738368), (" 0X10 ", 16)],
)
def test_parse_vram_size_accepts_hex_and_decimal(text: str, size: int) -> None:
    assert simcard.parse_vram_size(text) == size


def test_render_fdinfo_matches_xe_layout() -> None:
    state = simcard.FdinfoState(
        client_id=3,
        pdev=PDEV,
        resident={"system": 4096, "gtt": 192 * 1024, "vram0": 23992 * 1024},
        cycles={"rcs": 28257900},
        total_cycles=7655183225,
    )
    text = simcard.render_fdinfo(state)
    lines = text.splitlines()
    assert lines[:7] == [
        "pos:\t0",
        "flags:\t02100002",
        "mnt_id:\t25",
        "ino:\t1000",
        "drm-driver:\txe",
        "drm-client-id:\t3",
        f"drm-pdev:\t{PDEV}",
    ]
    pairs = parse_fdinfo(text)
    assert pairs["drm-total-gtt"] == "192 KiB"
    assert pairs["drm-resident-vram0"] == "23992 KiB"
    assert pairs["drm-resident-system"] == "4 KiB"
    assert pairs["drm-cycles-rcs"] == "28257900"
    assert pairs["drm-total-cycles-ccs"] == "7655183225"
    assert pairs["drm-engine-capacity-vcs"] == "2"
    assert pairs["drm-engine-capacity-ccs"] == "4"
    assert "drm-engine-capacity-rcs" not in pairs
    assert {k for k in pairs if k.startswith("drm-cycles-")} == {
        f"drm-cycles-{c}" for c in ("rcs", "bcs", "vcs", "vecs", "ccs")
    }


MOUNTINFO = (
    "1190 1180 0:88 / / rw,relatime - overlay overlay rw\n"
    f"1201 1190 253:0 /var/lib/docker/containers/{CID}/resolv.conf /etc/resolv.conf rw - ext4 x\n"
    f"1202 1190 253:0 /var/lib/docker/containers/{CID}/hostname /etc/hostname rw - ext4 x\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MOUNTINFO, CID),
        ("1190 1180 0:88 / / rw,relatime - overlay overlay rw\n", None),
        (f"1 2 3:4 /x/containers/{CID}/data /data rw - ext4 x\n", None),
        ("", None),
    ],
)
def test_container_id_from_mountinfo(text: str, expected: str | None) -> None:
    assert simcard.container_id_from_mountinfo(text) == expected


@pytest.mark.parametrize(
    ("container_id", "line"),
    [
        (CID, f"0::/system.slice/docker-{CID}.scope\n"),
        (None, "0::/user.slice/cardshare-sim.scope\n"),
    ],
)
def test_cgroup_line(container_id: str | None, line: str) -> None:
    assert simcard.cgroup_line(container_id) == line


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"CONTAINER_ID": CID.upper()}, CID), ({"CONTAINER_ID": "abc"}, None), ({}, None)],
)
def test_own_container_id_falls_back_to_env(
    env: dict[str, str], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(simcard, "container_id_from_mountinfo", lambda _text: None)
    assert simcard.own_container_id(env) == expected


def test_find_card_reads_pdev_and_vram(card_root: Path) -> None:
    card = simcard.find_card(card_root)
    assert card is not None
    assert (card.pdev, card.vram_total) == (PDEV, VRAM_TOTAL)


def test_find_card_without_device_is_none(tmp_path: Path) -> None:
    assert simcard.find_card(tmp_path) is None


def test_no_card_means_no_registration(tmp_path: Path) -> None:
    client = simcard.SimClient("python3", ["python3"], root=tmp_path, container_id=None)
    assert client.register(vram=1) is False
    assert not (tmp_path / "proc").exists()
    client.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_register_writes_the_proc_entry(card_root: Path) -> None:
    client = simcard.SimClient(
        "VLLM::EngineCore-long", ["vllm", "serve", "m"], root=card_root, container_id=CID
    )
    assert client.register(vram=27 * 1024**3)
    try:
        assert client.pid is not None and client.pid >= 100000
        entry = card_root / "proc" / str(client.pid)
        assert (entry / "comm").read_text() == "VLLM::EngineCor\n"
        assert (entry / "cmdline").read_bytes() == b"vllm\0serve\0m\0"
        assert (entry / "cgroup").read_text() == f"0::/system.slice/docker-{CID}.scope\n"
        fd = entry / "fd" / str(simcard.DRM_FD)
        assert os.readlink(fd) == str(card_root / "dev" / "dri" / "renderD128")
        pairs = parse_fdinfo((entry / "fdinfo" / str(simcard.DRM_FD)).read_text())
        assert pairs["drm-resident-vram0"] == "27648 MiB"
        assert pairs["drm-client-id"] == str(client.client_id)
        owner = json.loads((entry / simcard.OWNER_FILE).read_text())
        assert owner["owner_pid"] == os.getpid()
        assert owner["container_id"] == CID
    finally:
        client.close()
    assert not entry.exists()
    assert [p.name for p in (card_root / "proc").iterdir()] == []


def test_two_clients_get_distinct_pids_and_client_ids(card_root: Path) -> None:
    first = simcard.SimClient("a", ["a"], root=card_root, container_id=None)
    second = simcard.SimClient("b", ["b"], root=card_root, container_id=None)
    first.register(vram=1024**3)
    second.register(vram=2 * 1024**3)
    try:
        assert first.pid != second.pid
        assert first.client_id != second.client_id
        assert simcard.read_resident_vram(card_root, PDEV) == 3 * 1024**3
        free, total = first.free_vram()
        assert (free, total) == (VRAM_TOTAL - 3 * 1024**3, VRAM_TOTAL)
    finally:
        first.close()
        second.close()
    third = simcard.SimClient("c", ["c"], root=card_root, container_id=None)
    third.register()
    try:
        assert third.client_id is not None and second.client_id is not None
        assert third.client_id > second.client_id
    finally:
        third.close()


def test_duplicate_descriptors_count_once(card_root: Path) -> None:
    client = simcard.SimClient("a", ["a"], root=card_root, container_id=None)
    client.register(vram=1024**3)
    try:
        assert client.pid_dir is not None
        fdinfo = client.pid_dir / "fdinfo"
        (fdinfo / "99").write_text((fdinfo / str(simcard.DRM_FD)).read_text())
        assert simcard.read_resident_vram(card_root, PDEV) == 1024**3
        assert simcard.read_resident_vram(card_root, "0000:04:00.0") == 0
    finally:
        client.close()


def test_cycles_advance_only_for_busy_engines(card_root: Path) -> None:
    clock = FakeClock()
    client = simcard.SimClient(
        "a", ["a"], root=card_root, container_id=None, clock=clock, tick_seconds=3600
    )
    client.register()
    try:
        start = client.snapshot()
        assert start is not None
        client.set_busy({"ccs": 1.0})
        clock.now = 2.0
        client.set_busy({})
        clock.now = 5.0
        client.refresh()
        end = client.snapshot()
        assert end is not None
        assert end.cycles["ccs"] == 2 * simcard.TIMESTAMP_HZ
        assert end.cycles["vcs"] == 0
        assert end.total_cycles - start.total_cycles == 5 * simcard.TIMESTAMP_HZ
        assert client.pid_dir is not None
        pairs = parse_fdinfo((client.pid_dir / "fdinfo" / str(simcard.DRM_FD)).read_text())
        assert pairs["drm-cycles-ccs"] == str(2 * simcard.TIMESTAMP_HZ)
    finally:
        client.close()


def test_set_busy_refuses_unknown_engine(card_root: Path) -> None:
    client = simcard.SimClient("a", ["a"], root=card_root, container_id=None)
    with pytest.raises(ValueError, match=r"^unknown engine classes: \['gpu'\]$"):
        client.set_busy({"gpu": 1.0})


def test_a_new_process_in_a_container_drops_its_killed_predecessors_entry(
    card_root: Path,
) -> None:
    """A container restarted after a SIGKILL runs its stand-in again under the same id: the
    killed process's entry (left behind, as no close() ran) goes when the new one registers,
    so the new process never counts the dead one's VRAM; another container's entry stays."""
    other = "b" * 64
    dead = simcard.SimClient("python3", ["main.py"], root=card_root, container_id=CID)
    dead.register(vram=20 * 1024**3)
    neighbour = simcard.SimClient("Plex Transcoder", ["t"], root=card_root, container_id=other)
    neighbour.register(vram=1024**3)
    assert dead.pid_dir is not None
    left = dead.pid_dir
    dead._stop.set()  # killed: the entry stays, nothing closes it
    owner = json.loads((left / simcard.OWNER_FILE).read_text())
    owner["instance"] = "0" * 32  # the killed process was another instance
    (left / simcard.OWNER_FILE).write_text(json.dumps(owner))
    reborn = simcard.SimClient("python3", ["main.py"], root=card_root, container_id=CID)
    try:
        assert reborn.register(vram=2 * 1024**3)
        owners = [
            json.loads((e / simcard.OWNER_FILE).read_text()) for e in (card_root / "proc").iterdir()
        ]
        mine = [o for o in owners if o["container_id"] == CID]
        assert [o["instance"] for o in mine] == [simcard.PROCESS_INSTANCE]
        assert neighbour.pid_dir is not None and neighbour.pid_dir.exists()
        free, total = reborn.free_vram()
        assert free == total - 3 * 1024**3
    finally:
        reborn.close()
        neighbour.close()


def test_clients_of_one_process_in_one_container_stay_together(card_root: Path) -> None:
    """Plex runs several transcodes in one process: registering one keeps the others."""
    first = simcard.SimClient("Plex Transcoder", ["t"], root=card_root, container_id=CID)
    second = simcard.SimClient("Plex Transcoder", ["t"], root=card_root, container_id=CID)
    first.register(vram=1024**3)
    second.register(vram=1024**3)
    try:
        assert first.pid_dir is not None and first.pid_dir.exists()
        assert simcard.read_resident_vram(card_root, PDEV) == 2 * 1024**3
    finally:
        first.close()
        second.close()


# -- a lab host with three cards (SIM_CARDS): a stand-in registers on the card it is given --

B70_B, A380 = "0000:04:00.0", "0000:07:00.0"


def _three_cards(root: Path) -> Path:
    """Two B70s and an A380 as the lab host's boot lays them out (drm/renderD<N> in sysfs)."""
    for minor, (pdev, vram) in enumerate(((PDEV, 32), (B70_B, 32), (A380, 6))):
        device = root / "sys" / "bus" / "pci" / "devices" / pdev
        (device / "tile0").mkdir(parents=True)
        (device / "tile0" / "physical_vram_size_bytes").write_text(hex(vram << 30) + "\n")
        (device / "drm" / f"renderD{128 + minor}").mkdir(parents=True)
        (root / "dev" / "dri").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "dri" / f"renderD{128 + minor}").write_text("")
    (root / "proc").mkdir()
    return root


@pytest.mark.parametrize(
    ("value", "pdev", "render"),
    [
        ("", PDEV, "renderD128"),
        (A380, A380, "renderD130"),
        ("renderD129", B70_B, "renderD129"),
        ("/dev/dri/renderD130", A380, "renderD130"),
        (f"/dev/dri/by-path/pci-{A380}-render", A380, "renderD130"),
    ],
)
def test_the_card_a_stand_in_is_given(tmp_path: Path, value: str, pdev: str, render: str) -> None:
    root = _three_cards(tmp_path / "sim")
    choice = simcard.card_choice({"CARDSHARE_SIM_CARD": value})
    card = simcard.find_card(root, choice)
    assert card is not None
    assert (card.pdev, card.render, card.render_node) == (
        pdev,
        render,
        root / "dev" / "dri" / render,
    )
    vram = 6 << 30 if pdev == A380 else 32 << 30
    assert card.vram_total == vram


def test_a_card_the_host_does_not_have_is_refused(tmp_path: Path) -> None:
    root = _three_cards(tmp_path / "sim")
    with pytest.raises(simcard.CardChoiceError) as err:
        simcard.find_card(root, "0000:09:00.0")
    assert str(err.value) == (
        "CARDSHARE_SIM_CARD is '0000:09:00.0', but the simulated host's cards with VRAM are "
        "0000:03:00.0 (renderD128), 0000:04:00.0 (renderD129), 0000:07:00.0 (renderD130): "
        "name one of them"
    )
    with pytest.raises(simcard.CardChoiceError, match=r"^CARDSHARE_SIM_CARD is 'card2': give"):
        simcard.card_choice({"CARDSHARE_SIM_CARD": "card2"})


def test_a_client_registers_on_the_card_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _three_cards(tmp_path / "sim")
    monkeypatch.setenv("CARDSHARE_SIM_CARD", A380)
    plex = simcard.SimClient("Plex Transcoder", ["t"], root=root, container_id=CID)
    monkeypatch.delenv("CARDSHARE_SIM_CARD")
    vllm = simcard.SimClient("python3", ["vllm"], root=root, container_id="b" * 64)
    try:
        assert plex.register(vram=2 << 30) and vllm.register(vram=20 << 30)
        assert plex.pid_dir is not None and vllm.pid_dir is not None
        fdinfo = parse_fdinfo((plex.pid_dir / "fdinfo" / "12").read_text())
        assert fdinfo["drm-pdev"] == A380
        assert os.readlink(plex.pid_dir / "fd" / "12") == str(root / "dev/dri/renderD130")
        assert os.readlink(vllm.pid_dir / "fd" / "12") == str(root / "dev/dri/renderD128")
        # each card's free memory counts its own clients only
        assert plex.free_vram() == ((6 - 2) << 30, 6 << 30)
        assert vllm.free_vram() == ((32 - 20) << 30, 32 << 30)
    finally:
        plex.close()
        vllm.close()


# -- vLLM under tensor parallelism: one client per rank, each on its own pool card ---------------


def _pdevs_of_clients(root: Path) -> dict[str, int]:
    """Each card's resident VRAM as the recorder would read it from the clients' fdinfo."""
    return {pdev: simcard.read_resident_vram(root, pdev) for pdev in (PDEV, B70_B, A380)}


def test_a_tp2_vllm_stand_in_holds_memory_on_both_pool_cards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_standin as vs  # the stand-in module beside simcard

    root = _three_cards(tmp_path / "sim")
    monkeypatch.setenv("CARDSHARE_SIM_ROOT", str(root))
    monkeypatch.setattr(simcard, "own_container_id", lambda: "d" * 64)
    env = {"CARDSHARE_SIM_CARD": f"{PDEV} {B70_B}"}
    pool = vs.PoolClient(2, env, ["vllm", "serve", "m"], root=root)
    assert [rank.card.pdev for rank in pool.ranks if rank.card] == [PDEV, B70_B]
    assert pool.memory_error(0.9, forced=False) is None
    # a rank whose card has too little free refuses as vLLM does, naming its device
    other = simcard.SimClient("x", ["x"], root=root, container_id="c" * 64, choice=B70_B)
    other.register(vram=20 << 30)
    error = pool.memory_error(0.9, forced=False)
    other.close()
    assert error is not None and error.startswith("Free memory on device xpu:1 (12.0/32.0 GiB)")
    pool.register(0.5)
    try:
        assert pool.registered
        assert _pdevs_of_clients(root) == {PDEV: 16 << 30, B70_B: 16 << 30, A380: 0}
        # the hold knob: one card's memory stays past the exit, until the reaper frees it
        (root / "lab").mkdir()
        (root / "lab" / "vllm-hold-card").write_text(f"{B70_B} 0.5\n")
        pool.close(0.0)
        assert _pdevs_of_clients(root) == {PDEV: 0, B70_B: 16 << 30, A380: 0}
        assert not (root / "lab" / "vllm-hold-card").exists()

        def gone(_container: str) -> bool:
            return False  # the container stopped

        assert simcard_reaper.reap(root, gone) == []  # held: kept while its time runs
        time.sleep(0.6)
        assert [reason for _pid, reason in simcard_reaper.reap(root, gone)] == [
            "container dddddddddddd is not running"
        ]
        assert _pdevs_of_clients(root) == {PDEV: 0, B70_B: 0, A380: 0}
    finally:
        pool.close(0.0)


def test_tp2_without_named_cards_takes_the_first_two_and_refuses_too_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_standin as vs

    root = _three_cards(tmp_path / "sim")
    pool = vs.PoolClient(2, {}, ["vllm"], root=root)
    assert [rank.card.pdev for rank in pool.ranks if rank.card] == [PDEV, B70_B]
    assert simcard.card_choices({"CARDSHARE_SIM_CARD": f"{A380}, renderD129"}) == [
        A380,
        "renderD129",
    ]
    with pytest.raises(vs.StartupError, match=r"--tensor-parallel-size 2 needs 2 cards, but"):
        vs.PoolClient(2, {"CARDSHARE_SIM_CARD": A380}, ["vllm"], root=root)
