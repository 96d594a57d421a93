"""``python -m cardshare.proxy --config FILE``: run the patient proxy until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from cardshare.proxy.config import (
    ConfigError,
    ProxyConfig,
    argument_parser,
    config_from_args,
)
from cardshare.proxy.keys import KeysFileError
from cardshare.proxy.server import Proxy


async def serve(config: ProxyConfig, proxy: Proxy) -> None:
    """Serve until SIGTERM or SIGINT."""
    runner = proxy.make_runner()
    await runner.setup()
    site = web.TCPSite(runner, config.listen_host, config.listen_port, backlog=1024)
    await site.start()
    logging.getLogger("cardshare.proxy").info(
        "listening on %s:%d, upstream %s, arbiter %s, %s",
        config.listen_host,
        config.listen_port,
        config.upstream_url,
        config.arbiter_url,
        "no API keys (loopback)"
        if proxy.keyring is None
        else f"{len(proxy.keyring.keys)} API keys from {config.keys_file}",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for a bad configuration)."""
    args = argument_parser().parse_args(argv)
    try:
        config, log_level = config_from_args(args)
    except ConfigError as exc:
        print(f"cardshare.proxy: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print("cardshare.proxy: the settings are valid", flush=True)
        return 0
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        proxy = Proxy(config)
    except KeysFileError as exc:
        print(f"cardshare.proxy: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, proxy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
