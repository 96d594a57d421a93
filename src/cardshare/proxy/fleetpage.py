"""The fleet view (``GET /proxy/fleet``): which box serves, what is held, each box's mode.

Drawn on the server as one HTML document with its style inline: no script, no request off
the proxy, one column on a phone (390 px wide) and a row of boxes on a wide screen; it
reloads itself every 5 s (``<meta http-equiv="refresh">``). It renders the ``/proxy/state``
document (with a single box, the proxy's one box is drawn from the same fields), which is
also the view's JSON: no second document to keep in step.
"""

from __future__ import annotations

import html
import time
from typing import Any

_STYLE = """
:root { color-scheme: light; }
body { margin: 0 auto; max-width: 72rem; padding: 0 1rem 2rem;
  font: 16px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: #1a1a1a; background: #fff; }
h1 { font-size: 1.3rem; margin: 0.75rem 0 0.25rem; }
h2 { font-size: 1.1rem; margin: 0 0 0.25rem; overflow-wrap: anywhere; }
p.summary { font-size: 1.1rem; margin: 0.25rem 0 0.75rem; }
ul.boxes { list-style: none; padding: 0; margin: 0; display: grid; gap: 0.75rem;
  grid-template-columns: repeat(auto-fill, minmax(16rem, 1fr)); }
ul.boxes > li { border: 1px solid #bdbdbd; border-radius: 4px; padding: 0.5rem 0.75rem; }
ul.boxes > li.out { border-color: #9e9e9e; background: #fafafa; }
dl { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 0.1rem 0.75rem;
  margin: 0; }
dl div { display: contents; }
dt { font-weight: 600; }
dd { margin: 0; overflow-wrap: anywhere; }
.mode { padding: 0 0.4rem; border-radius: 3px; }
.mode-llm { background: #e3f2fd; }
.mode-image { background: #f3e5f5; }
.mode-swapping { background: #fff3e0; }
.error { color: #b71c1c; }
footer { margin-top: 1.5rem; font-size: 0.9rem; color: #424242; }
a { color: #0d47a1; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "never"
    return f"{max(0.0, now - then):.1f} s ago"


def _box(box: dict[str, Any], now: float) -> str:
    mode = str(box["mode"])
    rotation = "yes, takes new requests" if box["in_rotation"] else "no"
    models = ", ".join(box.get("models") or []) or "any"
    error = box.get("error")
    rows = [
        ("Mode", f'<span class="mode mode-{_e(mode)}">{_e(mode)}</span>'),
        ("Serving", _e(rotation)),
        ("In flight", _e(box["in_flight"])),
        ("Models", _e(models)),
        ("Arbiter seen", _e(_ago(box.get("last_seen"), now))),
    ]
    if error:
        rows.append(("Error", f'<span class="error">{_e(error)}</span>'))
    cls = "" if box["in_rotation"] else ' class="out"'
    items = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in rows)
    return f"<li{cls}><h2>{_e(box['name'])}</h2><dl>{items}</dl></li>"


def _summary(state: dict[str, Any], boxes: list[dict[str, Any]]) -> str:
    serving = [b["name"] for b in boxes if b["in_rotation"]]
    held = int(state["held"])
    if serving:
        text = "Serving: " + ", ".join(serving) + "."
    else:
        text = "No box serves now: requests are held until one comes back."
    if held:
        oldest = state.get("oldest_held_seconds")
        text += f" {held} held" + (f", the oldest for {oldest:.0f} s" if oldest else "") + "."
    else:
        text += " Nothing held."
    text += f" {int(state['in_flight'])} in flight."
    return text


def render(state: dict[str, Any], boxes: list[dict[str, Any]], now: float | None = None) -> str:
    """The fleet view of a ``/proxy/state`` document and its boxes."""
    now = time.time() if now is None else now
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="refresh" content="5">'
        '<link rel="icon" href="data:,">'
        f"<title>Fleet</title><style>{_STYLE}</style></head><body>"
        "<header><h1>Fleet</h1>"
        f'<p class="summary" role="status">{_e(_summary(state, boxes))}</p></header>'
        f'<main><ul class="boxes">{"".join(_box(b, now) for b in boxes)}</ul></main>'
        '<footer><p>Reloads every 5 s. The same as JSON: <a href="/proxy/state">/proxy/state</a>;'
        ' metrics: <a href="/metrics">/metrics</a>.</p></footer></body></html>'
    )
