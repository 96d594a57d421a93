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

A fleet section (issue 33; ``--no-fleet`` leaves it out) measures routing: the same proxy with
its upstream given as the one box of ``boxes`` (the request's ``model`` read, a box picked)
beside the proxy without ``boxes``, at 1 and 64 clients, plain and raw; with
``--baseline-src DIR`` (a ``src`` directory of another checkout, say main's) a third proxy
process runs that code, side by side. Then throughput with two boxes against one: the boxes'
upstreams serve at most ``--slots`` requests at once each (vLLM's ``max_num_seqs``; the others
wait), so one box caps at slots / delay requests a second and two at twice that.

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
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import aiohttp
from aiohttp import web
from yarl import URL

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
    #: Requests generated at once (the others wait their turn); 0: no bound.
    slots: int = 0


# --------------------------------------------------------------------------- upstream process


def run_upstream(port: int, shape: Shape) -> None:
    body = completion_body(shape.response_text)
    one_chunk = sse_chunk()
    slots = asyncio.Semaphore(shape.slots) if shape.slots else None

    async def chat(request: web.Request) -> web.StreamResponse:
        if slots is None:
            return await generate(request)
        async with slots:
            return await generate(request)

    async def generate(request: web.Request) -> web.StreamResponse:
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


def run_proxy(
    port: int,
    upstream_port: int,
    keys_file: str = "",
    boxes: tuple[int, ...] = (),
    src: str = "",
    use_uvloop: bool = True,
) -> None:
    """A proxy process: one upstream, or ``boxes`` (upstream ports); ``src``: another
    checkout's code; ``use_uvloop``: False runs on asyncio's loop even where uvloop is."""
    if src:
        sys.path.insert(0, src)
        for name in [n for n in sys.modules if n == "cardshare" or n.startswith("cardshare.")]:
            del sys.modules[name]
    from cardshare.proxy import __main__ as entry
    from cardshare.proxy.config import build_config
    from cardshare.proxy.server import Proxy

    settings: dict[str, Any] = {"listen_port": port, "keys_file": keys_file}
    if boxes:
        settings["boxes"] = [
            {
                "name": f"box-{n}",
                "upstream_url": f"http://127.0.0.1:{box_port}",
                "arbiter_url": f"http://127.0.0.1:{box_port}",
                "models": ["bench-model"],
            }
            for n, box_port in enumerate(boxes)
        ]
    else:
        # the upstream also answers /v1/mode with llm: the proxy polls it as its arbiter
        settings["upstream_url"] = f"http://127.0.0.1:{upstream_port}"
        settings["arbiter_url"] = f"http://127.0.0.1:{upstream_port}"
    config = build_config(settings)
    if hasattr(entry, "run"):
        entry.run(config, Proxy(config), use_uvloop)
    else:  # a checkout before uvloop
        asyncio.run(entry.serve(config, Proxy(config)))


# --------------------------------------------------------------------------- load process


@dataclass(frozen=True)
class Cell:
    target: str
    url: str
    concurrency: int
    stream: bool
    #: False: the upstream answers at once (the proxy's raw cost and this machine's ceiling)
    paced: bool = True
    #: The serving process (a proxy), whose CPU time per request is measured; 0: none.
    pid: int = 0


def cpu_seconds(pid: int) -> float:
    """CPU time a process's threads have run, from the scheduler's own count (ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


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
        cpu_from: float | None = None
        measured_all = 0  # requests ended in the measured window, good or not

        async def cpu_mark() -> None:
            nonlocal cpu_from
            await asyncio.sleep(measure_from - loop.time())
            cpu_from = cpu_seconds(cell.pid)

        async def worker(offset: float) -> None:
            nonlocal errors, measured_all
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
                    measured_all += 1
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        workers = [
            asyncio.ensure_future(worker(warmup * n / cell.concurrency))
            for n in range(cell.concurrency)
        ]
        if cell.pid:
            workers.append(asyncio.ensure_future(cpu_mark()))
        await asyncio.sleep(end - loop.time())
        cpu_to = cpu_seconds(cell.pid) if cell.pid else None
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
        # the serving process's CPU per request in the measured window: its own cost, which a
        # loaded machine's waiting does not inflate as it does the latencies
        "cpu_us": (cpu_to - cpu_from) / measured_all * 1e6
        if cpu_to is not None and cpu_from is not None and measured_all
        else float("nan"),
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


def uvloop_version() -> str:
    try:
        import uvloop
    except ImportError:
        return "uvloop not installed"
    return f"uvloop {uvloop.__version__}"


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
    parser.add_argument(
        "--fleet",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure routing (boxes) and two boxes against one",
    )
    parser.add_argument(
        "--baseline-src",
        default="",
        help="a src directory of another checkout: its proxy runs beside, as the baseline",
    )
    parser.add_argument(
        "--slots", type=int, default=16, help="requests a fleet box's upstream serves at once"
    )
    parser.add_argument("--fleet-concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--fleet-only", action="store_true", help="measure the fleet section alone (no keys)"
    )
    args = parser.parse_args()
    conc = args.concurrency
    if args.fleet_only:
        args.fleet, args.keys = True, False
    if args.baseline_src and not (Path(args.baseline_src) / "cardshare" / "proxy").is_dir():
        parser.error(f"--baseline-src {args.baseline_src}: no cardshare/proxy in it")

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
    listening = [up_port, proxy_port] + ([keyed_port] if args.keys else [])
    # the fleet section: a routing proxy (boxes of one: the same upstream), the baseline's
    # proxy, and one box against two over slot-bound upstreams
    fleet_ports: dict[str, int] = {}
    if args.fleet:
        slotted = Shape(
            args.delay_ms, args.response_text, args.chunks, args.chunk_interval_ms, args.slots
        )
        box_ports = (free_port(), free_port())
        fleet_ports = {
            "route": free_port(),
            "asyncio": free_port(),
            "fleet1": free_port(),
            "fleet2": free_port(),
        }
        processes += [
            ctx.Process(target=run_upstream, args=(p, slotted), daemon=True) for p in box_ports
        ]
        processes += [
            ctx.Process(
                target=run_proxy, args=(fleet_ports["route"], 0, "", (up_port,)), daemon=True
            ),
            ctx.Process(
                target=run_proxy,
                args=(fleet_ports["asyncio"], up_port, "", (), "", False),
                daemon=True,
            ),
            ctx.Process(
                target=run_proxy, args=(fleet_ports["fleet1"], 0, "", box_ports[:1]), daemon=True
            ),
            ctx.Process(
                target=run_proxy, args=(fleet_ports["fleet2"], 0, "", box_ports), daemon=True
            ),
        ]
        listening += [*box_ports, *fleet_ports.values()]
        if args.baseline_src:
            fleet_ports["baseline"] = free_port()
            processes.append(
                ctx.Process(
                    target=run_proxy,
                    # on uvloop as 'proxy' is, where the baseline's code can (it has ``run``)
                    args=(fleet_ports["baseline"], up_port, "", (), args.baseline_src, True),
                    daemon=True,
                )
            )
            listening.append(fleet_ports["baseline"])
    for process in processes:
        process.start()
    try:
        for port in listening:
            wait_listening(port)
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
        if args.fleet_only:
            cells = []
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
        if args.fleet:
            routed = [
                ("direct", up_port),
                ("asyncio", fleet_ports["asyncio"]),
                ("proxy", proxy_port),
                ("route", fleet_ports["route"]),
            ]
            if args.baseline_src:
                routed.insert(1, ("baseline", fleet_ports["baseline"]))
            cells += [
                Cell(target, f"http://127.0.0.1:{port}{path}", clients, False, paced=paced)
                for paced in (True, False)
                for clients in (1, 64)
                for target, port in routed
            ]
            cells += [
                Cell(target, f"http://127.0.0.1:{fleet_ports[target]}{path}", clients, False)
                for clients in args.fleet_concurrency
                for target in ("fleet1", "fleet2")
            ]
        # each cell measures the CPU time of the process that serves it
        pid_of = {
            port: process.pid or 0 for port, process in zip(listening, processes, strict=True)
        }
        cells = [replace(c, pid=pid_of[URL(c.url).port or 0]) for c in cells]
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
        f"python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
        f"{uvloop_version()}"
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
    if args.fleet_only:
        rows = []
    else:
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
    if args.fleet:
        print_fleet(by_key, args)
    return 0


def print_fleet(by_key: dict[tuple[Any, ...], dict[str, Any]], args: argparse.Namespace) -> None:
    """The fleet section's two tables: routing's added latency, two boxes against one."""
    names = ["direct", *(["baseline"] if args.baseline_src else []), "asyncio", "proxy", "route"]
    print(
        "\nRouting (issue 33): 'proxy' without boxes, 'route' with the same upstream as the one "
        "box of boxes, both on uvloop where installed; 'asyncio' as 'proxy' on asyncio's loop; "
        "'direct' no proxy"
        + (
            f"; 'baseline' the code of {args.baseline_src} (on uvloop if that code can be, "
            "else asyncio's loop)"
            if args.baseline_src
            else ""
        )
        + "; p50/p95 ms, side by side"
    )
    header = f"{'kind':<10}{'clients':>8}" + "".join(f"{n + ' p50/p95':>20}" for n in names)
    header += f"{'proxy-direct p50':>18}{'route-proxy p50':>17}"
    if args.baseline_src:
        header += f"{'proxy-base p50':>16}"
    header += f"{'errors':>8}"
    print(header)
    print("-" * len(header))
    for kind, paced in (("plain", True), ("raw plain", False)):
        for clients in (1, 64):
            cells = {n: by_key[(n, clients, False, paced)] for n in names}
            line = f"{kind:<10}{clients:>8}" + "".join(
                f"{c['p50_ms']:>11.2f}/{c['p95_ms']:<8.2f}" for c in cells.values()
            )
            line += f"{cells['proxy']['p50_ms'] - cells['direct']['p50_ms']:>18.3f}"
            line += f"{cells['route']['p50_ms'] - cells['proxy']['p50_ms']:>17.3f}"
            if args.baseline_src:
                line += f"{cells['proxy']['p50_ms'] - cells['baseline']['p50_ms']:>16.3f}"
            line += f"{sum(c['errors'] for c in cells.values()):>8}"
            print(line)
    print(
        "\nOwn CPU per request, us: the serving proxy process's CPU time (its threads' "
        "scheduler time) over the requests answered in the measured window ('direct': the "
        "upstream's); a loaded machine makes requests wait, which this does not count"
    )
    header = f"{'kind':<10}{'clients':>8}" + "".join(f"{n:>10}" for n in names)
    print(header)
    print("-" * len(header))
    for kind, paced in (("plain", True), ("raw plain", False)):
        for clients in (1, 64):
            line = f"{kind:<10}{clients:>8}"
            line += "".join(f"{by_key[(n, clients, False, paced)]['cpu_us']:>10.0f}" for n in names)
            print(line)
    print(
        f"\nTwo boxes against one: each box's upstream serves {args.slots} requests at once "
        f"(the others wait), {args.delay_ms:g} ms each; plain requests"
    )
    header = (
        f"{'clients':>8}{'1 box r/s':>11}{'2 boxes r/s':>13}{'ratio':>7}"
        f"{'1 box p50/p95 ms':>19}{'2 boxes p50/p95 ms':>21}{'errors':>8}"
    )
    print(header)
    print("-" * len(header))
    for clients in args.fleet_concurrency:
        one = by_key[("fleet1", clients, False, True)]
        two = by_key[("fleet2", clients, False, True)]
        ratio = two["rps"] / one["rps"] if one["rps"] else float("nan")
        print(
            f"{clients:>8}{one['rps']:>11.1f}{two['rps']:>13.1f}{ratio:>7.2f}"
            f"{one['p50_ms']:>10.2f}/{one['p95_ms']:<8.2f}{two['p50_ms']:>12.2f}/"
            f"{two['p95_ms']:<8.2f}{one['errors'] + two['errors']:>8}"
        )


if __name__ == "__main__":
    sys.exit(main())
