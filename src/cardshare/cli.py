"""``cardshare``: the recorder's command line.

``cardshare scan``
    one scan with all outputs (what the systemd timer runs once a minute).
``cardshare clients``
    who is on each card now.  Without ``--data-dir`` it scans twice, ``--interval`` seconds
    apart (2 by default), and shows the busy shares between the two samples; it writes
    nothing.  With ``--data-dir`` it reads the recorder's ``current.json`` instead (no
    fdinfo read, no GPU wake-up).
``cardshare report --month YYYY-MM``
    per client: minutes active per engine class, peak and mean VRAM over a month of history.

Container sockets given with ``--docker-socket`` and ``--podman-socket`` are used as given;
the per-user (rootless) sockets and the kubelet's files that name Kubernetes containers are
looked up under ``--root``.  Exit codes: 0 ok, 1 runtime error (one line on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from cardshare.naming import (
    DEFAULT_RULES,
    CommandRule,
    EngineApiResolver,
    NamingError,
    Resolver,
    default_sockets,
    read_rules_file,
)
from cardshare.recorder import CURRENT, HISTORY, OutputError, ScanConfig, load_snapshot, run_scan
from cardshare.recorder import sample as take_sample
from cardshare.recorder.report import build_report, format_report, read_month

__all__ = ["main"]

DEFAULT_DATA_DIR = "/var/lib/cardshare"
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"
DEFAULT_PODMAN_SOCKET = "/run/podman/podman.sock"
_MONTH_RE = re.compile(r"^([0-9]{4})-(0[1-9]|1[0-2])$")


def _month(text: str) -> str:
    if _MONTH_RE.match(text) is None:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM, got {text!r}")
    return text


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value


def _add_naming(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rules",
        type=Path,
        help="JSON list of command rules [{pattern, name, match}] replacing the default "
        "(every 'Plex Transcoder' process is 'plex')",
    )
    parser.add_argument(
        "--docker-socket",
        default=DEFAULT_DOCKER_SOCKET,
        help="Docker Engine API socket for container names ('' disables)",
    )
    parser.add_argument(
        "--podman-socket",
        default=DEFAULT_PODMAN_SOCKET,
        help="Podman API socket for container names ('' disables)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cardshare", description="Who is on the GPU: DRM fdinfo recorder."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    scan = sub.add_parser("scan", help="scan once and write the snapshot, history, textfile")
    scan.add_argument("--root", default="/", help="root prefix of /proc and /sys (default /)")
    scan.add_argument("--data-dir", type=Path, default=Path(DEFAULT_DATA_DIR))
    scan.add_argument("--textfile", type=Path, help="Prometheus textfile to write (atomic)")
    scan.add_argument(
        "--retention-months",
        type=_non_negative_int,
        default=12,
        help="months of history to keep, this one included; 0 keeps all (default 12)",
    )
    scan.add_argument("--quiet", action="store_true", help="print nothing on success")
    _add_naming(scan)

    clients = sub.add_parser("clients", help="who is on each card now")
    clients.add_argument("--root", default="/", help="root prefix of /proc and /sys")
    clients.add_argument(
        "--data-dir", type=Path, help="read current.json from here instead of scanning"
    )
    clients.add_argument(
        "--interval",
        type=_positive_float,
        default=2.0,
        help="seconds between the two samples (default 2)",
    )
    clients.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    _add_naming(clients)

    report = sub.add_parser("report", help="a month of history per client")
    report.add_argument("--month", type=_month, required=True, help="YYYY-MM")
    report.add_argument("--data-dir", type=Path, default=Path(DEFAULT_DATA_DIR))
    report.add_argument(
        "--max-interval",
        type=_positive_float,
        default=120.0,
        help="longest interval one scan may stand for, in seconds (default 120)",
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _rules(path: Path | None) -> tuple[CommandRule, ...]:
    return DEFAULT_RULES if path is None else read_rules_file(path)


def _resolver_factory(args: argparse.Namespace) -> Resolver:
    return EngineApiResolver(
        default_sockets(args.docker_socket, args.podman_socket, root=str(args.root)),
        root=str(args.root),
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.2f} GiB"


def format_clients(snapshot: dict[str, Any]) -> str:
    """A plain-text table of who is on each card."""
    lines = [f"scan {snapshot.get('timestamp')} on {snapshot.get('host')}"]
    cards = snapshot.get("cards", {})
    if not cards:
        lines.append("no DRM cards or clients found")
    for pdev, card in cards.items():
        lines.append(
            f"card {pdev} ({card.get('driver') or '?'}): VRAM used "
            f"{_gib(card.get('vram_used_bytes'))} of {_gib(card.get('vram_total_bytes'))}"
        )
        if not card["clients"]:
            lines.append("  no clients")
            continue
        rows = [("CLIENT", "VRAM", "GTT", "SYSTEM", "ENGINES", "PIDS")]
        for c in card["clients"]:
            engines = " ".join(
                f"{k}={'?' if v is None else f'{v * 100:.0f}%'}" for k, v in c["engines"].items()
            )
            rows.append(
                (
                    c["name"],
                    _gib(c["vram_bytes"]),
                    _gib(c["gtt_bytes"]),
                    _gib(c["system_bytes"]),
                    engines or "-",
                    ",".join(str(p) for p in c["pids"]),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.extend(
            "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        )
    return "\n".join(lines) + "\n"


def _cmd_scan(args: argparse.Namespace, out: TextIO) -> int:
    config = ScanConfig(
        root=args.root,
        data_dir=args.data_dir,
        textfile=args.textfile,
        retention_months=args.retention_months,
        rules=_rules(args.rules),
        resolver_factory=lambda: _resolver_factory(args),
    )
    snapshot = run_scan(config)
    if not args.quiet:
        clients = sum(len(c["clients"]) for c in snapshot["cards"].values())
        out.write(
            f"{clients} clients on {len(snapshot['cards'])} cards; "
            f"wrote {args.data_dir / CURRENT}\n"
        )
    return 0


def _cmd_clients(args: argparse.Namespace, out: TextIO) -> int:
    if args.data_dir is not None:
        snapshot = load_snapshot(args.data_dir / CURRENT)
    else:
        rules = _rules(args.rules)
        resolver = _resolver_factory(args)
        _, state = take_sample(args.root, rules, resolver, None)
        time.sleep(args.interval)
        snapshot, _ = take_sample(args.root, rules, resolver, state)
    if args.json:
        out.write(json.dumps(snapshot, indent=2, sort_keys=True) + "\n")
    else:
        out.write(format_clients(snapshot))
    return 0


def _cmd_report(args: argparse.Namespace, out: TextIO) -> int:
    # a closed month is gzipped by the first scan of the next one: both files are read
    snapshots, bad = read_month(args.data_dir / HISTORY, args.month)
    report = build_report(args.month, snapshots, bad, args.max_interval)
    if args.json:
        out.write(json.dumps(report.as_dict(), indent=2, sort_keys=True) + "\n")
    else:
        out.write(format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse usage errors give 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    commands = {"scan": _cmd_scan, "clients": _cmd_clients, "report": _cmd_report}
    try:
        return commands[args.command](args, sys.stdout)
    except (OutputError, NamingError) as exc:
        print(f"cardshare: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(f"cardshare: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
