"""The re-encode campaign on the lab host, as the role left it: what a user of the box sees.

The encoder is libx265 standing in for the card's VAAPI encoder and Plex is the lab's stand-in
(SIMULATION, lab/SIMULATION.md); ffmpeg, ffprobe, Docker, compose and the campaign's service
are real. The tests run in file order, each on the box as the previous one left it.
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

from labtest import wait_for

CONTAINER = "campaign-encoder-1"
FILMS = "/srv/media/Films"
HELD = "/srv/media/.cardshare-held"
API = "http://127.0.0.1:8097"


def lab(host: Any, command: str) -> str:
    return str(host.check_output(command))


def call(
    host: Any, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 30
) -> tuple[int, Any]:
    """An HTTP call from the lab host (the campaign listens on its loopback)."""
    script = (
        "import json, sys, urllib.request as u, urllib.error as e\n"
        f"req = u.Request({API + path!r}, "
        f"data={json.dumps(body).encode() if body is not None else None!r}, "
        f"method={method!r}, headers={{'Content-Type': 'application/json'}})\n"
        f"try:\n  r = u.urlopen(req, timeout={timeout})\n"
        "  print(r.status); print(r.read().decode())\n"
        "except e.HTTPError as x:\n  print(x.code); print(x.read().decode())\n"
    )
    out = lab(host, f"python3 -c {shlex.quote(script)}")
    status, _, text = out.partition("\n")
    return int(status), json.loads(text)


def status(host: Any) -> dict[str, Any]:
    code, doc = call(host, "GET", "/v1/status")
    assert code == 200, doc
    return doc


def row(host: Any, path: str) -> dict[str, Any] | None:
    """The campaign's queue row of a file, read from its SQLite database in the container."""
    script = (
        "import json, sqlite3\n"
        "c = sqlite3.connect('/var/lib/cardshare/campaign/campaign.sqlite3')\n"
        "c.row_factory = sqlite3.Row\n"
        f"r = c.execute('SELECT * FROM files WHERE path = ?', ({path!r},)).fetchone()\n"
        "print(json.dumps(dict(r) if r else None))\n"
    )
    return json.loads(lab(host, f"docker exec {CONTAINER} python3 -c {shlex.quote(script)}"))


def probe(host: Any, path: str) -> dict[str, Any]:
    out = lab(
        host,
        f"docker exec {CONTAINER} ffprobe -v error -print_format json -show_streams -show_chapters "
        f"{shlex.quote(path)}",
    )
    return json.loads(out)


def encoder_states(host: Any) -> list[str]:
    """The states (R, S, T...) of the ffmpeg encodes running in the campaign's container."""
    script = (
        "import os\n"
        "for p in os.listdir('/proc'):\n"
        "  if p.isdigit():\n"
        "    try:\n"
        "      cmd = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
        "      st = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
        "    except OSError:\n"
        "      continue\n"
        "    if cmd[0].endswith(b'ffmpeg') and b'-c:v:0' in cmd:\n"
        "      print(st)\n"
    )
    return lab(host, f"docker exec {CONTAINER} python3 -c {shlex.quote(script)}").split()


def add_film(host: Any, name: str, clip: str = "long") -> str:
    """A new 4K clip in the library, 6 seconds long (or 2 for ``short``): a copy of one the
    prepare made, so a new file."""
    path = f"{FILMS}/{name}"
    lab(host, f"cp /srv/media/.lab/{clip}.mkv {shlex.quote(path)}")
    return path


def plex_transcode(host: Any, state: str) -> None:
    # SIMULATION: the Plex stand-in's lab control switches a hardware transcode on or off
    lab(
        host,
        'python3 -c "import urllib.request as u; u.urlopen(u.Request('
        f"'http://127.0.0.1:32400/:/cardshare-sim/transcode?state={state}', method='POST'), "
        'timeout=5)"',
    )


