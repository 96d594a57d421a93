"""``python -m cardshare.arbiter --config FILE``: run the arbiter and its HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import RecorderFileSource
from cardshare.arbiter.config import Config, ConfigError, load_config
from cardshare.arbiter.edges import (
    DockerContainers,
    HttpComfy,
    HttpLlm,
    HttpProxy,
    HttpYielding,
)
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.store import Store, StoreError
from cardshare.docker_api import DockerClient
from cardshare.serverguard import guarded_runner

DB_NAME = "arbiter.sqlite3"


def read_token(config: Config) -> str:
    try:
        with open(config.token_file, encoding="utf-8") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"config key 'token_file' has value {str(config.token_file)!r}: cannot read it "
            f"({exc.strerror}); create it with a random token, mode 0600"
        ) from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"config key 'token_file' has value {str(config.token_file)!r}: the file has mode "
            f"{stat.S_IMODE(mode):04o}, readable by others than its owner; "
            f"chmod 600 {config.token_file}"
        )
    if len(token) < 16:
        raise ConfigError(
            f"config key 'token_file' has value {str(config.token_file)!r}: the token is "
            "shorter than 16 characters; write a longer random token"
        )
    return token


async def serve(config: Config, token: str) -> int:
    """Run until SIGTERM/SIGINT (0), or until the engine's loop ends by itself (1: the
    container restarts and resumes from the database)."""
    store = Store(config.data_dir / DB_NAME)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        engine = Engine(
            config=config,
            store=store,
            containers=DockerContainers(
                DockerClient(config.docker_socket),
                {"llm": config.llm_container, "image": config.image_container},
            ),
            llm=HttpLlm(session, config),
            comfy=HttpComfy(session, config),
            card=RecorderFileSource(
                config.card_current_json,
                config.card_scan_argv,
                recorder_path=config.recorder_current_json,
                pdev=config.pool,
            ),
            proxy=HttpProxy(session, config.proxy_url, config.http_timeout_seconds)
            if config.proxy_url
            else None,
            yielding=HttpYielding(
                session, {t.name: (t.url, t.ack_seconds) for t in config.yielding_tenants}
            )
            if config.yielding_tenants
            else None,
        )
        runner = guarded_runner(
            build_app(engine, token),
            header_timeout=config.header_timeout_seconds,
            body_timeout=config.body_timeout_seconds,
            keepalive_timeout=config.keepalive_timeout_seconds,
        )
        await runner.setup()
        site = web.TCPSite(runner, config.listen_host, config.listen_port)
        await site.start()
        logging.getLogger("cardshare.arbiter").info(
            "listening on %s:%d in mode %s", config.listen_host, config.listen_port, engine.mode
        )
        task = asyncio.ensure_future(engine.run(stop))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if task.done() and not stop.is_set():
            exc = task.exception()
            logging.getLogger("cardshare.arbiter").critical(
                "the engine's loop ended: %s; exiting so the container restarts",
                "without an error" if exc is None else f"{type(exc).__name__}: {exc}",
                exc_info=exc,
            )
            status = 1
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
    store.close()
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cardshare.arbiter")
    parser.add_argument("--config", required=True, type=Path, help="the arbiter's JSON config")
    parser.add_argument(
        "--check", action="store_true", help="check the config (not the token file), then exit"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        if args.check:
            print(f"cardshare.arbiter: {args.config} is valid", flush=True)
            return 0
        token = read_token(config)
    except ConfigError as exc:
        print(f"cardshare.arbiter: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(config, token))
    except StoreError as exc:
        print(f"cardshare.arbiter: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
