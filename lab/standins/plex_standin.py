"""SIMULATION: a stand-in for Plex Media Server (``plexinc/pms-docker``) in the cardshare lab.

This is not Plex.  It answers what the collection and the recorder need:

* ``GET /identity``: ``MediaContainer`` XML with ``machineIdentifier``, ``version`` and
  ``claimed`` (``PLEX_CLAIM`` is only ever used as "claimed"; it is never logged or stored);
* ``GET /status/sessions``: the sessions ``MediaContainer``; with ``PLEX_TOKEN`` set, the
  ``X-Plex-Token`` header (or query parameter) must match, else 401;
* a lab control, clearly outside Plex's API: ``POST /:/cardshare-sim/transcode?state=on|off
  [&count=N]``, or the file ``<state dir>/transcode`` holding ``on``, ``off`` or a count.
  While ``N`` transcodes are on, sessions list ``N`` videos, each with a ``TranscodeSession``
  (``transcodeHwRequested/Decoding/Encoding/FullPipeline="1"``), and each is a simulated
  DRM client ``Plex Transcoder`` on the card (about 2 GiB VRAM, ``vcs``/``vecs`` busy).

Environment: ``PLEX_SIM_STATE_DIR`` (default ``/config/cardshare-sim``), ``PLEX_TOKEN``,
``PLEX_CLAIM``, ``STANDIN_TRANSCODE_VRAM_BYTES`` (2 GiB), ``STANDIN_RELEASE_SECONDS`` (1),
``CARDSHARE_SIM_ROOT``; ``--port`` (32400).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from xml.sax.saxutils import quoteattr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simcard import SimClient
from standin_http import Handler, StandinServer, serve_in_thread

__all__ = [
    "PlexServer",
    "PlexState",
    "identity_xml",
    "main",
    "parse_transcode_flag",
    "sessions_xml",
]

VERSION = "1.41.3.9314-a0bfb8370"
TRANSCODER_COMM = "Plex Transcoder"
UNAUTHORIZED = (
    b"<html><head><title>Unauthorized</title></head><body><h1>401 Unauthorized</h1></body></html>"
)
XML_HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n'
GIB = 1024**3


def parse_transcode_flag(text: str) -> int:
    """The number of transcodes a flag file asks for: ``on`` 1, ``off``/empty 0, or a count."""
    value = text.strip().lower()
    if value in ("", "off", "0", "false"):
        return 0
    if value in ("on", "true"):
        return 1
    if value.isdigit():
        return int(value)
    raise ValueError(f"transcode flag must be on, off or a count, got {text.strip()!r}")


def identity_xml(machine_id: str, claimed: bool, version: str = VERSION) -> str:
    return (
        XML_HEAD + f'<MediaContainer size="0" apiVersion="1.1.1" claimed="{int(claimed)}" '
        f'machineIdentifier="{machine_id}" version="{version}">\n'
        "<!-- SIMULATION: cardshare lab stand-in for Plex Media Server -->\n"
        "</MediaContainer>\n"
    )


def _session(index: int, machine_id: str) -> str:
    key = f"cardshare-sim-transcode-{index}"
    return (
        f'<Video addedAt="1700000000" duration="7200000" key="/library/metadata/{1000 + index}" '
        f'librarySectionID="1" ratingKey="{1000 + index}" sessionKey="{index + 1}" '
        f"title={quoteattr(f'Simulated 4K HDR film {index + 1}')} "
        'type="movie" viewOffset="600000">\n'
        '<Media audioCodec="eac3" bitrate="60000" container="mkv" height="2160" '
        'videoCodec="hevc" videoResolution="4k" width="3840">\n'
        '<Part container="mkv" decision="transcode" file="/data/movies/simulated.mkv" />\n'
        "</Media>\n"
        '<User id="1" title="cardshare-lab" />\n'
        f'<Player address="127.0.0.1" machineIdentifier="player-{index}" platform="Chrome" '
        'product="Plex Web" state="playing" title="Lab player" local="1" />\n'
        f'<Session id="sim-session-{index}" bandwidth="20000" location="lan" />\n'
        f'<TranscodeSession key="/transcode/sessions/{key}" throttled="0" complete="0" '
        'progress="10.0" speed="1.5" duration="7200000" context="streaming" '
        'sourceVideoCodec="hevc" sourceAudioCodec="eac3" videoDecision="transcode" '
        'audioDecision="transcode" protocol="dash" container="mp4" videoCodec="h264" '
        'audioCodec="aac" audioChannels="2" width="1920" height="1080" '
        'transcodeHwRequested="1" transcodeHwDecoding="1" transcodeHwDecodingTitle="Intel (VAAPI)" '
        'transcodeHwEncoding="1" transcodeHwEncodingTitle="Intel (VAAPI)" '
        'transcodeHwFullPipeline="1" timeStamp="1700000000.0" maxOffsetAvailable="0.0" '
        'minOffsetAvailable="0.0" />\n'
        "</Video>\n"
    )


def sessions_xml(count: int, machine_id: str) -> str:
    body = "".join(_session(i, machine_id) for i in range(count))
    return (
        XML_HEAD + f'<MediaContainer size="{count}">\n'
        "<!-- SIMULATION: cardshare lab stand-in for Plex Media Server -->\n"
        + body
        + "</MediaContainer>\n"
    )


ClientFactory = Callable[[int], SimClient]


def _transcoder_client(index: int) -> SimClient:
    return SimClient(
        comm=TRANSCODER_COMM,
        cmdline=[
            "/usr/lib/plexmediaserver/Plex Transcoder",
            "-codec:0",
            "hevc",
            "-hwaccel:0",
            "vaapi",
            "-hwaccel_device:0",
            "/dev/dri/renderD128",
            "-codec:1",
            "h264_vaapi",
            f"-cardshare-sim-session={index}",
        ],
    )


class PlexState:
    """The transcode switch (a file) and one simulated card client per running transcode."""

    def __init__(
        self,
        state_dir: Path,
        env: Mapping[str, str],
        client_factory: ClientFactory = _transcoder_client,
    ) -> None:
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.token = env.get("PLEX_TOKEN") or None
        self.claimed = bool(env.get("PLEX_CLAIM"))
        self.vram = int(env.get("STANDIN_TRANSCODE_VRAM_BYTES", str(2 * GIB)))
        self.release = float(env.get("STANDIN_RELEASE_SECONDS", "1"))
        self.machine_id = self._machine_id()
        self.factory = client_factory
        self.clients: list[SimClient] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="transcode-flag", daemon=True)

    @property
    def flag_path(self) -> Path:
        return self.state_dir / "transcode"

    def _machine_id(self) -> str:
        path = self.state_dir / "machine-identifier"
        try:
            return path.read_text().strip()
        except OSError:
            value = secrets.token_hex(20)
            path.write_text(value + "\n")
            return value

    def wanted(self) -> int:
        try:
            return parse_transcode_flag(self.flag_path.read_text())
        except (OSError, ValueError):
            return 0

    def set_wanted(self, count: int) -> None:
        tmp = self.flag_path.with_name(".transcode.tmp")
        tmp.write_text(f"{count}\n")
        os.replace(tmp, self.flag_path)
        self.reconcile()

    def running(self) -> int:
        with self.lock:
            return len(self.clients)

    def reconcile(self) -> None:
        """Start or stop simulated transcoders until their number matches the flag."""
        wanted = self.wanted()
        with self.lock:
            while len(self.clients) < wanted:
                client = self.factory(len(self.clients))
                client.register(vram=self.vram)
                client.set_busy({"vcs": 1.0, "vecs": 0.5})
                self.clients.append(client)
            while len(self.clients) > wanted:
                self.clients.pop().close()

    def start(self) -> None:
        self.reconcile()
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        with self.lock:
            clients, self.clients = self.clients, []
        for client in clients:
            client.close(self.release)

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            self.reconcile()


class PlexHandler(Handler):
    server: PlexServer

    @property
    def state(self) -> PlexState:
        return self.server.state

    def _xml(self, text: str) -> None:
        self.send_bytes(200, text.encode(), "text/xml;charset=utf-8")

    def _authorised(self) -> bool:
        token = self.state.token
        given = self.headers.get("X-Plex-Token") or self.query.get("X-Plex-Token")
        return token is None or given == token

    def do_GET(self) -> None:
        path = self.path_only
        if path == "/identity":
            self._xml(identity_xml(self.state.machine_id, self.state.claimed))
        elif path == "/status/sessions":
            if not self._authorised():
                self.send_bytes(401, UNAUTHORIZED, "text/html")
                return
            self._xml(sessions_xml(self.state.running(), self.state.machine_id))
        elif path == "/:/cardshare-sim/transcode":
            self.send_json(200, {"simulation": True, "transcodes": self.state.running()})
        else:
            self.send_bytes(404, b"<html><body><h1>404 Not Found</h1></body></html>", "text/html")

    def do_POST(self) -> None:
        if self.path_only != "/:/cardshare-sim/transcode":
            self.send_bytes(404, b"<html><body><h1>404 Not Found</h1></body></html>", "text/html")
            return
        self.read_body()
        query = self.query
        try:
            count = parse_transcode_flag(query.get("count") or query.get("state", ""))
        except ValueError as exc:
            self.send_json(400, {"simulation": True, "error": str(exc)})
            return
        self.state.set_wanted(count)
        self.send_json(200, {"simulation": True, "transcodes": self.state.running()})


class PlexServer(StandinServer):
    def __init__(self, address: tuple[str, int], state: PlexState) -> None:
        self.state = state
        super().__init__(address, PlexHandler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plex_standin", description="SIMULATION of Plex")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=32400)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print("SIMULATION: cardshare lab stand-in for Plex Media Server", flush=True)
    state_dir = Path(os.environ.get("PLEX_SIM_STATE_DIR", "/config/cardshare-sim"))
    state = PlexState(state_dir, os.environ)
    server = PlexServer((args.host, args.port), state)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    state.start()
    serve_in_thread(server)
    print(
        f"SIMULATION: listening on {args.host}:{args.port} (claimed={int(state.claimed)})",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        state.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
