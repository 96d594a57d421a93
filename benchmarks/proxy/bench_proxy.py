"""Benchmark: the patient proxy against a direct connection to a vLLM-like upstream.

One run measures, side by side, clients talking straight to the upstream and through
``cardshare.proxy`` at 1, 16 and 64 concurrent clients, streaming and not: throughput (req/s),
median and p95 latency, the proxy/direct ratio and the added median latency.

The upstream is a small aiohttp server defined here (not the real vLLM, not the lab stand-in)
so that runs are repeatable. Like a GPU, it spends no host CPU while "generating": a
non-streaming answer comes after ``--delay-ms`` (100 ms, far quicker than a real completion),
a streamed one as ``--chunks`` SSE chunks paced every ``--chunk-interval-ms`` (20 ms, i.e.
50 tokens/s a stream, 3200/s for 64 streams). A last "raw" section has the upstream answer at
once: what remains is the proxy's own cost and this machine's CPU ceiling. Upstream, proxy and
load generator run in separate processes so the load does not share the proxy's event loop.

Goals (issue 5): at least 0.9x direct throughput at 64 clients; under 1 ms added median
latency without streaming. The default run takes about 55 s.

A second proxy process takes API keys (issue 33; a key file of 17 keys, the clients send the
key as ``Authorization: Bearer``): its 1-client plain and raw cells, beside the keyless proxy's,
show what the key check adds to the median (``--no-keys`` leaves it out).

    python benchmarks/proxy/bench_proxy.py [--seconds 1] [--rounds 2] [--delay-ms 100] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import aiohttp
from aiohttp import web

from cardshare.proxy.keys import key_line

#: The agent's key of the keyed proxy (its hash is in a temporary key file with 16 others).
BENCH_KEY = "csk-" + "b" * 43

REQUEST = {
    "model": "bench-model",
    "messages": [
        {"role": "system", "content": "You are a helpful agent. " * 8},
        {"role": "user", "content": "Summarise the last build log in two sentences. " * 4},
    ],
    "max_tokens": 64,
}


def completion_body(text_len: int) -> bytes:
    doc = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * text_len},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 120, "completion_tokens": 64, "total_tokens": 184},
    }
    return json.dumps(doc).encode()


def sse_chunk() -> bytes:
    doc = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
    }
    return f"data: {json.dumps(doc)}\n\n".encode()


@dataclass(frozen=True)
class Shape:
    """What the upstream does per request."""

    delay_ms: float
    response_text: int
    chunks: int
    chunk_interval_ms: float


# --------------------------------------------------------------------------- upstream process


def run_upstream(port: int, shape: Shape) -> None:
    body = completion_body(shape.response_text)
    one_chunk = sse_chunk()

    async def chat(request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        paced = doc.get("bench_paced", True)
        if not doc.get("stream"):
            if paced and shape.delay_ms:
                await asyncio.sleep(shape.delay_ms / 1000)
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in range(shape.chunks):
            if paced and shape.chunk_interval_ms:
                # paced on absolute times, like a GPU: host scheduling jitter does not add up
                due = start + (n + 1) * shape.chunk_interval_ms / 1000
                await asyncio.sleep(max(0.0, due - loop.time()))
            await resp.write(one_chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def mode(request: web.Request) -> web.Response:
        return web.json_response({"mode": "llm", "since": 0})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/mode", mode)
    # a cell's end cuts streams mid-answer; the upstream's tracebacks about it are noise here
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=1024)


# --------------------------------------------------------------------------- proxy process


def run_proxy(port: int, upstream_port: int, keys_file: str = "") -> None:
    from cardshare.proxy.__main__ import serve
    from cardshare.proxy.config import build_config
    from cardshare.proxy.server import Proxy

    config = build_config(
        {
            "listen_port": port,
            "upstream_url": f"http://127.0.0.1:{upstream_port}",
            # the upstream also answers /v1/mode with llm: the proxy polls it as its arbiter
            "arbiter_url": f"http://127.0.0.1:{upstream_port}",
            "keys_file": keys_file,
        }
    )
    asyncio.run(serve(config, Proxy(config)))


# --------------------------------------------------------------------------- load process


@dataclass(frozen=True)
class Cell:
    target: str
    url: str
    concurrency: int
    stream: bool
    #: False: the upstream answers at once (the proxy's raw cost and this machine's ceiling)
    paced: bool = True


async def one_cell(cell: Cell, seconds: float, warmup: float) -> dict[str, Any]:
    payload = json.dumps({**REQUEST, "stream": cell.stream, "bench_paced": cell.paced}).encode()
    # every target gets the same headers: the key is checked by "proxy+keys" only
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}
    latencies: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=cell.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = loop.time()
        measure_from = start + warmup
        end = measure_from + seconds

        async def worker(offset: float) -> None:
            nonlocal errors
            # staggered starts: completions spread evenly over the window, not in lockstep
            await asyncio.sleep(offset)
            while True:
                t0 = loop.time()
                try:
                    async with session.post(cell.url, data=payload, headers=headers) as resp:
                        if cell.stream:
                            async for _ in resp.content.iter_any():
                                pass
                        else:
                            await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                t1 = loop.time()
                # a request counts when it completes inside the measured window
                if measure_from <= t1 <= end:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        workers = [
            asyncio.ensure_future(worker(warmup * n / cell.concurrency))
            for n in range(cell.concurrency)
        ]
        await asyncio.sleep(end - loop.time())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    latencies.sort()
    n = len(latencies)
    return {
        "target": cell.target,
        "paced": cell.paced,
        "concurrency": cell.concurrency,
        "stream": cell.stream,
        "requests": n,
        "errors": errors,
        "rps": n / seconds,
        "p50_ms": statistics.median(latencies) * 1000 if n else float("nan"),
        "p95_ms": latencies[min(n - 1, int(0.95 * n))] * 1000 if n else float("nan"),
    }


def run_load(
    cells: list[Cell], seconds: float, warmup: float, rounds: int, out: Connection
) -> None:
    """Measure every cell ``rounds`` times, interleaved; keep each cell's best round.

    The machine may be shared: the best round is the one least disturbed by other load.
    """

    async def all_cells() -> list[dict[str, Any]]:
        best: dict[int, dict[str, Any]] = {}
        for _ in range(rounds):
            for n, cell in enumerate(cells):
                result = await one_cell(cell, seconds, warmup)
                key = (result["rps"], -result["p50_ms"])
                if n not in best or key > (best[n]["rps"], -best[n]["p50_ms"]):
                    best[n] = result
        return [best[n] for n in range(len(cells))]

    out.send(asyncio.run(all_cells()))
    out.close()


# --------------------------------------------------------------------------- main


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_listening(port: int, limit: float = 15.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on port {port} after {limit} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measured time per cell")
    parser.add_argument(
        "--warmup", type=float, default=0.5, help="unmeasured time per cell (staggered starts)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds per cell, best kept")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--delay-ms", type=float, default=100.0, help="simulated non-streaming generation time"
    )
    parser.add_argument("--chunks", type=int, default=20, help="SSE chunks per streamed answer")
    parser.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=20.0,
        help="pace of SSE chunks (20 ms: 50 tokens/s a stream, 3200/s for 64 streams)",
    )
    parser.add_argument("--response-text", type=int, default=256, help="answer length, chars")
    parser.add_argument("--raw-concurrency", type=int, nargs="*", default=[1, 64])
    parser.add_argument(
        "--keys",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a proxy that takes API keys, at 1 client (plain and raw)",
    )
    args = parser.parse_args()
    conc = args.concurrency

    shape = Shape(args.delay_ms, args.response_text, args.chunks, args.chunk_interval_ms)
    up_port, proxy_port, keyed_port = free_port(), free_port(), free_port()
    ctx = mp.get_context("spawn")
    upstream = ctx.Process(target=run_upstream, args=(up_port, shape), daemon=True)
    proxy = ctx.Process(target=run_proxy, args=(proxy_port, up_port), daemon=True)
    keys_dir = tempfile.TemporaryDirectory(prefix="bench-proxy-keys-")
    keys_file = Path(keys_dir.name) / "keys"
    keys_file.write_text(
        "".join(key_line(f"agent-{n}", f"csk-other-{n}") + "\n" for n in range(16))
        + key_line("bench", BENCH_KEY)
        + "\n"
    )
    keyed = ctx.Process(target=run_proxy, args=(keyed_port, up_port, str(keys_file)), daemon=True)
    processes = [upstream, proxy] + ([keyed] if args.keys else [])
    for process in processes:
        process.start()
    try:
        wait_listening(up_port)
        wait_listening(proxy_port)
        if args.keys:
            wait_listening(keyed_port)
        path = "/v1/chat/completions"
        targets = (("direct", up_port), ("proxy", proxy_port))
        cells = [
            Cell(target, f"http://127.0.0.1:{port}{path}", conc, stream)
            for stream in (False, True)
            for conc in args.concurrency
            for target, port in targets
        ] + [
            Cell(target, f"http://127.0.0.1:{port}{path}", conc, False, paced=False)
            for conc in args.raw_concurrency
            for target, port in targets
        ]
        if args.keys:
            keyed_url = f"http://127.0.0.1:{keyed_port}{path}"
            cells += [
                Cell(target, url, 1, False, paced=paced)
                for paced in (True, False)
                for target, url in (
                    ("proxy", f"http://127.0.0.1:{proxy_port}{path}"),
                    ("proxy+keys", keyed_url),
                )
            ]
        receiver, sender = ctx.Pipe(duplex=False)
        load = ctx.Process(
            target=run_load, args=(cells, args.seconds, args.warmup, args.rounds, sender)
        )
        load.start()
        results: list[dict[str, Any]] = receiver.recv()
        load.join()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
        keys_dir.cleanup()

    request_bytes = len(json.dumps({**REQUEST, "stream": False}).encode())
    print("cardshare.proxy benchmark: direct to upstream vs through the proxy")
    print(
        f"machine: {platform.platform()}, {platform.machine()}, cpu_count={os.cpu_count()}, "
        f"python {platform.python_version()}, aiohttp {aiohttp.__version__}"
    )
    print(
        "upstream: in-script aiohttp fake vLLM (repeatable; not the real vLLM nor the lab "
        "stand-in); upstream, proxy and load each in its own process"
    )
    print(
        f"payloads: request {request_bytes} B; non-streaming answer "
        f"{len(completion_body(shape.response_text))} B after {shape.delay_ms:g} ms; streamed "
        f"answer {shape.chunks} x {len(sse_chunk())} B chunks every "
        f"{shape.chunk_interval_ms:g} ms + [DONE]"
    )
    print(
        f"per cell: {args.warmup:g} s warm-up, {args.seconds:g} s measured, best of "
        f"{args.rounds} interleaved rounds (highest req/s, then lowest median)\n"
    )
    header = (
        f"{'kind':<10}{'clients':>8}{'direct r/s':>12}{'proxy r/s':>11}{'ratio':>7}"
        f"{'direct p50/p95 ms':>20}{'proxy p50/p95 ms':>19}{'added p50 ms':>14}{'errors':>8}"
    )
    # the 1-client plain cells run twice (for the key table too): the better one counts
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in results:
        cell = (r["target"], r["concurrency"], r["stream"], r["paced"])
        best = by_key.get(cell)
        if best is None or (r["rps"], -r["p50_ms"]) > (best["rps"], -best["p50_ms"]):
            by_key[cell] = r
    rows = [("stream" if st else "plain", c, st, True) for st in (False, True) for c in conc]
    rows += [("raw plain", c, False, False) for c in args.raw_concurrency]
    print(header)
    print("-" * len(header))
    for kind, clients, stream, paced in rows:
        if kind == "raw plain" and clients == args.raw_concurrency[0]:
            print("raw: the upstream answers at once; the proxy's own cost, CPU-bound here")
        d = by_key[("direct", clients, stream, paced)]
        p = by_key[("proxy", clients, stream, paced)]
        ratio = p["rps"] / d["rps"] if d["rps"] else float("nan")
        print(
            f"{kind:<10}{clients:>8}{d['rps']:>12.1f}{p['rps']:>11.1f}{ratio:>7.2f}"
            f"{d['p50_ms']:>11.2f}/{d['p95_ms']:<8.2f}{p['p50_ms']:>10.2f}/{p['p95_ms']:<8.2f}"
            f"{p['p50_ms'] - d['p50_ms']:>14.2f}{d['errors'] + p['errors']:>8}"
        )
    if args.keys:
        print(
            "\nAPI keys at 1 client: the keyless proxy vs one taking keys (17 in its file), "
            "side by side"
        )
        header = (
            f"{'kind':<10}{'proxy p50/p95 ms':>19}{'keys p50/p95 ms':>18}"
            f"{'added p50 ms':>14}{'r/s ratio':>11}{'errors':>8}"
        )
        print(header)
        print("-" * len(header))
        for kind, paced in (("plain", True), ("raw plain", False)):
            p = by_key[("proxy", 1, False, paced)]
            kp = by_key[("proxy+keys", 1, False, paced)]
            ratio = kp["rps"] / p["rps"] if p["rps"] else float("nan")
            print(
                f"{kind:<10}{p['p50_ms']:>10.2f}/{p['p95_ms']:<8.2f}{kp['p50_ms']:>9.2f}/"
                f"{kp['p95_ms']:<8.2f}{kp['p50_ms'] - p['p50_ms']:>14.3f}{ratio:>11.2f}"
                f"{p['errors'] + kp['errors']:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
