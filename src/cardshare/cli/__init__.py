"""``cardshare``: the host's command line, one module per command family.

- :mod:`cardshare.cli.recorder`: ``cardshare scan``, ``clients``, ``report``;
- :mod:`cardshare.cli.arbiter`: ``cardshare status`` and ``cardshare job``, the arbiter's API;
- :mod:`cardshare.cli.bench`: ``cardshare bench retrieval``;
- :mod:`cardshare.cli.campaign`: ``cardshare campaign status``;
- :mod:`cardshare.cli.ratchet`: ``cardshare ratchet``, the retrieval tier's watchdog;
- :mod:`cardshare.cli.common`: what they share;
- :mod:`cardshare.proxy.keytool`: ``cardshare proxy key``, the patient proxy's API keys.

Exit codes: 0 ok, 1 runtime error (one line on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cardshare.cli import arbiter, bench, campaign, ratchet, recorder
from cardshare.cli.arbiter import ArbiterError
from cardshare.cli.campaign import CampaignError
from cardshare.cli.common import UsageError
from cardshare.naming import NamingError
from cardshare.proxy import keytool as proxy_keytool
from cardshare.recorder import OutputError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cardshare",
        description="Who is on the GPU: DRM fdinfo recorder; the card arbiter's status and jobs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    recorder.add_parsers(sub)
    arbiter.add_parsers(sub)
    bench.add_parsers(sub)
    campaign.add_parsers(sub)
    ratchet.add_parsers(sub)
    proxy_keytool.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse usage errors give 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "proxy":
        return proxy_keytool.run(args, sys.stdout)
    commands = recorder.COMMANDS | arbiter.COMMANDS | ratchet.COMMANDS
    command = commands.get(args.command)
    if command is None:
        if args.command == "campaign":
            command = campaign.COMMANDS[args.campaign_command]
        elif args.command == "bench":
            command = bench.COMMANDS[args.bench_command]
        else:
            command = arbiter.JOB_COMMANDS[args.job_command]
    try:
        return command(args, sys.stdout)
    except UsageError as exc:
        print(f"cardshare: error: {exc}", file=sys.stderr)
        return 2
    except (OutputError, NamingError, ArbiterError, CampaignError) as exc:
        print(f"cardshare: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(f"cardshare: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
