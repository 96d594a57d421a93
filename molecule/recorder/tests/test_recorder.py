"""What a user of the recorder cares about, read on the lab host after converge.

prepare.yml runs a vLLM and a Plex stand-in (SIMULATION) as compose projects `vllm` and
`plex` on the simulated card; the Plex stand-in transcodes only when switched on.
"""

import json
import shlex

import pytest
from labtest import wait_for

SERVICE = "cardshare-recorder.service"
TIMER = "cardshare-recorder.timer"
DATA = "/var/lib/cardshare/recorder"
TEXTFILE = "/var/lib/node_exporter/textfile_collector/cardshare.prom"
SIM_ROOT = "/srv/cardshare-sim"
PLEX_TRANSCODE = "http://127.0.0.1:32400/:/cardshare-sim/transcode?state={state}"

HARDENING = {
    "User": "",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "cap_dac_read_search cap_sys_ptrace",
    "AmbientCapabilities": "",
    "ProtectSystem": "strict",
    "ReadWritePaths": f"{DATA} /var/lib/node_exporter/textfile_collector",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "PrivateNetwork": "yes",
    "RestrictAddressFamilies": "AF_UNIX",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "RemoveIPC": "yes",
    "SystemCallArchitectures": "native",
}


def show(host, unit, *props):
    args = " ".join(f"-p {p}" for p in props)
    out = host.check_output(f"systemctl show {unit} {args}")
    return dict(line.split("=", 1) for line in out.splitlines())


def scan_now(host):
    """One scan by the service itself, then its snapshot."""
    result = host.run(f"systemctl start {SERVICE}")
    assert result.rc == 0, result.stderr
    return json.loads(host.file(f"{DATA}/current.json").content_string)


def clients(snapshot):
    return {c["name"]: c for card in snapshot["cards"].values() for c in card["clients"]}


def plex_transcode(host, state):
    url = PLEX_TRANSCODE.format(state=state)
    code = (
        "import urllib.request as u; "
        f"print(u.urlopen(u.Request({url!r}, method='POST'), timeout=5).status)"
    )
    assert host.check_output(f"python3 -c {shlex.quote(code)}") == "200"


def test_timer_is_enabled_active_and_starts_the_service(host):
    timer = show(host, TIMER, "ActiveState", "UnitFileState", "Triggers", "TimersCalendar")
    assert timer["ActiveState"] == "active"
    assert timer["UnitFileState"] == "enabled"
    assert timer["Triggers"] == SERVICE
    assert "OnCalendar=*-*-* *:*:00" in timer["TimersCalendar"]
    # the timer itself has started a scan (converge and idempotence take over a minute;
    # wait for the next tick otherwise)
    wait_for(
        "the timer to start the service",
        lambda: show(host, TIMER, "LastTriggerUSec")["LastTriggerUSec"] not in ("", "n/a"),
        75,
        step=5,
    )


def test_loaded_unit_has_its_hardening(host):
    assert show(host, SERVICE, *HARDENING) == HARDENING
    unit = show(host, SERVICE, "Type", "ExecStart")
    assert unit["Type"] == "oneshot"
    assert (
        "/usr/local/lib/cardshare/cardshare.pyz scan --quiet --root /srv/cardshare-sim"
        in (unit["ExecStart"])
    )


def test_systemd_rates_the_unit_exposure_ok(host):
    out = host.check_output(f"systemd-analyze security --no-pager {SERVICE} | tail -n 1")
    # "-> Overall exposure level for cardshare-recorder.service: 1.5 OK :-)"
    level = float(out.split(": ")[1].split()[0])
    assert level <= 2.0, out


@pytest.mark.parametrize(
    "path",
    [f"/etc/systemd/system/{SERVICE}", f"/etc/systemd/system/{TIMER}", "/usr/local/bin/cardshare"],
)
def test_templates_carry_the_managed_header(host, path):
    assert "Ansible managed" in host.file(path).content_string


