"""The recorder's commands.

``cardshare scan``
    one scan with all outputs (what the systemd timer runs once a minute).
``cardshare clients``
    who is on each card now.  Without ``--data-dir`` it scans twice, ``--interval`` seconds
    apart (2 by default), and shows the busy shares between the two samples; it writes
    nothing.  With ``--data-dir`` it reads the recorder's ``current.json`` instead (no
    fdinfo read, no GPU wake-up).  An engine share that cannot be computed yet (no earlier
    sample of that client) shows as ``?``, and a legend under the table says so.
``cardshare report --month YYYY-MM``
    per client: minutes active per engine class, peak and mean VRAM over a month of history.

Container sockets given with ``--docker-socket`` and ``--podman-socket`` are used as given;
the per-user (rootless) sockets and the kubelet's files that name Kubernetes containers are
looked up under ``--root``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any, TextIO

from cardshare.campaign.summary import DATABASE as CAMPAIGN_DATABASE
from cardshare.campaign.summary import (
    CampaignSummaryError,
    format_campaign_line,
    read_campaign_month,
)
from cardshare.cli import common
from cardshare.naming import (
    DEFAULT_RULES,
    CommandRule,
    EngineApiResolver,
    Resolver,
    default_sockets,
    read_rules_file,
)
from cardshare.recorder import CURRENT, HISTORY, ScanConfig, load_snapshot, run_scan
from cardshare.recorder import sample as take_sample
from cardshare.recorder.report import build_report, format_report, read_month

DEFAULT_DATA_DIR = "/var/lib/cardshare"
# the transcode_campaign role's default transcode_campaign_data_dir
DEFAULT_CAMPAIGN_DB = Path("/var/lib/cardshare/campaign") / CAMPAIGN_DATABASE
DEFAULT_PODMAN_SOCKET = "/run/podman/podman.sock"
_MONTH_RE = re.compile(r"^([0-9]{4})-(0[1-9]|1[0-2])$")


def _month(text: str) -> str:
    if _MONTH_RE.match(text) is None:
        raise argparse.ArgumentTypeError(f"expected YYYY-MM, got {text!r}")
    return text


def _naming_options() -> argparse.ArgumentParser:
    """The parent of the commands that name clients: ``--root``, the rules and the sockets."""
    parser = argparse.ArgumentParser(add_help=False, parents=[common.root_option()])
    parser.add_argument(
        "--rules",
        type=Path,
        help="JSON list of command rules [{pattern, name, match}] replacing the default "
        "(every 'Plex Transcoder' process is 'plex')",
    )
    parser.add_argument(
        "--docker-socket",
        default=common.DEFAULT_DOCKER_SOCKET,
        help="Docker Engine API socket for container names ('' disables)",
    )
    parser.add_argument(
        "--podman-socket",
        default=DEFAULT_PODMAN_SOCKET,
        help="Podman API socket for container names ('' disables)",
    )
    return parser


def add_parsers(sub: Any) -> None:
    naming = [_naming_options()]
    scan = sub.add_parser(
        "scan", help="scan once and write the snapshot, history, textfile", parents=naming
    )
    scan.add_argument("--data-dir", type=Path, default=Path(DEFAULT_DATA_DIR))
    scan.add_argument("--textfile", type=Path, help="Prometheus textfile to write (atomic)")
    scan.add_argument(
        "--retention-months",
        type=common.non_negative_int,
        default=12,
        help="months of history to keep, this one included; 0 keeps all (default 12)",
    )
    scan.add_argument("--quiet", action="store_true", help="print nothing on success")

    clients = sub.add_parser("clients", help="who is on each card now", parents=naming)
    clients.add_argument(
        "--data-dir", type=Path, help="read current.json from here instead of scanning"
    )
    clients.add_argument(
        "--interval",
        type=common.positive_float,
        default=2.0,
        help="seconds between the two samples (default 2)",
    )
    clients.add_argument("--json", action="store_true", help="print the snapshot as JSON")

    report = sub.add_parser("report", help="a month of history per client")
    report.add_argument("--month", type=_month, required=True, help="YYYY-MM")
    report.add_argument("--data-dir", type=Path, default=Path(DEFAULT_DATA_DIR))
    report.add_argument(
        "--max-interval",
        type=common.positive_float,
        default=120.0,
        help="longest interval one scan may stand for, in seconds (default 120)",
    )
    report.add_argument(
        "--campaign-db",
        type=Path,
        default=DEFAULT_CAMPAIGN_DB,
        help="the re-encode campaign's database, for its line (default %(default)s; "
        "no line when it does not exist)",
    )
    report.add_argument("--json", action="store_true", help="print the report as JSON")


def _rules(path: Path | None) -> tuple[CommandRule, ...]:
    return DEFAULT_RULES if path is None else read_rules_file(path)


def _resolver_factory(args: argparse.Namespace) -> Resolver:
    return EngineApiResolver(
        default_sockets(args.docker_socket, args.podman_socket, root=str(args.root)),
        root=str(args.root),
    )


# Printed under the table when an engine's busy share is unknown (None in the snapshot).
ENGINES_UNKNOWN_LEGEND = (
    "ENGINES ? = no busy share yet: no earlier sample of this client to compare with (a new or "
    "restarted client, the first scan after a boot) or no time counted since it; the next scan "
    "compares with this one"
)


def format_clients(snapshot: dict[str, Any]) -> str:
    """A plain-text table of who is on each card, with a legend when a share is unknown."""
    lines = [f"scan {snapshot.get('timestamp')} on {snapshot.get('host')}"]
    unknown_share = False
    cards = snapshot.get("cards", {})
    if not cards:
        lines.append("no DRM cards or clients found")
    for pdev, card in cards.items():
        lines.append(
            f"card {pdev} ({card.get('driver') or '?'}): VRAM used "
            f"{common.gib(card.get('vram_used_bytes'))} of "
            f"{common.gib(card.get('vram_total_bytes'))}"
        )
        if not card["clients"]:
            lines.append("  no clients")
            continue
        rows = [("CLIENT", "VRAM", "GTT", "SYSTEM", "ENGINES", "PIDS")]
        for c in card["clients"]:
            unknown_share = unknown_share or None in c["engines"].values()
            engines = " ".join(
                f"{k}={'?' if v is None else f'{v * 100:.0f}%'}" for k, v in c["engines"].items()
            )
            rows.append(
                (
                    c["name"],
                    common.gib(c["vram_bytes"]),
                    common.gib(c["gtt_bytes"]),
                    common.gib(c["system_bytes"]),
                    engines or "-",
                    ",".join(str(p) for p in c["pids"]),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.extend(
            "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        )
    if unknown_share:
        lines.append(ENGINES_UNKNOWN_LEGEND)
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
    # the campaign's month beside the card's: what its time on the card won back
    campaign: dict[str, Any] | None
    try:
        summary = read_campaign_month(args.campaign_db, args.month)
        campaign = summary.as_dict() if summary else None
        line = format_campaign_line(summary) if summary else None
    except CampaignSummaryError as exc:
        campaign = {"error": str(exc)}
        line = f"re-encode campaign: its database cannot be read ({exc})"
    if args.json:
        out.write(
            json.dumps(report.as_dict() | {"campaign": campaign}, indent=2, sort_keys=True) + "\n"
        )
    else:
        out.write(format_report(report) + (line + "\n" if line else ""))
    return 0


COMMANDS = {"scan": _cmd_scan, "clients": _cmd_clients, "report": _cmd_report}
