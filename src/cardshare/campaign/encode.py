"""The encoder: which one (from what ``vainfo`` reports for the card), its ffmpeg command, and
the decode pass that proves a result plays.

A VAAPI encoder is chosen only when the card's driver reports an encode entrypoint for its
profile (``VAProfileHEVCMain10 : VAEntrypointEncSlice`` for 10-bit HEVC) and ffmpeg has the
encoder. A software encoder (``libx265``) is used only when asked for (``software``): on a
real host the campaign refuses to run without VAAPI otherwise, and the lab asks for it
explicitly (SIMULATION: no VAAPI device exists there).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from cardshare.campaign.media import Media

__all__ = [
    "Encoder",
    "EncoderError",
    "choose_encoder",
    "decode_error",
    "encode_argv",
    "ffmpeg_encoders",
    "vaapi_encode_profiles",
]

# the VAAPI encoders and the profiles they need (8-bit, 10-bit)
VAAPI_PROFILES = {
    "hevc_vaapi": ("VAProfileHEVCMain", "VAProfileHEVCMain10"),
    "av1_vaapi": ("VAProfileAV1Profile0", "VAProfileAV1Profile0"),
}
SOFTWARE = {"hevc_vaapi": "libx265", "av1_vaapi": "libsvtav1"}
_VAINFO_LINE = re.compile(r"^\s*(VAProfile\w+)\s*:\s*(VAEntrypointEncSlice(?:LP)?)\s*$")


class EncoderError(Exception):
    """No usable encoder: the message says what is missing and what to set."""


@dataclass(frozen=True, slots=True)
class Encoder:
    name: str  # ffmpeg's encoder name
    device: str | None  # the render node (VAAPI)
    software: bool
    quality: int  # VAAPI: -qp; software: -crf
    preset: str = "medium"  # software only

    @property
    def vaapi(self) -> bool:
        return self.name.endswith("_vaapi")


def vaapi_encode_profiles(vainfo_text: str) -> set[str]:
    """The profiles ``vainfo --display drm --device <node>`` lists with an encode entrypoint."""
    return {m.group(1) for line in vainfo_text.splitlines() if (m := _VAINFO_LINE.match(line))}


def ffmpeg_encoders(ffmpeg: str = "ffmpeg") -> set[str]:
    try:
        out = subprocess.run(
            [ffmpeg, "-hide_banner", "-encoders"], capture_output=True, timeout=30, check=False
        ).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EncoderError(f"cannot run {ffmpeg} -encoders: {exc}") from None
    return {
        parts[1]
        for line in out.splitlines()
        if len(parts := line.split()) > 1 and parts[0][:1] == "V"
    }


def choose_encoder(
    preferred: Sequence[str],
    ffmpeg_has: set[str],
    vaapi_profiles: set[str] | None,
    device: str,
    quality: int,
    software: str | None = None,
    preset: str = "medium",
    ten_bit: bool = True,
) -> Encoder:
    """The first of ``preferred`` the card and ffmpeg can run; else ``software`` if given."""
    missing = []
    for name in preferred:
        profiles = VAAPI_PROFILES.get(name)
        if profiles is None:
            raise EncoderError(
                f"encoder {name!r} is not a VAAPI encoder: use one of {sorted(VAAPI_PROFILES)}"
            )
        needed = profiles[1] if ten_bit else profiles[0]
        if name not in ffmpeg_has:
            missing.append(f"{name}: ffmpeg has no such encoder")
        elif vaapi_profiles is None:
            missing.append(f"{name}: vainfo could not be read for {device}")
        elif needed not in vaapi_profiles:
            missing.append(f"{name}: {device} reports no encode entrypoint for {needed}")
        else:
            return Encoder(name, device, False, quality)
    if software:
        if software not in ffmpeg_has:
            raise EncoderError(f"the software encoder {software!r} is not in this ffmpeg")
        return Encoder(software, None, True, quality, preset)
    raise EncoderError(
        "no VAAPI encoder: "
        + "; ".join(missing or ["none preferred"])
        + ". Fix the card's media driver, or set the software encoder to encode on the CPU "
        "(slow; it never uses the card)"
    )


def encode_argv(ffmpeg: str, src: str, dst: str, media: Media, enc: Encoder) -> list[str]:
    """Video, audio, subtitles and attachments kept (video re-encoded, the rest copied),
    chapters and metadata too."""
    video = media.video
    assert video is not None
    position = [s.index for s in media.kinds("video")].index(video.index)
    ten_bit = media.ten_bit or media.hdr is not None
    argv = [ffmpeg, "-nostdin", "-hide_banner", "-nostats", "-v", "error", "-y"]
    if enc.vaapi:
        argv += ["-vaapi_device", str(enc.device)]
    # every stream but data streams (an MP4's timecode track), which Matroska cannot hold
    argv += ["-i", src, "-map", "0", "-map", "-0:d", "-c", "copy", f"-c:v:{position}", enc.name]
    if enc.vaapi:
        argv += [f"-filter:v:{position}", f"format={'p010' if ten_bit else 'nv12'},hwupload"]
        argv += ["-qp", str(enc.quality)]
        if media.hdr:
            argv += ["-sei", "hdr"]  # mastering display and light level SEI from side data
    else:
        argv += ["-preset", enc.preset, "-crf", str(enc.quality)]
        if ten_bit:
            argv += [f"-pix_fmt:v:{position}", "yuv420p10le"]
        if enc.name == "libx265":
            argv += [
                "-x265-params",
                "log-level=error" + (":hdr10=1:repeat-headers=1" if media.hdr else ""),
            ]
    if media.hdr:
        argv += [
            f"-color_primaries:v:{position}",
            video.color_primaries,
            f"-color_trc:v:{position}",
            video.color_transfer,
            f"-colorspace:v:{position}",
            video.color_space,
        ]
    argv += ["-map_metadata", "0", "-map_chapters", "0", "-f", "matroska", "--", dst]
    return argv


def decode_error(path: str, ffmpeg: str = "ffmpeg", timeout: float = 3600.0) -> str | None:
    """Decode every video and audio frame; the first error, or None when all decoded."""
    argv = [ffmpeg, "-nostdin", "-hide_banner", "-nostats", "-v", "error", "-xerror", "-i", path]
    argv += ["-map", "0:v", "-map", "0:a?", "-f", "null", "-"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"took more than {timeout:.0f} s"
    except OSError as exc:
        return f"cannot run {ffmpeg}: {exc.strerror or exc}"
    errors = done.stderr.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or errors:
        return errors[0] if errors else f"ffmpeg exited with {done.returncode}"
    return None