def test_zipapp_is_installed_executable(host):
    pyz = host.file("/usr/local/lib/cardshare/cardshare.pyz")
    assert pyz.mode == 0o755
    assert pyz.user == "root"
    assert host.run("/usr/local/lib/cardshare/cardshare.pyz --help").rc == 0


def test_scan_names_vllm_by_compose_service_in_snapshot_and_history(host):
    snapshot = scan_now(host)
    vllm = clients(snapshot)["vllm/vllm"]
    # the stand-in reserves 0.85 of the 32 GiB card
    assert vllm["vram_bytes"] == snapshot["cards"]["0000:03:00.0"]["vram_used_bytes"]
    assert vllm["vram_bytes"] > 0.8 * snapshot["cards"]["0000:03:00.0"]["vram_total_bytes"]
    container = host.check_output("docker compose -p vllm ps -q --no-trunc vllm")
    assert vllm["containers"] == [container]
    month = snapshot["timestamp"][:7]
    lines = host.file(f"{DATA}/history/{month}.jsonl").content_string.splitlines()
    stamps = [json.loads(line)["timestamp"] for line in lines]
    assert snapshot["timestamp"] in stamps


def test_textfile_exports_the_clients(host):
    scan_now(host)
    text = host.file(TEXTFILE).content_string
    series = 'cardshare_client_vram_bytes{client="vllm/vllm",kind="container",card="0000:03:00.0"}'
    assert series in text


def test_report_through_the_command_reads_the_role_data_dir(host):
    snapshot = scan_now(host)
    report = json.loads(
        host.check_output(f"cardshare report --month {snapshot['timestamp'][:7]} --json")
    )
    assert "vllm/vllm" in {c["name"] for c in report["clients"]}


def test_plex_transcode_is_named_plex_with_video_engines_busy(host):
    plex_transcode(host, "on")
    try:
        # the second scan with the transcoder on has a previous sample to compare
        def busy():
            seen = clients(scan_now(host)).get("plex/plex")
            busy = seen is not None and all(seen["engines"].get(e) for e in ("vcs", "vecs"))
            return seen if busy else None

        seen = wait_for("plex busy on vcs/vecs", busy, 30, step=2)
        assert seen["commands"] == ["Plex Transcoder"]
        assert seen["vram_bytes"] >= 2 * 1024**3 * 0.9
        assert "vllm/vllm" in clients(scan_now(host))
    finally:
        plex_transcode(host, "off")
    wait_for(
        "plex off the card after the transcode stopped",
        lambda: "plex/plex" not in clients(scan_now(host)),
        30,
        step=2,
    )


def make_root(host, with_card):
    """A root prefix with one process holding no DRM file, and maybe the card's sysfs."""
    root = host.check_output("mktemp -d /tmp/recorder-root.XXXXXX")
    script = f"""
set -e
mkdir -p {root}/proc/4242/fd {root}/proc/4242/fdinfo
echo sleep > {root}/proc/4242/comm
printf 'sleep\\0600\\0' > {root}/proc/4242/cmdline
echo 0::/user.slice > {root}/proc/4242/cgroup
ln -s /dev/null {root}/proc/4242/fd/0
printf 'pos:\\t0\\nflags:\\t0100002\\n' > {root}/proc/4242/fdinfo/0
"""
    if with_card:
        script += f"cp -a {SIM_ROOT}/sys {root}/sys\n"
    host.check_output(f"sh -c {shlex.quote(script)}")
    return root


