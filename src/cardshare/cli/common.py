"""What the command families share: argument types, the ``--root`` option (an argparse parent),
the Docker socket's default, the usage error, a size in GiB."""

from __future__ import annotations

import argparse

DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"


class UsageError(Exception):
    """A usage error found after parsing (exit 2)."""


def root_option() -> argparse.ArgumentParser:
    """The parent of the commands that read ``/proc`` and ``/sys``."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--root", default="/", help="root prefix of /proc and /sys (default /)")
    return parent


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


def arbiter_url(text: str) -> str:
    """``http(s)://HOST[:PORT][/prefix]`` without a trailing slash."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  # a bad port raises ValueError here
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise argparse.ArgumentTypeError(
            f"expected the arbiter's address as http://HOST:PORT, got {text!r}"
        )
    return text.rstrip("/")


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def ovms_url(text: str) -> str:
    """OpenVINO Model Server's REST address, ``http(s)://HOST[:PORT][/prefix]``."""
    try:
        return arbiter_url(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected OpenVINO Model Server's REST address as http://HOST:PORT, got {text!r}"
        ) from None


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.2f} GiB"
