"""``cardshare proxy key add|remove|list``: make an agent's API key, keep its hash in the file.

``add NAME`` makes a random 256-bit key, appends ``NAME sha256:HEX`` to the key file (written
atomically: the proxy, polling the file, sees the old keys or the new ones, never a part) and
prints the key once; only its hash is kept. ``remove NAME`` drops a name's line; ``list``
prints the names. The running proxy picks the change up within ``keys_reload_seconds``.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from cardshare.atomicfile import write_atomic
from cardshare.proxy.keys import NAME_RE, KeysFileError, key_line, parse_keys

#: Where the arbiter role keeps the proxy's key file on the host (arbiter_proxy_keys_file).
DEFAULT_KEYS_FILE = "/etc/cardshare/proxy-keys/keys"
#: What every key starts with, so a leaked one is recognisable in logs and repositories.
KEY_PREFIX = "csk-"


def new_key() -> str:
    """A random key: 32 bytes (256 bits) from the OS's generator, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""


def _write(path: Path, text: str) -> None:
    parse_keys(text, str(path))  # never write a file the proxy would refuse
    write_atomic(path, text.encode("utf-8"), mode=0o640, make_parents=True)


def add(path: Path, name: str, max_requests: int | None, out: TextIO) -> int:
    if not NAME_RE.match(name):
        raise KeysFileError(f"bad name {name!r}: letters, digits and '._@-', at most 64")
    text = _read(path)
    keys = parse_keys(text, str(path))
    if any(k.name == name for k in keys.values()):
        raise KeysFileError(f"{path}: {name!r} already has a key; remove it first to replace it")
    key = new_key()
    line = key_line(name, key) + (f" max_requests={max_requests}" if max_requests else "")
    if text and not text.endswith("\n"):
        text += "\n"
    _write(path, text + line + "\n")
    print(key, file=out)
    return 0


def remove(path: Path, name: str, out: TextIO) -> int:
    text = _read(path)
    parse_keys(text, str(path))
    kept = [ln for ln in text.splitlines() if ln.split("#", 1)[0].split()[:1] != [name]]
    if len(kept) == len(text.splitlines()):
        raise KeysFileError(f"{path}: no key named {name!r}")
    _write(path, "".join(ln + "\n" for ln in kept))
    print(f"removed {name}", file=out)
    return 0


def list_names(path: Path, out: TextIO) -> int:
    for key in parse_keys(_read(path), str(path)).values():
        bound = f" max_requests={key.max_requests}" if key.max_requests else ""
        print(f"{key.name}{bound}", file=out)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def add_parsers(sub: Any) -> None:
    """The ``proxy`` command and its verbs, under the CLI's subparsers ``sub``."""
    proxy = sub.add_parser("proxy", help="the patient proxy: agents' API keys")
    nouns = proxy.add_subparsers(dest="proxy_command", required=True, metavar="NOUN")
    key = nouns.add_parser("key", help="make, remove and list agents' API keys")
    verbs = key.add_subparsers(dest="key_command", required=True, metavar="VERB")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--file",
        type=Path,
        default=Path(DEFAULT_KEYS_FILE),
        help=f"the key file (default {DEFAULT_KEYS_FILE})",
    )
    add_p = verbs.add_parser("add", parents=[common], help="make a key for NAME; print it once")
    add_p.add_argument("name", metavar="NAME", help="the agent or fleet the key is for")
    add_p.add_argument(
        "--max-requests", type=_positive, help="this key's bound on held and in-flight requests"
    )
    remove_p = verbs.add_parser("remove", parents=[common], help="remove NAME's key")
    remove_p.add_argument("name", metavar="NAME")
    verbs.add_parser("list", parents=[common], help="the names with a key")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run a parsed ``proxy key`` command; errors go to stderr with exit status 1."""
    try:
        if args.key_command == "add":
            return add(args.file, args.name, args.max_requests, out)
        if args.key_command == "remove":
            return remove(args.file, args.name, out)
        return list_names(args.file, out)
    except (KeysFileError, OSError) as exc:
        print(f"cardshare proxy: error: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``cardshare proxy key ...`` on its own (``python -m cardshare.proxy.keytool``)."""
    parser = argparse.ArgumentParser(prog="cardshare")
    add_parsers(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return run(args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
