"""``cardshare ratchet``: its options; the watchdog, what it reads, decides and writes, is
:mod:`cardshare.retrieval.ratchet` (a systemd timer runs it once a minute)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from cardshare.cli import common


def add_parsers(sub: Any) -> None:
    ratchet = sub.add_parser(
        "ratchet",
        help="restart OpenVINO Model Server when its resident memory passes a bound, when idle",
        description="One run of the retrieval tier's watchdog: read the server's resident "
        "memory and the requests in flight; over --bound-bytes with nothing in flight, restart "
        "its container; log why, keep counters, write a Prometheus textfile.",
        parents=[common.root_option()],
    )
    ratchet.add_argument("--project", default="retrieval", help="compose project (retrieval)")
    ratchet.add_argument("--service", default="ovms", help="compose service (ovms)")
    ratchet.add_argument(
        "--base-url",
        type=common.ovms_url,
        default="http://127.0.0.1:8000",
        metavar="URL",
        help="the server's REST address, for /metrics (default http://127.0.0.1:8000)",
    )
    ratchet.add_argument(
        "--bound-bytes",
        type=common.positive_int,
        required=True,
        metavar="N",
        help="restart when the resident memory is above N bytes and nothing is in flight",
    )
    ratchet.add_argument(
        "--source",
        choices=("cgroup", "fdinfo"),
        required=True,
        help="cgroup: shmem of the container's cgroup v2 memory.stat (integrated GPU); "
        "fdinfo: resident VRAM of its DRM clients (discrete card)",
    )
    ratchet.add_argument(
        "--state-dir", type=Path, required=True, metavar="DIR", help="where ratchet.json is kept"
    )
    ratchet.add_argument(
        "--textfile", type=Path, required=True, metavar="PATH", help="Prometheus textfile (atomic)"
    )
    ratchet.add_argument(
        "--docker-socket",
        default=common.DEFAULT_DOCKER_SOCKET,
        help=f"Docker Engine API socket (default {common.DEFAULT_DOCKER_SOCKET})",
    )
    ratchet.add_argument(
        "--stop-timeout",
        type=common.non_negative_int,
        default=30,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when restarting (default 30)",
    )
    ratchet.add_argument("--dry-run", action="store_true", help="decide and log, never restart")
    ratchet.add_argument("--json", action="store_true", help="print the run as JSON")


def _cmd_ratchet(args: argparse.Namespace, out: TextIO) -> int:
    # imported here: only this command needs it
    from cardshare.retrieval import inflight, ratchet

    config = ratchet.RatchetConfig(
        bound_bytes=args.bound_bytes,
        source=args.source,
        state_dir=args.state_dir,
        textfile=args.textfile,
        project=args.project,
        service=args.service,
        base_url=args.base_url,
        docker_socket=args.docker_socket,
        root=args.root,
        stop_timeout=args.stop_timeout,
        dry_run=args.dry_run,
        json=args.json,
        metrics_timeout=inflight.METRICS_TIMEOUT_SECONDS,
    )
    return ratchet.run(config, out=out, err=sys.stderr)


COMMANDS = {"ratchet": _cmd_ratchet}