def test_a_4k_remux_is_converted_verified_and_its_original_held(host: Any) -> None:
    path = f"{FILMS}/Remux One (2021).mkv"
    done = wait_for(
        "the remux to be done", lambda: (r := row(host, path)) and r["state"] == "done" and r, 300
    )
    assert done["new_size"] < done["size"] and done["held_path"].startswith(HELD + "/")
    original = lab(host, "cut -d' ' -f1 /root/campaign-originals.sha256").strip()
    assert lab(host, f"sha256sum {shlex.quote(done['held_path'])}").split()[0] == original
    result = probe(host, path)
    kinds = [
        (s["codec_type"], s.get("codec_name"), s.get("tags", {}).get("language"))
        for s in result["streams"]
    ]
    assert kinds[0][:2] == ("video", "hevc"), kinds
    assert [k[2] for k in kinds if k[0] == "audio"] == ["eng", "deu"]
    assert [k[2] for k in kinds if k[0] == "subtitle"] == ["eng"]
    assert len(result["chapters"]) == 2
    assert not lab(host, f"find {FILMS} -name '.cardshare-encoding.*'").strip()
    st = status(host)
    assert st["encoder"] == {"name": "libx265", "software": True, "device": None}, st
    assert st["saved_bytes"] == done["size"] - done["new_size"] and st["held_bytes"] == done["size"]


def test_a_file_the_rules_do_not_pick_is_skipped_with_its_reason(host: Any) -> None:
    small = row(host, f"{FILMS}/Small (2019).mkv")
    assert small is not None and small["state"] == "skipped"
    assert small["reason"] == "1920x1080 is narrower than 3840"


def test_a_plex_transcode_pauses_the_encoder_and_it_continues_after(host: Any) -> None:
    path = add_film(host, "Remux Two (2022).mkv")
    wait_for(
        "the encoder to start on it",
        lambda: status(host)["current"] == path and encoder_states(host),
        120,
        0.5,
    )
    plex_transcode(host, "on")
    try:
        st = wait_for(
            "the campaign to pause for Plex",
            lambda: (s := status(host))["phase"] == "paused" and s,
            30,
            0.5,
        )
        assert "Plex transcodes (1 session(s)" in st["paused_reason"], st
        assert encoder_states(host) == ["T"]  # stopped, not ended: it continues where it was
        time.sleep(3)
        assert encoder_states(host) == ["T"] and row(host, path)["state"] == "encoding"
    finally:
        plex_transcode(host, "off")
    wait_for(
        "the file to be done once Plex stopped", lambda: row(host, path)["state"] == "done", 300
    )


def test_the_arbiters_pause_is_acknowledged_within_its_bound(host: Any) -> None:
    path = add_film(host, "Remux Three (2023).mkv")
    wait_for(
        "the encoder to start on it",
        lambda: status(host)["current"] == path and encoder_states(host),
        120,
        0.5,
    )
    asked = time.monotonic()
    code, ack = call(
        host,
        "POST",
        "/v1/pause",
        {"holder": "cardshare-arbiter", "seconds": 120, "reason": "image jobs wait"},
    )
    took = time.monotonic() - asked
    assert code == 200 and ack["paused"] is True and ack["vram_bytes"] == 0, ack
    assert took < 8 + 3, (
        f"the acknowledgement took {took:.1f} s"
    )  # ack_seconds, plus the call from here
    assert encoder_states(host) == []  # ended: its memory leaves the card
    r = row(host, path)
    assert (
        r["state"] == "queued" and "stepped aside for the arbiter (image jobs wait)" in r["reason"]
    ), r
    time.sleep(6)  # past a scan: nothing starts while the pause holds
    assert encoder_states(host) == [] and status(host)["arbiter_pause_until"] is not None
    assert call(host, "POST", "/v1/resume", {"holder": "cardshare-arbiter"}) == (
        200,
        {"paused": False},
    )
    wait_for(
        "the file to be done after the resume", lambda: row(host, path)["state"] == "done", 300
    )


