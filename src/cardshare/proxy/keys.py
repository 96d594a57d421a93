"""API keys of the agents: the file of hashed keys, its reloading, the check of a request.

The file has one key a line: ``NAME sha256:HEX [max_requests=N]``; ``#`` starts a comment,
blank lines are skipped. NAME labels an agent or a fleet (the per-key bound and the logs use
it); HEX is the SHA-256 of the key as the agent sends it (``Authorization: Bearer KEY``).

Why SHA-256 and not bcrypt or argon2: the keys are random 256-bit tokens made by
:mod:`cardshare.proxy.keytool`, not passwords; nobody can search a 2**256 space, so a slow
hash buys nothing, while it would cost every request (a bcrypt check takes tens of ms, the
proxy's own cost is under 1 ms). A leaked file gives no key. The digest of the presented key is
looked up in a dict and confirmed with :func:`hmac.compare_digest`: what a timing difference
could tell an attacker is about a digest, which does not lead back to a key.

Reloading is by polling the file's ``stat`` (inode, size, mtime) every ``keys_reload_seconds``,
not inotify or SIGHUP: the proxy runs in a container with the file's directory bind-mounted,
where a poll sees an atomic replace (rename) as surely as an edit, needs no extra dependency,
and nobody has to remember to signal the container after adding a key. A file that does not
parse keeps the last good keys (it never opens the door) and is logged as an error and shown
by ``cardshare_proxy_keys_file_ok 0`` until a good one replaces it.

Standard library only: the host command's zipapp packs it with :mod:`.keytool`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LOG = logging.getLogger("cardshare.proxy")

#: A key's name: an agent or a fleet (letters, digits, ``._@-``).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_BOUND_RE = re.compile(r"^max_requests=([0-9]+)$")


class KeysFileError(ValueError):
    """The key file cannot be read or does not parse; the message names the line."""


@dataclass(frozen=True)
class Key:
    """One agent's (or fleet's) key: its name, the SHA-256 of the key, its own bound if any."""

    name: str
    digest: bytes
    max_requests: int | None = None


def digest_of(key: str) -> bytes:
    """The SHA-256 of a key as sent by the agent."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_line(name: str, key: str) -> str:
    """The file's line for ``key`` under ``name``."""
    return f"{name} sha256:{digest_of(key).hex()}"


def parse_keys(text: str, source: str) -> dict[bytes, Key]:
    """The keys of a key file's text, by digest; raises :class:`KeysFileError`."""
    keys: dict[bytes, Key] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        parts = line.split()
        if len(parts) not in (2, 3):
            raise KeysFileError(
                f"{where}: expected 'NAME sha256:HEX [max_requests=N]', got {len(parts)} fields"
            )
        name, digest_text = parts[0], parts[1]
        if not NAME_RE.match(name):
            raise KeysFileError(f"{where}: bad name {name!r} (letters, digits, '._@-')")
        match = _DIGEST_RE.match(digest_text)
        if match is None:
            raise KeysFileError(f"{where}: expected sha256: and 64 lowercase hex digits")
        bound: int | None = None
        if len(parts) == 3:
            bound_match = _BOUND_RE.match(parts[2])
            if bound_match is None or int(bound_match.group(1)) < 1:
                raise KeysFileError(f"{where}: expected max_requests=N with N >= 1")
            bound = int(bound_match.group(1))
        if name in names:
            raise KeysFileError(f"{where}: name {name!r} listed twice")
        digest = bytes.fromhex(match.group(1))
        if digest in keys:
            raise KeysFileError(f"{where}: the key of {name!r} is already {keys[digest].name!r}'s")
        names.add(name)
        keys[digest] = Key(name, digest, bound)
    return keys


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, None when absent or other."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def lookup(keys: Mapping[bytes, Key], token: str | None) -> Key | None:
    """The key a request's bearer ``token`` matches, None when it matches none."""
    if token is None:
        return None
    digest = digest_of(token)
    found = keys.get(digest)
    if found is None or not hmac.compare_digest(found.digest, digest):
        return None
    return found


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class KeyRing:
    """The keys in force, from a file reloaded when its stat changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.keys: dict[bytes, Key] = {}
        #: False while the file on disk is not the one in force (unreadable or malformed).
        self.file_ok = True
        self.reloads = 0
        self.errors = 0
        self._seen: tuple[int, int, int] | None = None

    def _read(self) -> dict[bytes, Key]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"{self.path}: cannot read: {exc}") from exc
        return parse_keys(text, str(self.path))

    def load(self) -> None:
        """Read the file now; raises :class:`KeysFileError` (the start refuses a bad file)."""
        self._seen = _signature(self.path)
        self.keys = self._read()
        self.file_ok = True

    def maybe_reload(self) -> bool:
        """Reload when the file's stat changed; True when new keys are in force.

        A file that cannot be read or parsed keeps the keys in force and logs an error, once
        per change of the file.
        """
        signature = _signature(self.path)
        if signature == self._seen:
            return False
        self._seen = signature
        try:
            keys = self._read()
        except KeysFileError as exc:
            self.file_ok = False
            self.errors += 1
            LOG.error(
                "key file not reloaded, keeping the %d keys in force: %s", len(self.keys), exc
            )
            return False
        self.keys = keys
        self.file_ok = True
        self.reloads += 1
        LOG.info("key file %s reloaded: %d keys", self.path, len(keys))
        return True


def read_secret(path: str) -> str:
    """A secret file's first line (the upstream's key), stripped; raises :class:`KeysFileError`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"{path}: cannot read: {exc}") from exc
    lines = text.splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret or any(c.isspace() for c in secret):
        raise KeysFileError(f"{path}: expected one key on the first line, without spaces")
    return secret


def is_loopback(host: str) -> bool:
    """True when ``host`` (a listen address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
