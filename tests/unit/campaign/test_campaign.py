"""The re-encode campaign with the real ffmpeg and ffprobe (Debian's) on media ffmpeg itself
makes: picking, encoding (libx265: SIMULATION of the card's VAAPI encoder, which no machine
here has), verifying, replacing, holding, and every way a file could be lost.

Clips are small (640x360, one or two seconds) with the rules' width bound lowered to match;
the site of a 4K clip is the molecule scenario's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cardshare.campaign.config import ConfigError, parse_config
from cardshare.campaign.encode import (
    EncoderError,
    choose_encoder,
    encode_argv,
    ffmpeg_encoders,
    vaapi_encode_profiles,
)
from cardshare.campaign.media import Media, Stream, parse_probe, probe
from cardshare.campaign.rules import Checks, Rules, select, verify
from cardshare.campaign.runner import TEMP_PREFIX, Campaign, CardPlex
from cardshare.campaign.server import make_server, metrics_text, serve_in_thread
from cardshare.campaign.store import FileState, Store

# Skipped only off CI without ffmpeg; under CI (make test installs it) a missing ffmpeg fails.
pytestmark = pytest.mark.skipif(
    (shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None)
    and not os.environ.get("CI"),
    reason="ffmpeg and ffprobe are installed by tools/deps.sh (make deps)",
)


def make_clip(
    path: Path,
    seconds: float = 1.0,
    size: str = "640x360",
    hdr: bool = False,
    languages: tuple[str, ...] = ("eng", "deu"),
) -> Path:
    """A remux-like source: near-lossless H.264 (or 10-bit HEVC tagged HDR10), two audio
    tracks with languages, an English subtitle, two chapters and a title."""
    work = path.parent
    srt = work / f"{path.stem}.srt"
    srt.write_text("1\n00:00:00,000 --> 00:00:00,500\nHello\n\n")
    meta = work / f"{path.stem}.ffmeta"
    half = int(seconds * 500)
    meta.write_text(
        ";FFMETADATA1\ntitle=A test remux\n"
        f"[CHAPTER]\nTIMEBASE=1/1000\nSTART=0\nEND={half}\ntitle=One\n"
        f"[CHAPTER]\nTIMEBASE=1/1000\nSTART={half}\nEND={2 * half}\ntitle=Two\n"
    )
    argv = [
        "ffmpeg",
        "-v",
        "error",
        "-y",
        "-f",
        "lavfi",
        "-i",
        f"testsrc2=size={size}:rate=24:duration={seconds}",
    ]
    for i, _ in enumerate(languages):
        argv += ["-f", "lavfi", "-i", f"sine=f={440 + 220 * i}:d={seconds}"]
    argv += ["-i", str(srt), "-i", str(meta)]
    n = len(languages)
    argv += (
        ["-map", "0"] + [x for i in range(n) for x in ("-map", str(i + 1))] + ["-map", str(n + 1)]
    )
    argv += ["-map_metadata", str(n + 2), "-map_chapters", str(n + 2)]
    if hdr:
        argv += [
            "-c:v",
            "libx265",
            "-x265-params",
            "log-level=error:lossless=1",
            "-pix_fmt",
            "yuv420p10le",
        ]
        argv += ["-color_primaries", "bt2020", "-color_trc", "smpte2084", "-colorspace", "bt2020nc"]
    else:
        argv += ["-c:v", "libx264", "-preset", "ultrafast", "-qp", "4"]
    argv += ["-c:a", "flac", "-c:s", "srt"]
    for i, lang in enumerate(languages):
        argv += [f"-metadata:s:a:{i}", f"language={lang}"]
    argv += ["-metadata:s:s:0", "language=eng", str(path)]
    subprocess.run(argv, check=True, capture_output=True)
    return path


def sha(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


RULES = {"min_width": 320, "min_bit_rate": 100_000}


def raw_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """The campaign's JSON config for a library under ``tmp_path`` (software encoder)."""
    return {
        "libraries": [str(tmp_path / "library")],
        "state_dir": str(tmp_path / "state"),
        "hold_dir": str(tmp_path / "hold"),
        "encoders": [],
        "software_encoder": "libx265",
        "software_preset": "ultrafast",
        "quality": 34,
        "reserve_bytes": 0,
        **RULES,
        **extra,
    }