def test_the_service_killed_mid_file_loses_nothing(host: Any) -> None:
    path = add_film(host, "Remux Four (2024).mkv")
    original = lab(host, f"sha256sum {shlex.quote(path)}").split()[0]
    wait_for(
        "the encoder to start on it",
        lambda: status(host)["current"] == path and encoder_states(host),
        120,
        0.5,
    )
    started = lab(host, f"docker inspect -f '{{{{.State.StartedAt}}}}' {CONTAINER}").strip()
    pid = lab(host, f"docker inspect -f '{{{{.State.Pid}}}}' {CONTAINER}").strip()
    lab(host, f"kill -9 {shlex.quote(pid)}")  # the service dies at once; its ffmpeg with it
    wait_for(
        "the restart policy to bring the campaign back",
        lambda: (
            lab(host, f"docker inspect -f '{{{{.State.StartedAt}}}}' {CONTAINER}").strip()
            != started
        ),
        60,
    )
    done = wait_for(
        "the file to be done after the restart",
        lambda: (r := row(host, path)) and r["state"] == "done" and r,
        300,
    )
    assert lab(host, f"sha256sum {shlex.quote(done['held_path'])}").split()[0] == original
    assert not lab(host, f"find {FILMS} -name '.cardshare-encoding.*'").strip()
    assert status(host)["counts"]["done"] == 4


def temp_of(path: str) -> str:
    """The encode's temporary output beside the original (campaign.runner.TEMP_PREFIX)."""
    folder, _, name = path.rpartition("/")
    return f"{folder}/.cardshare-encoding.{name}.mkv"


def paused_by_plex_mid_file(host: Any, path: str) -> None:
    """The encode of ``path`` under way, then stopped for Plex (who stays on: the caller turns
    it off)."""
    wait_for(
        "the encoder to start on it",
        lambda: status(host)["current"] == path and encoder_states(host),
        120,
        0.5,
    )
    plex_transcode(host, "on")
    st = wait_for(
        "the campaign to pause for Plex",
        lambda: (s := status(host))["phase"] == "paused" and s,
        30,
        0.5,
    )
    states, r = encoder_states(host), row(host, path)
    assert states == ["T"] and r["state"] == "encoding", (states, r, st)


# The encoder's result damaged where it is already written (a failing disk, a bad write), run on
# the lab host as one program so that it acts within milliseconds: ffmpeg's Matroska muxer
# writes a cluster (5 s of media) at a time, so a 6-second clip's result has its first cluster
# on disk for only the last seconds of its encode. It waits for that cluster, stops the encoder
# (SIGSTOP, the test's own), writes 64 KiB of random bytes into the cluster's middle, and lets
# the encoder go on. It prints the result's size when it was damaged.
DAMAGE = r"""
import os, signal, sys, time
temp = sys.argv[1]
deadline = time.monotonic() + 300
while not (os.path.exists(temp) and os.path.getsize(temp) > 0):
    if time.monotonic() > deadline:
        sys.exit("no result was written")
    time.sleep(0.02)
pids = []
for p in os.listdir("/proc"):
    try:
        argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
    except OSError:
        continue
    if argv[0].endswith(b"ffmpeg") and b"-c:v:0" in argv and temp.encode() in argv:
        pids.append(int(p))
if len(pids) != 1:
    sys.exit(f"the encoder was not found running ({pids}): "
             "it ended before its result could be damaged")
os.kill(pids[0], signal.SIGSTOP)
try:
    size = os.path.getsize(temp)
    with open(temp, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(os.urandom(65536))
finally:
    os.kill(pids[0], signal.SIGCONT)
print(size)
"""


def campaign_log(host: Any, since: str) -> str:
    return lab(host, f"docker logs --since {shlex.quote(since)} {CONTAINER} 2>&1")


