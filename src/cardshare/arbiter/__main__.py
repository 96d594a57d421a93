"""``python -m cardshare.arbiter --config FILE``: run the arbiter and its HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from cardshare.arbiter.api import build_app
from cardshare.arbiter.cardview import RecorderFileSource
from cardshare.arbiter.config import Config, ConfigError, load_config
from cardshare.arbiter.edges import DockerContainers, HttpComfy, HttpLlm, HttpProxy
from cardshare.arbiter.engine import Engine
from cardshare.arbiter.store import Store
from cardshare.docker_api import DockerClient

DB_NAME = "arbiter.sqlite3"


def read_token(config: Config) -> str:
    try:
        token = config.token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"config key 'token_file' has value {str(config.token_file)!r}: cannot read it "
            f"({exc.strerror}); create it with a random token, mode 0600"
        ) from exc
    if len(token) < 16:
        raise ConfigError(
            f"config key 'token_file' has value {str(config.token_file)!r}: the token is "
            "shorter than 16 characters; write a longer random token"
        )
    return token


async def serve(config: Config, token: str) -> None:
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
            card=RecorderFileSource(config.card_current_json, config.card_scan_argv),
            proxy=HttpProxy(session, config.proxy_url, config.http_timeout_seconds)
            if config.proxy_url
            else None,
        )
        runner = web.AppRunner(build_app(engine, token))
        await runner.setup()
        site = web.TCPSite(runner, config.listen_host, config.listen_port)
        await site.start()
        logging.getLogger("cardshare.arbiter").info(
            "listening on %s:%d in mode %s", config.listen_host, config.listen_port, engine.mode
        )
        task = asyncio.ensure_future(engine.run(stop))
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.cleanup()
    store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cardshare.arbiter")
    parser.add_argument("--config", required=True, type=Path, help="the arbiter's JSON config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        token = read_token(config)
    except ConfigError as exc:
        print(f"cardshare.arbiter: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
