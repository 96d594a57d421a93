"""``cardshare bench retrieval``: its options and their defaults; the benchmark, what it sends,
measures and records, is :mod:`cardshare.retrieval.bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from cardshare.cli.common import non_negative_int, ovms_url, positive_float, positive_int

BENCH_TIMEOUT_SECONDS = 60.0
BENCH_SCENARIOS = ("rerank", "embed-single", "embed-batch")


def add_parsers(sub: Any) -> None:
    # the defaults are the seed's runs: 20 candidates, batches of 32, 3 warm-up and 30 timed
    # calls; a short passage, one client
    bench = sub.add_parser("bench", help="benchmarks: retrieval (OpenVINO Model Server)")
    verbs = bench.add_subparsers(dest="bench_command", required=True, metavar="VERB")
    retrieval = verbs.add_parser(
        "retrieval",
        help="rerank and embeddings latency and throughput, in a record that carries its evidence",
        description="Warm-up and timed requests to OpenVINO Model Server's /v3/rerank and "
        "/v3/embeddings (one text, and batches); p50/p95 and items/s in a JSON record with the "
        "base URL, the UTC time, the /v1/config snapshot, the payload shape, the concurrency and "
        "the arm checked where it can be.",
    )
    retrieval.add_argument(
        "--base-url",
        type=ovms_url,
        required=True,
        metavar="URL",
        help="the server's REST address, e.g. http://127.0.0.1:8000 (no default: it changes "
        "together with --arm)",
    )
    retrieval.add_argument(
        "--arm",
        choices=("gpu", "cpu"),
        required=True,
        help="the device you believe serves the models; checked where it can be",
    )
    retrieval.add_argument(
        "--repository",
        type=Path,
        metavar="DIR",
        help="the exported model repository the server serves (its config.json): each graph's "
        "target_device is compared with --arm",
    )
    retrieval.add_argument(
        "--rerank-model",
        default="bge-reranker-v2-m3",
        metavar="NAME",
        help="the rerank servable (default %(default)s)",
    )
    retrieval.add_argument(
        "--embeddings-model",
        default="bge-m3",
        metavar="NAME",
        help="the embeddings servable (default %(default)s)",
    )
    retrieval.add_argument(
        "--documents",
        type=positive_int,
        default=20,
        metavar="N",
        help="rerank candidates per request (default %(default)s)",
    )
    retrieval.add_argument(
        "--tokens-per-document",
        type=positive_int,
        default=64,
        metavar="T",
        help="approximate tokens in each document and embedding input, as words "
        "(default %(default)s)",
    )
    retrieval.add_argument(
        "--batch",
        type=positive_int,
        default=32,
        metavar="B",
        help="embedding inputs per batched request (default %(default)s)",
    )
    retrieval.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        metavar="C",
        help="client threads sending at once (default %(default)s)",
    )
    retrieval.add_argument(
        "--warmup",
        type=non_negative_int,
        default=3,
        metavar="W",
        help="untimed requests before each scenario (default %(default)s)",
    )
    retrieval.add_argument(
        "--iterations",
        type=positive_int,
        default=30,
        metavar="I",
        help="timed requests per scenario (default %(default)s)",
    )
    retrieval.add_argument(
        "--timeout",
        type=positive_float,
        default=BENCH_TIMEOUT_SECONDS,
        metavar="S",
        help=f"seconds a request may wait for the server (default {BENCH_TIMEOUT_SECONDS:g})",
    )
    retrieval.add_argument(
        "--scenario",
        action="append",
        choices=BENCH_SCENARIOS,
        metavar="NAME",
        help=f"run only these ({', '.join(BENCH_SCENARIOS)}; repeatable; default all)",
    )
    retrieval.add_argument(
        "--out", type=Path, metavar="FILE", help="write the JSON here (atomically), not stdout"
    )
    retrieval.add_argument(
        "--table",
        action="store_true",
        help="print the table on stdout instead of the JSON (which still goes to --out)",
    )


def _cmd_bench_retrieval(args: argparse.Namespace, out: TextIO) -> int:
    # imported here: only this command needs it
    from cardshare.retrieval import bench, record

    scenarios = tuple(dict.fromkeys(args.scenario or BENCH_SCENARIOS))
    options = bench.BenchOptions(
        base_url=args.base_url,
        arm=args.arm,
        repository=args.repository,
        rerank_model=args.rerank_model,
        embeddings_model=args.embeddings_model,
        payload=record.PayloadShape(
            documents=args.documents,
            tokens_per_document=args.tokens_per_document,
            batch=args.batch,
        ),
        concurrency=args.concurrency,
        warmup=args.warmup,
        iterations=args.iterations,
        timeout=args.timeout,
        scenarios=scenarios,
    )
    try:
        report = bench.run(options, progress=sys.stderr)
    except record.BenchError as exc:
        print(f"cardshare: error: {exc}", file=sys.stderr)
        return 1
    return bench.emit(report, out=out, err=sys.stderr, out_file=args.out, table=args.table)


COMMANDS = {"retrieval": _cmd_bench_retrieval}