def test_a_file_changed_during_its_encode_is_not_replaced(host: Any) -> None:
    path = add_film(host, "Remux Five (2025).mkv", "short")
    since = lab(host, "date -u +%Y-%m-%dT%H:%M:%SZ").strip()
    try:
        paused_by_plex_mid_file(host, path)
        # the user's tagger rewrites the file while it is encoded: a new mtime, new bytes
        lab(host, f"printf 'tag' >> {shlex.quote(path)}")
        changed = lab(host, f"sha256sum {shlex.quote(path)}").split()[0]
    finally:
        plex_transcode(host, "off")
    wait_for(
        "the campaign to refuse to replace it",
        lambda: f"not replaced: {path} changed while it was encoded" in campaign_log(host, since),
        300,
    )
    assert (
        lab(host, f"sha256sum {shlex.quote(path)}").split()[0] == changed
    )  # the user's file stands
    assert not lab(host, f"ls {shlex.quote(HELD)} | grep -F 'Remux Five' || true").strip()
    # examined again as the file it now is, and done from that
    done = wait_for(
        "the changed file to be done",
        lambda: (r := row(host, path)) and r["state"] == "done" and r,
        300,
    )
    assert lab(host, f"sha256sum {shlex.quote(done['held_path'])}").split()[0] == changed
    assert not lab(host, f"find {FILMS} -name '.cardshare-encoding.*'").strip()


def test_a_corrupted_result_keeps_the_original_and_says_why(host: Any) -> None:
    path = add_film(host, "Remux Six (2026).mkv")
    original = lab(host, f"sha256sum {shlex.quote(path)}").split()[0]
    damaged_at = int(lab(host, f"python3 -c {shlex.quote(DAMAGE)} {shlex.quote(temp_of(path))}"))
    assert damaged_at > 65536 * 4, damaged_at  # a cluster, past the header
    failed = wait_for(
        "the file to fail its checks",
        lambda: (r := row(host, path)) and r["state"] == "failed" and r,
        300,
    )
    assert "the decode pass failed" in failed["reason"] and failed["reason"].endswith(
        "the original is kept"
    ), failed
    assert lab(host, f"sha256sum {shlex.quote(path)}").split()[0] == original
    assert (
        failed["held_path"] is None
        and not lab(host, f"find {FILMS} -name '.cardshare-encoding.*'").strip()
    )
    st = status(host)
    assert {"path": path, "reason": failed["reason"]} in st["failed"] and st["counts"][
        "failed"
    ] == 1, st
    # and `cardshare campaign status`, as a user reads it, names the file and the reason
    text = lab(host, "cardshare campaign status")
    assert f"  {path}: the decode pass failed" in text, text


def test_the_recorders_report_has_the_campaigns_month(host: Any) -> None:
    month = lab(host, "date -u +%Y-%m").strip()
    doc = json.loads(lab(host, f"cardshare report --month {month} --json"))["campaign"]
    rows = json.loads(
        lab(
            host,
            f"docker exec {CONTAINER} python3 -c "
            + shlex.quote(
                "import json, sqlite3\n"
                "c = sqlite3.connect('/var/lib/cardshare/campaign/campaign.sqlite3')\n"
                'print(json.dumps(c.execute("SELECT COUNT(*), SUM(size - new_size) FROM files'
                " WHERE state = 'done'\").fetchone()))\n"
            ),
        )
    )
    # every file of the tests above was replaced this month, one failed
    assert (doc["done"], doc["saved_bytes"], doc["failed"]) == (rows[0], rows[1], 1), doc
    assert doc["done"] >= 5 and doc["held_bytes_now"] > 0
    line = lab(host, f"cardshare report --month {month}").splitlines()[-1]
    assert (
        line.startswith(f"re-encode campaign: {rows[0]} file(s) replaced, ")
        and "; 1 failed (originals kept" in line
    ), line
