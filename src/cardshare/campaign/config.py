"""The campaign's settings (a JSON file the role renders), checked before anything runs."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cardshare.campaign.rules import Checks, Rules
from cardshare.campaign.summary import DATABASE

__all__ = ["CampaignConfig", "ConfigError", "Hours", "load_config", "parse_config"]

_HOURS = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-4]):([0-5][0-9])$")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Hours:
    """Windows of local time, ``[(start minute, end minute), ...]``; one may wrap midnight."""

    windows: tuple[tuple[int, int], ...] = ((0, 24 * 60),)

    def allows(self, minute_of_day: int) -> bool:
        for start, end in self.windows:
            if start <= end:
                if start <= minute_of_day < end:
                    return True
            elif minute_of_day >= start or minute_of_day < end:
                return True
        return False


@dataclass(frozen=True, slots=True)
class CampaignConfig:
    libraries: tuple[Path, ...]
    state_dir: Path
    hold_dir: Path
    rules: Rules = field(default_factory=Rules)
    checks: Checks = field(default_factory=Checks)
    encoders: tuple[str, ...] = ("av1_vaapi", "hevc_vaapi")
    software_encoder: str | None = None  # SIMULATION in the lab; on a host only when asked
    software_preset: str = "medium"
    device: str = "/dev/dri/renderD128"
    quality: int = 24
    ffmpeg: str = "ffmpeg"
    ffprobe: str = "ffprobe"
    hold_days: float = 30.0  # 0: keep the originals until `cardshare campaign purge`
    max_attempts: int = 3
    max_pause_seconds: float = 600.0  # paused for Plex longer: abandon, retry later
    retry_seconds: float = 1800.0
    reserve_bytes: int = 2 * 1024**3  # never fill the library's filesystem past this
    hours: Hours = field(default_factory=Hours)
    poll_seconds: float = 0.25
    scan_seconds: float = 3600.0
    card_current_json: Path | None = None  # the recorder's current.json: Plex on the card
    card_max_age_seconds: float = 180.0
    transcode_client_names: tuple[str, ...] = ("plex/plex",)
    plex_url: str | None = None  # Plex's sessions API (token in plex_token_file)
    plex_token_file: Path | None = None
    listen_host: str = "127.0.0.1"
    listen_port: int = 8097
    ack_seconds: float = 8.0

    @property
    def db_path(self) -> Path:
        return self.state_dir / DATABASE


def _err(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"config key {key!r} has value {value!r}: {fix}")


def _hours(value: Any) -> Hours:
    if not isinstance(value, list) or not value:
        raise _err("hours", value, 'give a list of "HH:MM-HH:MM" windows, e.g. ["00:00-07:00"]')
    windows = []
    for item in value:
        m = _HOURS.match(item) if isinstance(item, str) else None
        if m is None:
            raise _err("hours", value, f'{item!r} is not "HH:MM-HH:MM" (24-hour local time)')
        a, b = int(m.group(1)) * 60 + int(m.group(2)), int(m.group(3)) * 60 + int(m.group(4))
        if b > 24 * 60 or a == b:
            raise _err("hours", value, f"{item!r} is an empty or impossible window")
        windows.append((a, b))
    return Hours(tuple(windows))


_NUMBERS: dict[str, tuple[type, float, float]] = {
    "quality": (int, 0, 63),
    "hold_days": (float, 0, 3650),
    "max_attempts": (int, 1, 100),
    "max_pause_seconds": (float, 1, 86400),
    "retry_seconds": (float, 0, 86400 * 30),
    "reserve_bytes": (int, 0, 2**62),
    "poll_seconds": (float, 0.01, 10),
    "scan_seconds": (float, 1, 86400 * 7),
    "card_max_age_seconds": (float, 1, 86400),
    "listen_port": (int, 0, 65535),  # 0: any free port (tests)
    "ack_seconds": (float, 0.1, 300),
    "min_width": (int, 1, 100000),
    "min_bit_rate": (int, 0, 2**40),
    "duration_tolerance_seconds": (float, 0, 3600),
    "min_saving": (float, 0, 0.95),
}


def _number(key: str, value: Any) -> float | int:
    kind, low, high = _NUMBERS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _err(key, value, f"set it to a number from {low:g} to {high:g}")
    if kind is int and not isinstance(value, int):
        raise _err(key, value, f"set it to a whole number from {low:g} to {high:g}")
    if not low <= value <= high:
        raise _err(key, value, f"set it to a number from {low:g} to {high:g}")
    return int(value) if kind is int else float(value)


def _strings(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _err(key, value, "set it to a list of non-empty strings")
    return tuple(value)


def _path(key: str, value: Any) -> Path:
    if not isinstance(value, str) or not value.startswith("/"):
        raise _err(key, value, "set it to an absolute path")
    return Path(value)


def parse_config(raw: Any) -> CampaignConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    rule_keys = {f.name for f in fields(Rules)}
    check_keys = {f.name for f in fields(Checks)}
    known = {f.name for f in fields(CampaignConfig)} - {"rules", "checks"} | rule_keys | check_keys
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _err(unknown[0], raw[unknown[0]], "remove it (unknown key; check its spelling)")
    for key in ("libraries", "state_dir", "hold_dir"):
        if key not in raw:
            raise ConfigError(f"config key {key!r} is missing: set it")
    kwargs: dict[str, Any] = {
        "libraries": tuple(_path("libraries", p) for p in _strings("libraries", raw["libraries"])),
        "state_dir": _path("state_dir", raw["state_dir"]),
        "hold_dir": _path("hold_dir", raw["hold_dir"]),
    }
    if not kwargs["libraries"]:
        raise _err("libraries", raw["libraries"], "give at least one library directory")
    rules: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    for key, value in raw.items():
        if key in kwargs:
            continue
        target = rules if key in rule_keys else checks if key in check_keys else kwargs
        if key in _NUMBERS:
            target[key] = _number(key, value)
        elif key in (
            "extensions",
            "containers",
            "video_codecs",
            "encoders",
            "transcode_client_names",
        ):
            target[key] = _strings(key, value)
        elif key == "hours":
            kwargs[key] = _hours(value)
        elif key in ("card_current_json", "plex_token_file"):
            kwargs[key] = None if value is None else _path(key, value)
        elif key in ("software_encoder", "plex_url"):
            if value is not None and (not isinstance(value, str) or not value):
                raise _err(key, value, "set it to a non-empty string, or null")
            if (
                key == "plex_url"
                and value is not None
                and not value.startswith(("http://", "https://"))
            ):
                raise _err(key, value, "set it to Plex's http:// or https:// base URL")
            kwargs[key] = value.rstrip("/") if key == "plex_url" and value else value
        elif isinstance(value, str) and value:
            target[key] = value
        else:
            raise _err(key, value, "set it to a non-empty string")
    if "extensions" in rules and not all(e.startswith(".") for e in rules["extensions"]):
        raise _err("extensions", raw["extensions"], 'give extensions with their dot: [".mkv"]')
    config = CampaignConfig(rules=Rules(**rules), checks=Checks(**checks), **kwargs)
    for library in config.libraries:
        if config.hold_dir == library or library in config.hold_dir.parents:
            raise _err(
                "hold_dir",
                str(config.hold_dir),
                f"keep it outside the library {library} (the "
                "campaign would find the originals it holds), on the same filesystem",
            )
    return config


def load_config(path: Path) -> CampaignConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    return parse_config(raw)
