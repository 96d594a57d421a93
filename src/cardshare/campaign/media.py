"""What ffprobe says of a file: container, duration, size, bitrate, streams, chapters, HDR.

Standard library only. :func:`probe` runs ``ffprobe -print_format json -show_format
-show_streams -show_chapters``; :func:`parse_probe` turns its document into a :class:`Media`
and raises :class:`ProbeError` naming what is missing, so a file ffprobe cannot read is a
reason recorded against it, never a crash of the campaign.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

__all__ = ["HDR_TRANSFERS", "Media", "ProbeError", "Stream", "parse_probe", "probe"]

# colour transfer characteristics of HDR video, as ffprobe names them
HDR_TRANSFERS = {"smpte2084": "HDR10", "arib-std-b67": "HLG"}
# side data that no re-encode here can carry over (the file is skipped with this reason)
_DOLBY_VISION = "DOVI configuration record"


class ProbeError(Exception):
    """ffprobe could not read the file, or its answer lacks what the campaign needs."""


@dataclass(frozen=True, slots=True)
class Stream:
    index: int
    kind: str  # video, audio, subtitle, attachment, data
    codec: str
    language: str  # "und" when untagged
    width: int = 0
    height: int = 0
    pix_fmt: str = ""
    color_transfer: str = ""
    color_primaries: str = ""
    color_space: str = ""
    attached_pic: bool = False
    side_data: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Media:
    path: str
    format_names: tuple[str, ...]
    duration: float
    size: int
    bit_rate: int
    streams: tuple[Stream, ...]
    chapters: int

    @property
    def video(self) -> Stream | None:
        """The main video stream (cover art is not one)."""
        return next((s for s in self.streams if s.kind == "video" and not s.attached_pic), None)

    def kinds(self, kind: str) -> list[Stream]:
        return [s for s in self.streams if s.kind == kind and not s.attached_pic]

    def languages(self, kind: str) -> list[str]:
        return [s.language for s in self.kinds(kind)]

    @property
    def hdr(self) -> str | None:
        """``HDR10``, ``HLG``, ``Dolby Vision`` or None (SDR)."""
        video = self.video
        if video is None:
            return None
        if _DOLBY_VISION in video.side_data:
            return "Dolby Vision"
        return HDR_TRANSFERS.get(video.color_transfer)

    @property
    def ten_bit(self) -> bool:
        video = self.video
        return video is not None and ("10" in video.pix_fmt or "12" in video.pix_fmt)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any) -> float | None:
    try:
        result = float(value)
    except (TypeError, ValueError):
        return None
    return result if result == result and result >= 0 else None  # NaN is not a duration


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def parse_probe(doc: Any, path: str) -> Media:
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), dict):
        raise ProbeError(f"ffprobe gave no format for {path}")
    fmt = doc["format"]
    duration = _float(fmt.get("duration"))
    if duration is None or duration <= 0:
        raise ProbeError(f"ffprobe gave no duration for {path}")
    streams: list[Stream] = []
    for raw in _list(doc.get("streams")):
        if not isinstance(raw, dict):
            continue
        tags, disposition = _dict(raw.get("tags")), _dict(raw.get("disposition"))
        side = _list(raw.get("side_data_list"))
        streams.append(
            Stream(
                index=_int(raw.get("index"), len(streams)),
                kind=str(raw.get("codec_type") or "data"),
                codec=str(raw.get("codec_name") or "unknown"),
                language=str(tags.get("language") or tags.get("LANGUAGE") or "und"),
                width=_int(raw.get("width")),
                height=_int(raw.get("height")),
                pix_fmt=str(raw.get("pix_fmt") or ""),
                color_transfer=str(raw.get("color_transfer") or ""),
                color_primaries=str(raw.get("color_primaries") or ""),
                color_space=str(raw.get("color_space") or ""),
                attached_pic=bool(_int(disposition.get("attached_pic"))),
                side_data=tuple(str(s.get("side_data_type")) for s in side if isinstance(s, dict)),
            )
        )
    size = _int(fmt.get("size"))
    bit_rate = _int(fmt.get("bit_rate")) or (int(size * 8 / duration) if size else 0)
    return Media(
        path=path,
        format_names=tuple(str(fmt.get("format_name") or "").split(",")),
        duration=duration,
        size=size,
        bit_rate=bit_rate,
        streams=tuple(streams),
        chapters=len(_list(doc.get("chapters"))),
    )


def probe(path: str, ffprobe: str = "ffprobe", timeout: float = 120.0) -> Media:
    argv = [
        ffprobe,
        "-v",
        "error",
        "-print_format",
        "json",
        "-show_format",
        "-show_streams",
        "-show_chapters",
        "--",
        path,
    ]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"ffprobe took more than {timeout:.0f} s on {path}") from None
    except OSError as exc:
        raise ProbeError(f"cannot run {ffprobe}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        reason = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ProbeError(f"ffprobe cannot read {path}: {reason[-1] if reason else 'no reason'}")
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        raise ProbeError(f"ffprobe's answer for {path} is not JSON") from None
    return parse_probe(doc, path)