def config_for(tmp_path: Path, **extra: Any) -> Any:
    return parse_config(
        raw_config(tmp_path, **{"poll_seconds": 0.05, "retry_seconds": 60, **extra})
    )


@pytest.fixture
def library(tmp_path: Path) -> Path:
    lib = tmp_path / "library" / "Films"
    lib.mkdir(parents=True)
    return lib


def campaign_for(tmp_path: Path, **kwargs: Any) -> Campaign:
    extra = kwargs.pop("config", {})
    config = config_for(tmp_path, **extra)
    config.state_dir.mkdir(parents=True, exist_ok=True)
    encoder = choose_encoder(
        (), ffmpeg_encoders(), None, config.device, config.quality, "libx265", "ultrafast"
    )
    store = Store(config.db_path, clock=kwargs.get("clock", time.time))
    return Campaign(config, store, encoder, **kwargs)


# --- probing and the rules (pure) -----------------------------------------------------------


def test_probe_reads_streams_languages_chapters_and_hdr(library: Path) -> None:
    sdr = probe(str(make_clip(library / "sdr.mkv")))
    assert sdr.format_names[0] == "matroska" and sdr.chapters == 2
    assert sdr.languages("audio") == ["eng", "deu"] and sdr.languages("subtitle") == ["eng"]
    assert sdr.video is not None and (sdr.video.codec, sdr.video.width) == ("h264", 640)
    assert sdr.hdr is None and not sdr.ten_bit
    hdr = probe(str(make_clip(library / "hdr.mkv", hdr=True)))
    assert hdr.hdr == "HDR10" and hdr.ten_bit


def test_probe_of_a_file_that_is_not_media_is_a_reason(library: Path) -> None:
    bad = library / "notes.mkv"
    bad.write_text("not a film")
    with pytest.raises(Exception, match="ffprobe cannot read"):
        probe(str(bad))
    with pytest.raises(Exception, match="no duration"):
        parse_probe({"format": {"duration": "N/A"}}, "x")


def media(**kw: Any) -> Media:
    video = Stream(
        0,
        "video",
        kw.pop("codec", "h264"),
        "und",
        kw.pop("width", 3840),
        2160,
        "yuv420p10le",
        kw.pop("trc", ""),
        "bt2020",
        "bt2020nc",
        False,
        kw.pop("side", ()),
    )
    audio = tuple(
        Stream(i + 1, "audio", "truehd", lang, 0, 0)
        for i, lang in enumerate(kw.pop("audio", ("eng",)))
    )
    base = {
        "path": "/lib/a.mkv",
        "format_names": ("matroska", "webm"),
        "duration": 7200.0,
        "size": 60 * 10**9,
        "bit_rate": 66_000_000,
        "streams": (video, *audio),
        "chapters": 12,
    }
    base.update(kw)
    return Media(**base)


@pytest.mark.parametrize(
    ("changes", "chosen", "why"),
    [
        ({}, True, "h264 3840x2160 at 66.0 Mb/s"),
        ({"width": 3839}, False, "narrower than 3840"),
        ({"bit_rate": 40_000_000}, False, "is not above 40.0 Mb/s"),
        ({"bit_rate": 40_000_001}, True, "at 40.0 Mb/s"),
        ({"codec": "av1"}, False, "video codec av1"),
        ({"format_names": ("avi",)}, False, "container avi"),
        ({"trc": "smpte2084"}, True, "HDR10"),
        ({"side": ("DOVI configuration record",)}, False, "Dolby Vision"),
    ],
)
def test_select(changes: dict[str, Any], chosen: bool, why: str) -> None:
    got, reason = select(media(**changes), Rules())
    assert got is chosen and why in reason


