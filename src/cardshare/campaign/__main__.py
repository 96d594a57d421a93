"""``python -m cardshare.campaign --config FILE``: the campaign service (loop + HTTP side)."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from cardshare.campaign.config import CampaignConfig, ConfigError, load_config
from cardshare.campaign.encode import (
    Encoder,
    EncoderError,
    choose_encoder,
    ffmpeg_encoders,
    vaapi_encode_profiles,
)
from cardshare.campaign.runner import Campaign, CardPlex, Control, PlexSessions
from cardshare.campaign.server import make_server, serve_in_thread
from cardshare.campaign.store import Store

log = logging.getLogger("cardshare.campaign")


def vainfo(device: str) -> str | None:
    try:
        done = subprocess.run(
            ["vainfo", "--display", "drm", "--device", device],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def pick_encoder(config: CampaignConfig) -> Encoder:
    profiles = (
        None
        if config.software_encoder and not config.encoders
        else vaapi_encode_profiles(vainfo(config.device) or "")
    )
    return choose_encoder(
        config.encoders,
        ffmpeg_encoders(config.ffmpeg),
        profiles or None,
        config.device,
        config.quality,
        config.software_encoder,
        config.software_preset,
    )


def plex_source(config: CampaignConfig) -> Callable[[], str | None]:
    sources: list[Callable[[], str | None]] = []
    if config.card_current_json is not None:
        sources.append(
            CardPlex(
                config.card_current_json, config.transcode_client_names, config.card_max_age_seconds
            )
        )
    if config.plex_url and config.plex_token_file:
        sources.append(
            PlexSessions(
                config.plex_url, config.plex_token_file.read_text(encoding="utf-8").strip()
            )
        )

    def busy() -> str | None:
        for source in sources:
            why = source()
            if why:
                return why
        return None

    return busy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cardshare.campaign", description=__doc__)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument(
        "--check", action="store_true", help="check the config and the encoder, then exit"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        encoder = pick_encoder(config)
    except (ConfigError, EncoderError, OSError) as exc:
        print(f"cardshare campaign: {exc}", file=sys.stderr)
        return 2
    label = (
        " (SOFTWARE encoding: it never uses the card)"
        if encoder.software
        else f" on {encoder.device}"
    )
    print(f"cardshare campaign: encoder {encoder.name}{label}", flush=True)
    if args.check:
        return 0
    config.state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db_path)
    campaign = Campaign(config, store, encoder, plex_source(config), Control())
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = make_server(campaign, config.listen_host, config.listen_port)
    serve_in_thread(server)
    try:
        campaign.run(stop)
    finally:
        server.shutdown()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
