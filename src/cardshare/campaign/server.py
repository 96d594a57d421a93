"""The campaign's HTTP side (standard library): the arbiter's pause and resume, status, metrics.

``POST /v1/pause`` ``{"holder", "seconds", "reason"}`` ends the running encoder (its memory
leaves the card) and answers ``{"paused": true, "vram_bytes": 0}`` once it has exited, within
``ack_seconds``; nothing starts again until ``POST /v1/resume`` or the lease runs out (the
arbiter renews it). A body that is not that, or an encoder that does not stop in time, is an
error status: the arbiter then counts the campaign as foreign. This is the yielding tenant's
interface of the arbiter (roles/arbiter/docs/api.md, "Yielding tenants").
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cardshare.campaign.runner import Campaign
from cardshare.campaign.store import Store
from cardshare.promtext import Sample, render

__all__ = ["MAX_LEASE_SECONDS", "make_server", "metrics_text"]

MAX_LEASE_SECONDS = 3600
MAX_BODY = 4096


def metrics_text(status: dict[str, Any]) -> str:
    paused = int(status["phase"] in ("paused", "waiting", "stopped"))
    arbiter_paused = int(status["arbiter_pause_until"] is not None)
    gauges = (
        ("files", "Files known to the re-encode campaign, by state.", 0),  # by state below
        ("saved_bytes", "Bytes won back by replaced files.", status["saved_bytes"]),
        ("held_bytes", "Bytes of originals in the holding folder.", status["held_bytes"]),
        ("queued_bytes", "Bytes of files waiting to be re-encoded.", status["queued_bytes"]),
        ("paused", "1 while the encoder is paused or the campaign waits.", paused),
        ("arbiter_paused", "1 while the arbiter's pause holds.", arbiter_paused),
        ("alert", "1 while the alert holds.", 0),  # by name below
    )
    samples: dict[str, list[Sample]] = {f"cardshare_campaign_{n}": [({}, v)] for n, _, v in gauges}
    counts = sorted(status["counts"].items())
    samples["cardshare_campaign_files"] = [({"state": s}, n) for s, n in counts]
    samples["cardshare_campaign_alert"] = [({"name": a["name"]}, 1) for a in status["alerts"]]
    return render([(f"cardshare_campaign_{n}", "gauge", h) for n, h, _ in gauges], samples)


def make_server(campaign: Campaign, host: str, port: int) -> ThreadingHTTPServer:
    control = campaign.control
    ack = campaign.config.ack_seconds
    reader = Store(campaign.config.db_path)  # its own connection: the loop writes meanwhile
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "cardshare-campaign"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
            data = (json.dumps(body) if content_type == "application/json" else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any] | None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return None
            if not 0 < length <= MAX_BODY:
                return None
            try:
                doc = json.loads(self.rfile.read(length))
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None

        def do_GET(self) -> None:
            if self.path == "/v1/status":
                with lock:
                    self._send(200, campaign.status(reader))
            elif self.path == "/metrics":
                with lock:
                    text = metrics_text(campaign.status(reader))
                self._send(200, text, "text/plain; version=0.0.4")
            elif self.path == "/v1/health":
                self._send(200, {"healthy": True, "phase": campaign.phase})
            else:
                self._send(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            body = self._body()
            if self.path == "/v1/pause":
                seconds = body.get("seconds") if body else None
                if (
                    body is None
                    or isinstance(seconds, bool)
                    or not isinstance(seconds, int | float)
                    or not 1 <= seconds <= MAX_LEASE_SECONDS
                    or not isinstance(body.get("holder"), str)
                ):
                    self._send(
                        400,
                        {
                            "error": 'give {"holder": "...", "seconds": 1..'
                            + f'{MAX_LEASE_SECONDS}, "reason": "..."}}'
                        },
                    )
                    return
                reason = str(body.get("reason") or body["holder"])[:200]
                control.pause(float(seconds), reason)
                if control.wait_stopped(ack):
                    self._send(200, {"paused": True, "vram_bytes": 0, "until": control.until()})
                else:
                    self._send(503, {"error": f"the encoder did not stop within {ack:g} s"})
            elif self.path == "/v1/resume":
                control.resume()
                self._send(200, {"paused": False})
            else:
                self._send(404, {"error": f"no such path {self.path}"})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="campaign-http", daemon=True)
    thread.start()
    return thread