@pytest.mark.parametrize(
    ("result", "decode", "expect"),
    [
        ({"size": 30 * 10**9}, None, []),
        ({"size": 48 * 10**9 + 1}, None, ["not 20% smaller"]),
        ({"size": 30 * 10**9, "duration": 7198.9}, None, ["duration 7198.90 s"]),
        (
            {"size": 30 * 10**9, "audio": ("eng", "deu")},
            None,
            ["2 audio stream(s), the original has 1"],
        ),
        ({"size": 30 * 10**9, "audio": ("deu",)}, None, ["audio languages ['deu']"]),
        ({"size": 30 * 10**9, "chapters": 0}, None, ["0 chapters"]),
        ({"size": 30 * 10**9}, "Invalid NAL unit size", ["the decode pass failed: Invalid NAL"]),
    ],
)
def test_verify_names_every_reason(
    result: dict[str, Any], decode: str | None, expect: list[str]
) -> None:
    reasons = verify(media(), media(**result), decode, Checks())
    assert len(reasons) == len(expect) and all(
        e in r for e, r in zip(expect, reasons, strict=True)
    ), reasons


def test_verify_refuses_an_hdr_original_that_came_out_sdr() -> None:
    reasons = verify(media(trc="smpte2084"), media(size=10**9), None, Checks())
    assert reasons == ["HDR none, the original is HDR10"]


# vainfo's output format ("<profile> : <entrypoint>" lines, as libva-utils prints them)
VAINFO = """libva info: VA-API version 1.20.0
vainfo: Driver version: Intel iHD driver for Intel(R) Gen Graphics - 24.1.0
vainfo: Supported profile and entrypoints
      VAProfileH264Main               : VAEntrypointVLD
      VAProfileHEVCMain               : VAEntrypointEncSlice
      VAProfileHEVCMain10             : VAEntrypointVLD
      VAProfileHEVCMain10             : VAEntrypointEncSlice
      VAProfileAV1Profile0            : VAEntrypointVLD
"""


def test_the_encoder_comes_from_what_the_card_reports() -> None:
    profiles = vaapi_encode_profiles(VAINFO)
    assert profiles == {"VAProfileHEVCMain", "VAProfileHEVCMain10"}
    has = {"hevc_vaapi", "av1_vaapi", "libx265"}
    enc = choose_encoder(("av1_vaapi", "hevc_vaapi"), has, profiles, "/dev/dri/renderD128", 24)
    assert (enc.name, enc.device, enc.software) == ("hevc_vaapi", "/dev/dri/renderD128", False)
    with pytest.raises(EncoderError) as err:
        choose_encoder(("av1_vaapi",), has, profiles, "/dev/dri/renderD128", 24)
    assert "reports no encode entrypoint for VAProfileAV1Profile0" in str(err.value)
    assert "set the software encoder" in str(err.value)
    with pytest.raises(EncoderError, match="vainfo could not be read"):
        choose_encoder(("hevc_vaapi",), has, None, "/dev/dri/renderD128", 24)
    soft = choose_encoder(("hevc_vaapi",), has, None, "/dev/dri/renderD128", 24, "libx265")
    assert soft.software and soft.device is None


def test_the_vaapi_command_keeps_every_stream(library: Path) -> None:
    src = probe(str(make_clip(library / "a.mkv", hdr=True)))
    enc = choose_encoder(
        ("hevc_vaapi",), {"hevc_vaapi"}, {"VAProfileHEVCMain10"}, "/dev/dri/renderD128", 22
    )
    argv = encode_argv("ffmpeg", src.path, "/tmp/out.mkv", src, enc)
    joined = " ".join(argv)
    assert "-vaapi_device /dev/dri/renderD128" in joined and "-c:v:0 hevc_vaapi" in joined
    assert "format=p010,hwupload" in joined and "-map 0 -map -0:d -c copy" in joined
    assert "-map_chapters 0" in joined and "-color_trc:v:0 smpte2084" in joined


# --- the whole path with real ffmpeg -------------------------------------------------------------


