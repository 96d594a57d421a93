"""``python -m cardshare.proxy --config FILE``: run the patient proxy until SIGTERM or SIGINT.

The proxy runs on uvloop's event loop when uvloop is installed (pyproject's ``fast`` extra;
the arbiter image does not carry it yet), else on asyncio's own; it logs which at start.
uvloop takes about a quarter off the proxy's own CPU per request under load
(``benchmarks/proxy``); nothing else depends on it.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from cardshare.proxy.config import (
    ConfigError,
    ProxyConfig,
    argument_parser,
    config_from_args,
)
from cardshare.proxy.keys import KeysFileError
from cardshare.proxy.server import Proxy


def loop_factory(use_uvloop: bool = True) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """The event loop to run on and its name: uvloop's when installed (and wanted)."""
    if use_uvloop:
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError:
            pass
        else:
            factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
            return factory, f"uvloop {uvloop.__version__}"
    return asyncio.new_event_loop, "asyncio"


def run(config: ProxyConfig, proxy: Proxy, use_uvloop: bool = True) -> None:
    """Serve on the event loop of :func:`loop_factory` until SIGTERM or SIGINT."""
    factory, name = loop_factory(use_uvloop)
    logging.getLogger("cardshare.proxy").info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(config, proxy))


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
    run(config, proxy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
