"""``cardshare campaign status``: done, failed with reasons, GB won back, ETA at the recent rate."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, TextIO

from cardshare.campaign.summary import human_bytes

__all__ = ["COMMANDS", "CampaignError", "add_parsers", "format_status"]

DEFAULT_URL = "http://127.0.0.1:8097"


class CampaignError(Exception):
    """The campaign's service cannot be asked, or answered nonsense."""


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def format_status(doc: dict[str, Any], url: str) -> str:
    counts = doc.get("counts") or {}
    enc = doc.get("encoder") or {}
    lines = [
        f"campaign at {url}: {doc.get('phase')}"
        + (f" ({doc['paused_reason']})" if doc.get("paused_reason") else ""),
        f"encoder:    {enc.get('name')}"
        + (
            " (SOFTWARE: it never uses the card)"
            if enc.get("software")
            else f" on {enc.get('device')}"
        ),
    ]
    if doc.get("current"):
        lines.append(f"now:        {doc['current']}")
    lines.append(
        "files:      " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()) if n)
        if any(counts.values())
        else "files:      none found yet"
    )
    lines.append(
        f"won back:   {human_bytes(doc.get('saved_bytes', 0))}; "
        f"originals held {human_bytes(doc.get('held_bytes', 0))}"
    )
    rate, eta = doc.get("rate_bytes_per_second"), doc.get("eta_seconds")
    lines.append(
        f"queued:     {human_bytes(doc.get('queued_bytes', 0))}"
        + (
            f"; about {_duration(eta)} of encoding at the recent {human_bytes(rate * 3600)}/h"
            if rate and eta is not None
            else "; no recent rate for an ETA yet"
        )
    )
    for alert in doc.get("alerts") or []:
        lines.append(f"ALERT {alert['name']}: {alert['message']}")
    failed = doc.get("failed") or []
    if failed:
        lines.append(f"failed ({len(failed)}), originals kept:")
        lines += [f"  {f['path']}: {f['reason']}" for f in failed]
    until = doc.get("arbiter_pause_until")
    if until:
        lines.append(
            f"paused by the arbiter until {time.strftime('%H:%M:%S', time.localtime(until))}"
        )
    return "\n".join(lines) + "\n"


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    import urllib.request  # here: the timer's scan does not need it

    url = args.url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{url}/v1/status", timeout=args.timeout) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise CampaignError(
            f"cannot read the campaign's status at {url}/v1/status: {exc}"
        ) from None
    if not isinstance(doc, dict):
        raise CampaignError(f"the campaign's status is not an object: {doc!r:.80}")
    if args.json:
        out.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        out.write(format_status(doc, url))
    return 0


COMMANDS = {"status": cmd_status}


def add_parsers(sub: Any) -> None:
    campaign = sub.add_parser("campaign", help="the re-encode campaign: status")
    verbs = campaign.add_subparsers(dest="campaign_command", required=True, metavar="VERB")
    status = verbs.add_parser("status", help="done, failed with reasons, GB won back, ETA")
    status.add_argument(
        "--url", default=DEFAULT_URL, help=f"the campaign's address (default {DEFAULT_URL})"
    )
    status.add_argument("--timeout", type=float, default=10.0)
    status.add_argument("--json", action="store_true", help="print the service's JSON document")