def test_a_file_is_encoded_verified_replaced_and_its_original_held(
    tmp_path: Path, library: Path
) -> None:
    src = make_clip(library / "Film (2020).mkv", seconds=2)
    small = make_clip(library / "small.mkv", size="160x90")
    before = sha(src)
    camp = campaign_for(tmp_path)
    assert camp.scan() == 2
    assert camp.store.get(str(small)).state is FileState.SKIPPED  # narrower than 320
    assert camp.step(threading.Event()) == "done"
    row = camp.store.get(str(src))
    assert row.state is FileState.DONE and row.new_path == str(src) and row.new_size < row.size
    assert sha(row.held_path) == before and Path(row.held_path).is_relative_to(tmp_path / "hold")
    result = probe(str(src))
    assert result.video.codec == "hevc" and result.languages("audio") == ["eng", "deu"]
    assert result.chapters == 2 and result.languages("subtitle") == ["eng"]
    assert not [p for p in library.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert camp.scan() == 0  # the result is known as one
    status = camp.status()
    assert status["counts"]["done"] == 1 and status["saved_bytes"] == row.size - row.new_size
    assert status["held_bytes"] == row.size
    assert 'cardshare_campaign_files{state="done"} 1' in metrics_text(status)


def test_an_mp4_becomes_an_mkv_and_the_old_name_goes(tmp_path: Path, library: Path) -> None:
    mkv = make_clip(tmp_path / "made.mkv")
    src = library / "clip.mp4"
    subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-i",
            str(mkv),
            "-map",
            "0:v",
            "-map",
            "0:a",
            "-c:v",
            "copy",
            "-c:a",
            "aac",
            str(src),
        ],
        check=True,
    )
    before = sha(src)
    camp = campaign_for(tmp_path, config={"containers": ["mov"]})
    camp.scan()
    assert camp.step(threading.Event()) == "done"
    assert not src.exists() and (library / "clip.mkv").exists()
    assert sha(camp.store.get(str(src)).held_path) == before


