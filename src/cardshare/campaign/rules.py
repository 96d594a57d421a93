"""Which files the campaign takes, and how it checks a result before it replaces anything.

:func:`select` answers ``(True, why)`` for a file worth re-encoding and ``(False, why)``
otherwise; :func:`verify` lists every reason a result must not replace its original (an
empty list: it may). Both are pure: the files were probed before (:mod:`.media`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cardshare.campaign.media import Media

__all__ = ["Checks", "Rules", "select", "verify"]


@dataclass(frozen=True, slots=True)
class Rules:
    """What to pick (each bound a campaign variable)."""

    extensions: tuple[str, ...] = (".mkv", ".mp4", ".m2ts", ".ts")
    # ffprobe's format names (Matroska is "matroska,webm"; MP4 "mov,mp4,m4a,3gp,3g2,mj2")
    containers: tuple[str, ...] = ("matroska", "mov", "mpegts")
    video_codecs: tuple[str, ...] = ("h264", "hevc", "mpeg2video", "vc1")
    min_width: int = 3840
    min_bit_rate: int = 40_000_000  # bits per second of the whole file
    target_codec: str = "hevc"  # a file already in it at a low rate is done


def select(media: Media, rules: Rules) -> tuple[bool, str]:
    video = media.video
    if video is None:
        return False, "no video stream"
    if not set(media.format_names) & set(rules.containers):
        return (
            False,
            f"container {','.join(media.format_names)} is not one of {list(rules.containers)}",
        )
    if video.codec not in rules.video_codecs:
        return False, f"video codec {video.codec} is not one of {list(rules.video_codecs)}"
    if video.width < rules.min_width:
        return False, f"{video.width}x{video.height} is narrower than {rules.min_width}"
    if media.bit_rate <= rules.min_bit_rate:
        return False, (
            f"{media.bit_rate / 1e6:.1f} Mb/s is not above {rules.min_bit_rate / 1e6:.1f} Mb/s"
        )
    if media.hdr == "Dolby Vision":
        return False, "Dolby Vision: its metadata cannot be carried over by this encoder"
    return True, (
        f"{video.codec} {video.width}x{video.height} at {media.bit_rate / 1e6:.1f} Mb/s"
        + (f", {media.hdr}" if media.hdr else "")
    )


@dataclass(frozen=True, slots=True)
class Checks:
    """How close a result must be to its original, and how much smaller."""

    duration_tolerance_seconds: float = 1.0
    min_saving: float = 0.2  # the result at most (1 - min_saving) of the original's size


def verify(original: Media, result: Media, decode_error: str | None, checks: Checks) -> list[str]:
    reasons = []
    if abs(original.duration - result.duration) > checks.duration_tolerance_seconds:
        reasons.append(
            f"duration {result.duration:.2f} s, the original {original.duration:.2f} s "
            f"(more than {checks.duration_tolerance_seconds:g} s apart)"
        )
    for kind in ("video", "audio", "subtitle"):
        before, after = original.languages(kind), result.languages(kind)
        if len(before) != len(after):
            reasons.append(f"{len(after)} {kind} stream(s), the original has {len(before)}")
        elif before != after:
            reasons.append(f"{kind} languages {after}, the original's {before}")
    if result.chapters != original.chapters:
        reasons.append(f"{result.chapters} chapters, the original has {original.chapters}")
    if original.hdr != result.hdr:
        reasons.append(f"HDR {result.hdr or 'none'}, the original is {original.hdr or 'SDR'}")
    if decode_error is not None:
        reasons.append(f"the decode pass failed: {decode_error}")
    limit = original.size * (1 - checks.min_saving)
    if result.size > limit:
        reasons.append(
            f"{result.size} bytes is not {checks.min_saving:.0%} smaller than the original's "
            f"{original.size}"
        )
    return reasons