@pytest.mark.parametrize(
    ("with_card", "expected_cards"),
    [
        (True, {"0000:03:00.0": []}),  # the card bound, nobody on it
        (False, {}),  # no DRM card at all
    ],
)
def test_no_drm_clients_is_a_valid_empty_snapshot(host, with_card, expected_cards):
    root = make_root(host, with_card)
    data = f"{root}-data"
    try:
        result = host.run(f"cardshare scan --root {root} --data-dir {data}")
        assert result.rc == 0, result.stderr
        assert (
            result.stdout
            == f"0 clients on {len(expected_cards)} cards; wrote {data}/current.json\n"
        )
        snapshot = json.loads(host.file(f"{data}/current.json").content_string)
        assert {k: v["clients"] for k, v in snapshot["cards"].items()} == expected_cards
        assert snapshot["stats"]["processes"] == 1
        assert snapshot["stats"]["drm_descriptors"] == 0
    finally:
        host.run(f"rm -rf {root} {data}")


def snapshot_bytes(host, path):
    return host.check_output(f"sha256sum {path}/current.json")


def test_full_data_dir_fails_clearly_and_keeps_the_last_snapshot(host):
    data = host.check_output("mktemp -d /tmp/recorder-full.XXXXXX")
    host.check_output(f"mount -t tmpfs -o size=16k cardshare-test {data}")
    try:
        assert host.run(f"cardshare scan --data-dir {data}").rc == 0
        before = snapshot_bytes(host, data)
        # fill what is left; dd stops with "No space left on device"
        assert host.run(f"dd if=/dev/zero of={data}/filler bs=4k").rc != 0
        result = host.run(f"cardshare scan --data-dir {data}")
        assert result.rc == 1
        assert result.stderr == (
            f"cardshare: error: cannot write {data}/current.json: No space left on device\n"
        )
        assert snapshot_bytes(host, data) == before
        # no temporary file left behind (scan.lock: two scans never run at once)
        assert host.check_output(f"ls -A {data}").split() == [
            "current.json",
            "filler",
            "history",
            "scan.lock",
            "state.json",
        ]
    finally:
        host.run(f"umount {data}")
        host.run(f"rm -rf {data}")


def test_read_only_data_dir_fails_clearly_and_keeps_the_last_snapshot(host):
    base = host.check_output("mktemp -d /tmp/recorder-ro.XXXXXX")
    data = f"{base}/ro"
    host.check_output(f"mkdir {base}/rw {data}")
    assert host.run(f"cardshare scan --data-dir {base}/rw").rc == 0
    host.check_output(f"mount --bind {base}/rw {data} && mount -o remount,bind,ro {data}")
    try:
        before = snapshot_bytes(host, data)
        result = host.run(f"cardshare scan --data-dir {data}")
        assert result.rc == 1
        # the scan's lock is the first thing it writes: that is what fails first
        assert result.stderr == (
            f"cardshare: error: cannot open lock file {data}/scan.lock: Read-only file system\n"
        )
        assert snapshot_bytes(host, data) == before
    finally:
        host.run(f"umount {data}")
        host.run(f"rm -rf {base}")


def test_the_service_fails_visibly_when_its_data_dir_is_full(host):
    # no scan of the timer's may run across the mount below
    host.check_output(f"systemctl stop {TIMER}")
    try:
        scan_now(host)
        host.check_output(f"mount -t tmpfs -o size=4k cardshare-test {DATA}")
        try:
            host.run(f"dd if=/dev/zero of={DATA}/filler bs=4k")
            assert host.run(f"systemctl start {SERVICE}").rc != 0
            assert show(host, SERVICE, "Result")["Result"] == "exit-code"
            log = host.check_output(f"journalctl -u {SERVICE} -n 20 --no-pager -o cat")
            assert (
                f"cardshare: error: cannot write {DATA}/current.json: No space left on device"
                in log
            )
        finally:
            host.run(f"umount {DATA}")
        # the real data directory was never touched and the next scan is fine again
        assert clients(scan_now(host)).get("vllm/vllm") is not None
        assert show(host, SERVICE, "Result")["Result"] == "success"
    finally:
        host.check_output(f"systemctl start {TIMER}")
    assert show(host, TIMER, "ActiveState")["ActiveState"] == "active"