def test_a_corrupted_result_keeps_the_original_and_says_why(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv", seconds=2)
    before = sha(src)
    wrapper = tmp_path / "ffmpeg-corrupting"
    # SIMULATION of a bad encode: the real ffmpeg, then the output's second half overwritten
    wrapper.write_text(
        '#!/bin/sh\nffmpeg "$@" || exit $?\nfor last; do :; done\n'
        'case "$last" in *' + TEMP_PREFIX + "*) "
        'size=$(stat -c %s "$last"); dd if=/dev/urandom of="$last" bs=1 seek=$((size / 2)) '
        "count=$((size / 4)) conv=notrunc 2>/dev/null;; esac\n"
    )
    wrapper.chmod(0o755)
    camp = campaign_for(tmp_path, config={"ffmpeg": str(wrapper)})
    camp.scan()
    outcome = camp.step(threading.Event())
    row = camp.store.get(str(src))
    assert outcome.startswith("failed") and row.state is FileState.FAILED, (outcome, row)
    assert "the original is kept" in row.reason
    assert sha(src) == before and not list((tmp_path / "hold").rglob("*.mkv"))
    assert not [p for p in library.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_a_file_changed_during_its_encode_is_not_replaced(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv", seconds=2)
    touched = []

    def sleep(seconds: float) -> None:
        if not touched:  # the user's tagger rewrites the file while it is encoded
            with open(src, "ab") as fh:
                fh.write(b"\0" * 16)
            touched.append(sha(src))
        time.sleep(seconds)

    camp = campaign_for(tmp_path, sleep=sleep)
    camp.scan()
    assert camp.step(threading.Event()) == "changed while encoding"
    row = camp.store.get(str(src))
    assert row.state is FileState.QUEUED and "changed while it was encoded" in row.reason
    assert sha(src) == touched[0]
    assert not [p for p in library.iterdir() if p.name.startswith(TEMP_PREFIX)]


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def encoder_pids(library: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            mine = any(str(library).encode() in c for c in cmd)
            if cmd[0].endswith(b"ffmpeg") and b"-c:v:0" in cmd and mine:
                pids.append(int(entry.name))
    return pids


def test_plex_pauses_the_encoder_and_it_continues_after(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv", seconds=3)
    plex = {"busy": None}
    seen: list[str] = []

    def sleep(seconds: float) -> None:
        pids = encoder_pids(library)
        if pids:
            seen.append(proc_state(pids[0]))
            if len(seen) == 3:
                plex["busy"] = "plex/plex transcodes (vcs 40%)"
            if len(seen) == 10:
                plex["busy"] = None
        time.sleep(seconds)

    camp = campaign_for(tmp_path, plex=lambda: plex["busy"], sleep=sleep)
    camp.scan()
    assert camp.step(threading.Event()) == "done"
    assert "T" in seen[4:9], seen  # stopped while Plex transcoded
    assert seen[-1] != "T"
    assert camp.store.get(str(src)).state is FileState.DONE


def test_paused_too_long_the_file_is_abandoned_and_retried_later(
    tmp_path: Path, library: Path
) -> None:
    src = make_clip(library / "a.mkv", seconds=3)
    before = sha(src)
    camp = campaign_for(tmp_path, plex=lambda: None, config={"max_pause_seconds": 1})
    camp.scan()
    row = camp.store.next_queued(time.time())
    camp.plex = lambda: "plex/plex transcodes (vcs 90%)"
    outcome = camp.encode(row, threading.Event())
    assert "paused for Plex more than 1 s" in outcome
    row = camp.store.get(str(src))
    assert row.state is FileState.QUEUED and row.retry_after > time.time() + 30
    assert camp.store.next_queued(time.time()) is None  # not before retry_seconds
    assert sha(src) == before and not encoder_pids(library)
    assert camp.step(threading.Event()).startswith("waiting: plex/plex")


def test_no_start_outside_the_allowed_hours(tmp_path: Path, library: Path) -> None:
    make_clip(library / "a.mkv")
    camp = campaign_for(tmp_path, config={"hours": ["01:00-06:00"]}, minute_of_day=lambda: 12 * 60)
    camp.scan()
    assert camp.step(threading.Event()) == "outside the allowed hours"
    camp.minute_of_day = lambda: 2 * 60
    assert camp.step(threading.Event()) == "done"


def test_a_full_disk_stops_everything_and_keeps_everything(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    before = sha(src)
    camp = campaign_for(tmp_path, config={"reserve_bytes": 2**61})
    camp.scan()
    outcome = camp.step(threading.Event())
    assert outcome.startswith("disk full at") and "disk_full" in camp.alerts
    assert camp.step(threading.Event()).startswith("disk full")  # nothing else starts either
    assert sha(src) == before and camp.store.get(str(src)).state is FileState.QUEUED
    assert not camp.clear_disk_full()


def failing_encoder(message: str) -> str:
    """An ffmpeg whose encode (the command with -c:v:0) fails with ``message``; the rest real."""
    return (
        '#!/bin/sh\ncase "$*" in *-c:v:0*) echo "' + message + '" >&2; exit 1;; esac\n'
        'exec ffmpeg "$@"\n'
    )


def test_the_encoder_reporting_no_space_stops_the_campaign(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    wrapper = tmp_path / "ffmpeg-full"
    # SIMULATION of ENOSPC mid-encode: ffmpeg's own message, its exit status
    wrapper.write_text(failing_encoder("av_interleaved_write_frame(): No space left on device"))
    wrapper.chmod(0o755)
    camp = campaign_for(tmp_path, config={"ffmpeg": str(wrapper)})
    camp.scan()
    assert camp.step(threading.Event()).startswith("disk full")
    assert (
        camp.store.get(str(src)).state is FileState.QUEUED
        and camp.store.get(str(src)).attempts == 0
    )


def test_an_encoder_error_is_retried_then_the_file_fails(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    wrapper = tmp_path / "ffmpeg-broken"
    wrapper.write_text(failing_encoder("Error initializing output stream"))
    wrapper.chmod(0o755)
    camp = campaign_for(
        tmp_path, config={"ffmpeg": str(wrapper), "max_attempts": 2, "retry_seconds": 0}
    )
    camp.scan()
    camp.step(threading.Event())
    assert camp.store.get(str(src)).state is FileState.QUEUED
    camp.step(threading.Event())
    row = camp.store.get(str(src))
    assert row.state is FileState.FAILED and "Error initializing output stream" in row.reason
    assert "2 attempts" in row.reason


# --- killed at any moment ----------------------------------------------------------------


def test_recovery_after_a_kill_mid_encode(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    before = sha(src)
    camp = campaign_for(tmp_path)
    camp.scan()
    temp = library / f"{TEMP_PREFIX}a.mkv.mkv"
    camp.store.start(str(src), str(temp))
    temp.write_bytes(b"half an encode")
    again = campaign_for(tmp_path)
    assert again.recover() == [f"{src}: interrupted mid-encode; queued again"]
    assert not temp.exists() and sha(src) == before
    assert again.step(threading.Event()) == "done"


def test_recovery_after_a_kill_between_holding_and_replacing(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    before = sha(src)
    camp = campaign_for(tmp_path)
    camp.scan()
    temp = library / f"{TEMP_PREFIX}a.mkv.mkv"
    camp.store.start(str(src), str(temp))
    temp.write_bytes(b"a verified result")
    held = tmp_path / "hold" / "0-library" / "Films" / "a.mkv"
    held.parent.mkdir(parents=True)
    camp.store.set_held(str(src), str(held))
    os.link(src, held)
    again = campaign_for(tmp_path)
    assert "interrupted before the replace" in again.recover()[0]
    assert not held.exists() and not temp.exists() and sha(src) == before


def test_recovery_after_a_kill_after_the_replace(tmp_path: Path, library: Path) -> None:
    src = make_clip(library / "a.mkv")
    before = sha(src)
    camp = campaign_for(tmp_path)
    camp.scan()
    temp = library / f"{TEMP_PREFIX}a.mkv.mkv"
    camp.store.start(str(src), str(temp))
    held = tmp_path / "hold" / "a.mkv"
    held.parent.mkdir(parents=True)
    camp.store.set_held(str(src), str(held))
    os.link(src, held)
    temp.write_bytes(b"the verified result")
    os.replace(temp, src)
    again = campaign_for(tmp_path)
    assert "interrupted after the replace; done" in again.recover()[0]
    row = again.store.get(str(src))
    assert (
        row.state is FileState.DONE
        and sha(held) == before
        and src.read_bytes() == b"the verified result"
    )


def test_a_stray_temporary_file_is_removed_by_the_scan(tmp_path: Path, library: Path) -> None:
    stray = library / f"{TEMP_PREFIX}lost.mkv.mkv"
    stray.write_bytes(b"x")
    campaign_for(tmp_path).scan()
    assert not stray.exists()


def test_the_service_killed_mid_file_loses_nothing(tmp_path: Path, library: Path) -> None:
    """The real service (python -m cardshare.campaign), SIGKILLed while ffmpeg runs, then
    started again: the original untouched, no temporary file left, the file done once."""
    src = make_clip(library / "a.mkv", seconds=4)
    before = sha(src)
    conf = tmp_path / "campaign.json"
    raw = raw_config(tmp_path, software_preset="medium", listen_port=0)
    conf.write_text(json.dumps(raw))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3] / "src")}
    argv = [sys.executable, "-m", "cardshare.campaign", "--config", str(conf)]
    first = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(TEMP_PREFIX) for p in library.iterdir()):
            assert time.monotonic() < deadline and first.poll() is None, "the encoder never started"
            time.sleep(0.05)
        os.killpg(first.pid, 9)  # the service and its ffmpeg, as an OOM kill or a power cut would
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
    assert sha(src) == before
    raw["software_preset"] = "ultrafast"
    conf.write_text(json.dumps(raw))
    second = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        store = Store(tmp_path / "state" / "campaign.sqlite3")
        deadline = time.monotonic() + 120
        while (row := store.get(str(src))) is None or row.state is not FileState.DONE:
            assert time.monotonic() < deadline and second.poll() is None, row
            time.sleep(0.1)
    finally:
        second.terminate()
        second.wait(30)
    assert sha(row.held_path) == before
    assert not [p for p in library.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert probe(str(src)).video.codec == "hevc"


# --- the arbiter's pause -----------------------------------------------------------------


def post(url: str, body: Any, timeout: float = 20) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_arbiters_pause_ends_the_encoder_within_the_bound_and_resume_goes_on(
    tmp_path: Path, library: Path
) -> None:
    src = make_clip(library / "a.mkv", seconds=4)
    before = sha(src)
    camp = campaign_for(tmp_path, config={"ack_seconds": 5})
    camp.encoder = dataclasses.replace(camp.encoder, preset="medium")  # slow enough to interrupt
    camp.scan()
    server = make_server(camp, "127.0.0.1", 0)
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            camp.step(stop)
            time.sleep(0.02)

    worker = threading.Thread(target=work)
    try:
        assert post(f"{url}/v1/pause", {"holder": "x", "seconds": "ten"})[0] == 400
        worker.start()
        deadline = time.monotonic() + 30
        while not encoder_pids(library):
            assert time.monotonic() < deadline, "the encoder never started"
            time.sleep(0.02)
        asked = time.monotonic()
        status, body = post(
            f"{url}/v1/pause",
            {"holder": "cardshare-arbiter", "seconds": 60, "reason": "image jobs"},
        )
        took = time.monotonic() - asked
        assert status == 200 and body["paused"] is True and body["vram_bytes"] == 0, body
        assert took < 5 and not encoder_pids(library)
        row = camp.store.get(str(src))
        assert (
            row.state is FileState.QUEUED
            and "stepped aside for the arbiter (image jobs)" in row.reason
        )
        time.sleep(0.5)
        assert not encoder_pids(library), "an encoder started while the arbiter's pause holds"
        with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
            assert json.loads(resp.read())["arbiter_pause_until"] is not None
        camp.encoder = dataclasses.replace(camp.encoder, preset="ultrafast")
        assert post(f"{url}/v1/resume", {"holder": "cardshare-arbiter"}) == (200, {"paused": False})
        deadline = time.monotonic() + 60
        while camp.store.get(str(src)).state is not FileState.DONE:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(60)
        server.shutdown()
    assert sha(camp.store.get(str(src)).held_path) == before


def test_card_data_tells_plex_transcoding(tmp_path: Path) -> None:
    current = tmp_path / "current.json"
    now = time.time()

    def write(engines: dict[str, float], age: float = 0) -> None:
        current.write_text(
            json.dumps(
                {
                    "timestamp_unix": now - age,
                    "cards": {"p": {"clients": [{"name": "plex/plex", "engines": engines}]}},
                }
            )
        )

    plex = CardPlex(current, ("plex/plex",), 120, lambda: now)
    write({"vcs": 0.0, "rcs": 0.5})
    assert plex() is None
    write({"vcs": 0.25})
    assert plex() == "plex/plex transcodes (vcs 25%)"
    write({}, age=300)
    assert "300 s old" in plex()
    current.write_text("{")
    assert "cannot be read" in plex()


def test_purge_after_the_holding_period(tmp_path: Path, library: Path) -> None:
    make_clip(library / "a.mkv")
    clock = {"t": time.time()}
    camp = campaign_for(tmp_path, clock=lambda: clock["t"], config={"hold_days": 1})
    camp.scan()
    camp.step(threading.Event())
    held = camp.store.rows(FileState.DONE)[0].held_path
    assert camp.purge() == [] and os.path.exists(held)
    clock["t"] += 86400 + 1
    assert camp.purge() == [held] and not os.path.exists(held)
    assert camp.status()["held_bytes"] == 0


@pytest.mark.parametrize(
    ("raw", "key", "fix"),
    [
        ({"hold_dir": "/srv/lib/.hold"}, "hold_dir", "outside the library"),
        ({"hours": ["22:00-22:00"]}, "hours", "empty or impossible"),
        ({"hours": ["7-9"]}, "hours", "HH:MM-HH:MM"),
        ({"min_saving": 1.5}, "min_saving", "from 0 to 0.95"),
        ({"extensions": ["mkv"]}, "extensions", "with their dot"),
        ({"libraries": "/srv/lib"}, "libraries", "list of non-empty strings"),
        ({"encodr": []}, "encodr", "unknown key"),
        ({"plex_url": "plex:32400"}, "plex_url", "http://"),
    ],
)
def test_bad_settings_are_refused_by_name(raw: dict[str, Any], key: str, fix: str) -> None:
    base = {"libraries": ["/srv/lib"], "state_dir": "/var/lib/c", "hold_dir": "/srv/hold"}
    with pytest.raises(ConfigError) as err:
        parse_config({**base, **raw})
    assert repr(key) in str(err.value) and fix in str(err.value)


def test_cardshare_campaign_status(tmp_path: Path, library: Path, capsys: Any) -> None:
    from cardshare.cli import main

    make_clip(library / "a.mkv")
    bad = library / "b.mkv"
    make_clip(bad)
    camp = campaign_for(tmp_path)
    camp.scan()
    camp.step(threading.Event())  # a.mkv (both the same size: by path)
    camp.store.fail(str(bad), "2 audio stream(s), the original has 3; the original is kept")
    server = make_server(camp, "127.0.0.1", 0)
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["campaign", "status", "--url", url]) == 0
        out = capsys.readouterr().out
        assert "encoder:    libx265 (SOFTWARE: it never uses the card)" in out
        assert "1 done, 1 failed" in out and "won back:" in out and "originals held" in out
        assert f"  {bad}: 2 audio stream(s), the original has 3; the original is kept" in out
        assert main(["campaign", "status", "--url", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["counts"]["done"] == 1
    finally:
        server.shutdown()
    assert main(["campaign", "status", "--url", url, "--timeout", "2"]) == 1
    assert "cannot read the campaign's status" in capsys.readouterr().err


async def test_the_arbiters_own_client_gets_its_ack_from_the_campaign(
    tmp_path: Path, library: Path
) -> None:
    """The arbiter's yielding-tenant client (cardshare.arbiter.edges.HttpYielding) against the
    campaign's server while ffmpeg encodes: an ack within the arbiter's bound, 0 bytes held."""
    import asyncio

    import aiohttp

    from cardshare.arbiter.edges import HttpYielding

    make_clip(library / "a.mkv", seconds=4)
    camp = campaign_for(tmp_path, config={"ack_seconds": 5})
    camp.encoder = dataclasses.replace(camp.encoder, preset="medium")
    camp.scan()
    server = make_server(camp, "127.0.0.1", 0)
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    stop = threading.Event()
    worker = threading.Thread(target=lambda: camp.step(stop))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not encoder_pids(library):
            assert time.monotonic() < deadline, "the encoder never started"
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as session:
            tenants = HttpYielding(session, {"campaign/encoder": (url, 10.0)})
            asked = time.monotonic()
            held = await tenants.pause("campaign/encoder", 900, "a swap to image waits")
            assert held == 0 and time.monotonic() - asked < 10
            assert not encoder_pids(library)
            await tenants.resume("campaign/encoder")
        assert camp.control.until() is None
    finally:
        stop.set()
        worker.join(60)
        server.shutdown()


# Plex's GET /status/sessions, in the shape facts.md gives (a TranscodeSession element with
# its transcodeHw* attributes); the stand-in's sessions answer the same way.
SESSIONS = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<MediaContainer size="1"><Video key="/library/1">'
    '<TranscodeSession key="/transcode/sessions/a" videoDecision="transcode" '
    'transcodeHwRequested="1" transcodeHwEncoding="vaapi"/></Video></MediaContainer>'
)


@pytest.mark.parametrize(
    ("answer", "expect"),
    [
        ("sessions", "Plex transcodes (1 session(s), 1 on the card)"),
        ("idle", None),
        ("garbage", None),  # logged; the card data is the other source
        ("500", None),
        ("401", None),
        ("hang", None),  # bounded by the timeout
        ("closed", None),
    ],
)
def test_plex_sessions_answers(answer: str, expect: str | None) -> None:
    import http.server
    import socket

    from cardshare.campaign.runner import PlexSessions

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            assert self.path == "/status/sessions" and self.headers["X-Plex-Token"] == "tok"
            if answer == "hang":
                time.sleep(3)
            if answer == "closed":
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = {
                "sessions": SESSIONS,
                "idle": '<MediaContainer size="0"></MediaContainer>',
                "garbage": "<MediaContainer><Video",
            }.get(answer, "error")
            status = int(answer) if answer.isdigit() else 200
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        plex = PlexSessions(f"http://127.0.0.1:{server.server_address[1]}", "tok", timeout=1.0)
        started = time.monotonic()
        assert plex() == expect
        assert time.monotonic() - started < 2.5
    finally:
        server.shutdown()
