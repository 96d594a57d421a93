"""The status page: the box at a glance, rendered on the server as HTML with inline SVG.

Why server-rendered SVG and no charting library: the page must make no request off the box,
work on a phone, and stay readable without JavaScript; a few bar and line charts do not need
a library, and SVG drawn here carries its text alternative (a title, a description, and a
table of the same numbers) beside each chart. The page's script (``static/status.js``) only
fetches ``/status/main`` every few seconds and swaps it in.

Everything here renders the *overview* document (``GET /v1/overview``), which holds nothing
the API keeps behind its token: no job ids, no outputs.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PALETTE", "render_main", "render_page"]

# Series colours: each at least 4.5:1 against the white background (WCAG AA for text, well
# above the 3:1 graphics need), told apart by the legend's names, not by colour alone.
PALETTE = (
    "#1565c0",
    "#c62828",
    "#2e7d32",
    "#6a1b9a",
    "#b23c00",
    "#00695c",
    "#4e342e",
    "#ad1457",
)
FREE_COLOUR = "#e0e0e0"
_W, _H = 640, 200
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 8, 10, 26

Fmt = Callable[[float], str]


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def hours(x: float) -> str:
    return f"{x:.2f} h"


def count(x: float) -> str:
    return f"{x:g}"


def _utc(stamp: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return "never" if stamp is None else time.strftime(fmt, time.gmtime(stamp)) + " UTC"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _colours(names: Sequence[str]) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _swatch(colour: str) -> str:
    return (
        '<svg class="swatch" width="12" height="12" aria-hidden="true" focusable="false">'
        f'<rect width="12" height="12" fill="{colour}"/></svg>'
    )


def _legend(colours: dict[str, str]) -> str:
    items = "".join(f"<li>{_swatch(c)} {_e(n)}</li>" for n, c in colours.items())
    return f'<ul class="legend">{items}</ul>'


# --- the card's tenants: one stacked bar ------------------------------------------------------


def tenants_bar(
    tenants: list[dict[str, Any]], total: int | None, palette: dict[str, str] | None = None
) -> str:
    held = [t for t in tenants if t.get("vram_bytes", 0) > 0]
    used = sum(int(t["vram_bytes"]) for t in held)
    size = total if total and total >= used else used
    every = palette or _colours(sorted(t["name"] for t in held))
    colours = {t["name"]: every.get(t["name"], PALETTE[0]) for t in held}
    parts, x = [], 0.0
    for t in held:
        width = _W * int(t["vram_bytes"]) / size if size else 0.0
        parts.append(
            f'<rect data-tenant="{_e(t["name"])}" x="{x:.2f}" y="0" width="{width:.2f}" '
            f'height="28" fill="{colours[t["name"]]}"><title>{_e(t["name"])} ({_e(t["kind"])}):'
            f" {gib(t['vram_bytes'])}</title></rect>"
        )
        x += width
    if size and x < _W:
        parts.append(
            f'<rect data-tenant="free" x="{x:.2f}" y="0" width="{_W - x:.2f}" height="28" '
            f'fill="{FREE_COLOUR}"><title>free: {gib(size - used)}</title></rect>'
        )
    size_text = gib(total) if total else "unknown (the bar is what the clients hold)"
    desc = (
        "; ".join(f"{t['name']} ({t['kind']}) {gib(t['vram_bytes'])}" for t in held)
        or "nobody holds memory"
    )
    rows = "".join(
        f'<tr data-tenant="{_e(t["name"])}"><td>{_e(t["name"])}</td><td>{_e(t["kind"])}</td>'
        f'<td class="num">{gib(t.get("vram_bytes", 0))}</td></tr>'
        for t in tenants
    )
    free_row = (
        f'<tr><td>free</td><td></td><td class="num">{gib(total - used)}</td></tr>'
        if total and total >= used
        else ""
    )
    return (
        '<figure data-chart="tenants">'
        f'<svg viewBox="0 0 {_W} 28" width="100%" role="img" aria-labelledby="tenants-t '
        f'tenants-d" preserveAspectRatio="none"><title id="tenants-t">The card\'s memory by '
        f'tenant</title><desc id="tenants-d">{_e(desc)}; card size {_e(size_text)}</desc>'
        f"{''.join(parts)}</svg>"
        f"<figcaption>Card memory {gib(used)} held of {_e(size_text)}</figcaption>"
        f"{_legend(colours)}"
        '<table class="tenants"><caption>Tenants by kind</caption><thead><tr><th scope="col">'
        'Tenant</th><th scope="col">Kind</th><th scope="col" class="num">VRAM</th></tr></thead>'
        f"<tbody>{rows or '<tr><td colspan=3>no client on the card</td></tr>'}{free_row}"
        "</tbody></table></figure>"
    )


# --- line and bar charts ---------------------------------------------------------------------


def _axis(ymax: float, fmt: Fmt, xlabels: list[tuple[float, str]]) -> str:
    inner_h = _H - _TOP - _BOTTOM
    out = []
    for frac in (0.0, 0.5, 1.0):
        y = _TOP + inner_h * (1 - frac)
        out.append(
            f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#9e9e9e" '
            f'stroke-width="{1 if frac == 0 else 0.5}"/>'
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" '
            f'fill="#212121">{_e(fmt(ymax * frac))}</text>'
        )
    for i, (x, label) in enumerate(xlabels):
        anchor = "start" if i == 0 else "end" if i == len(xlabels) - 1 else "middle"
        out.append(
            f'<text x="{x:.1f}" y="{_H - 8}" text-anchor="{anchor}" font-size="11" '
            f'fill="#212121">{_e(label)}</text>'
        )
    return "".join(out)


def line_chart(
    chart_id: str,
    title: str,
    series: dict[str, list[list[float]]],
    start: float,
    end: float,
    ymax: float | None,
    fmt: Fmt,
    time_fmt: str,
    colours: dict[str, str] | None = None,
) -> str:
    """Lines over [start, end]; ``series`` maps a name to ``[[unix seconds, value], ...]``."""
    peak = max((v for pts in series.values() for _, v in pts), default=0.0)
    top = ymax if ymax and ymax >= peak else (peak or 1.0)
    colours = colours or _colours(sorted(series))
    span = max(end - start, 1.0)
    inner_w, inner_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(t: float, v: float) -> str:
        x = _LEFT + inner_w * min(max((t - start) / span, 0.0), 1.0)
        y = _TOP + inner_h * (1 - v / top)
        return f"{x:.1f},{y:.1f}"

    groups = []
    rows = []
    for name, points in series.items():
        colour = colours.get(name, PALETTE[0])
        coords = " ".join(px(t, v) for t, v in points)
        mark = (
            f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>'
            if len(points) > 1
            else "".join(
                f'<circle cx="{c.split(",")[0]}" cy="{c.split(",")[1]}" r="3" fill="{colour}"/>'
                for c in coords.split()
            )
        )
        groups.append(
            f'<g data-series="{_e(name)}" data-points="{len(points)}"><title>{_e(name)}</title>'
            f"{mark}</g>"
        )
        values = [v for _, v in points]
        rows.append(
            f'<tr data-series="{_e(name)}"><td>{_e(name)}</td><td class="num">{len(points)}</td>'
            f'<td class="num">{_e(fmt(values[-1]) if values else "")}</td>'
            f'<td class="num">{_e(fmt(max(values)) if values else "")}</td>'
            f'<td class="num">{_e(fmt(sum(values) / len(values)) if values else "")}</td></tr>'
        )
    xlabels = [
        (_LEFT + inner_w * f, time.strftime(time_fmt, time.gmtime(start + span * f)))
        for f in (0.0, 0.5, 1.0)
    ]
    empty = (
        ""
        if series
        else f'<text x="{_W / 2}" y="{_H / 2}" text-anchor="middle" font-size="13" '
        'fill="#424242">no history in this period yet</text>'
    )
    desc = (
        "; ".join(
            f"{name}: {len(pts)} points, peak {fmt(max(v for _, v in pts))}"
            for name, pts in series.items()
            if pts
        )
        or "no data"
    )
    return (
        f'<figure data-chart="{_e(chart_id)}">'
        f'<svg viewBox="0 0 {_W} {_H}" width="100%" role="img" '
        f'aria-labelledby="{chart_id}-t {chart_id}-d"><title id="{chart_id}-t">{_e(title)}'
        f'</title><desc id="{chart_id}-d">{_e(desc)}; from {_e(_utc(start))} to '
        f"{_e(_utc(end))}</desc>{_axis(top, fmt, xlabels)}{''.join(groups)}{empty}</svg>"
        f"<figcaption>{_e(title)} (UTC)</figcaption>{_legend(colours) if series else ''}"
        f"<details><summary>The numbers</summary><table><thead><tr>"
        '<th scope="col">Series</th><th scope="col" class="num">Points</th>'
        '<th scope="col" class="num">Last</th><th scope="col" class="num">Peak</th>'
        '<th scope="col" class="num">Mean</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></details></figure>"
    )


def bar_chart(
    chart_id: str,
    title: str,
    categories: list[str],
    series: dict[str, list[float]],
    fmt: Fmt,
    label: Callable[[str], str] = lambda c: c[5:],
) -> str:
    """Grouped bars: one group per category, one bar per series."""
    peak = max((v for values in series.values() for v in values), default=0.0)
    top = peak or 1.0
    colours = _colours(list(series))
    inner_w, inner_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    slot = inner_w / max(len(categories), 1)
    width = slot * 0.8 / max(len(series), 1)
    bars = []
    for s, (name, values) in enumerate(series.items()):
        rects = []
        for i, value in enumerate(values):
            if value <= 0:
                continue
            h = inner_h * value / top
            x = _LEFT + slot * i + slot * 0.1 + width * s
            rects.append(
                f'<rect x="{x:.1f}" y="{_TOP + inner_h - h:.1f}" width="{width:.1f}" '
                f'height="{h:.1f}" fill="{colours[name]}"><title>{_e(categories[i])} '
                f"{_e(name)}: {_e(fmt(value))}</title></rect>"
            )
        bars.append(
            f'<g data-series="{_e(name)}" data-points="{sum(1 for v in values if v > 0)}" '
            f'data-total="{sum(values):g}">{"".join(rects)}</g>'
        )
    picks = sorted({0, len(categories) // 2, len(categories) - 1}) if categories else []
    xlabels = [(_LEFT + slot * (i + 0.5), label(categories[i])) for i in picks]
    head = "".join(f'<th scope="col" class="num">{_e(n)}</th>' for n in series)
    rows = "".join(
        f'<tr><th scope="row">{_e(c)}</th>'
        + "".join(f'<td class="num">{_e(fmt(values[i]))}</td>' for values in series.values())
        + "</tr>"
        for i, c in enumerate(categories)
    )
    desc = "; ".join(f"{n}: {fmt(sum(v))} in all" for n, v in series.items()) or "no data"
    return (
        f'<figure data-chart="{_e(chart_id)}">'
        f'<svg viewBox="0 0 {_W} {_H}" width="100%" role="img" '
        f'aria-labelledby="{chart_id}-t {chart_id}-d"><title id="{chart_id}-t">{_e(title)}'
        f'</title><desc id="{chart_id}-d">{_e(desc)}</desc>{_axis(top, fmt, xlabels)}'
        f"{''.join(bars)}</svg><figcaption>{_e(title)} (UTC days)</figcaption>"
        f"{_legend(colours)}<details><summary>The numbers</summary><table><thead><tr>"
        f'<th scope="col">Day</th>{head}</tr></thead><tbody>{rows}</tbody></table></details>'
        "</figure>"
    )


# --- the page ----------------------------------------------------------------------------------


def _now_section(doc: dict[str, Any]) -> str:
    now = float(doc["generated"])
    engine = doc["engine"]
    plan = doc.get("llm_plan") or {}
    hold = doc.get("hold")
    items = [
        (
            "Mode",
            f'<strong data-mode="{_e(doc["mode"])}">{_e(doc["mode"])}</strong> since '
            f"{_e(_utc(doc['since']))} ({_ago(now - doc['since'])})",
        ),
        (
            "Phase",
            f'<span data-phase="{_e(doc["phase"])}">{_e(doc["phase"])}</span> since '
            f"{_e(_utc(doc['phase_since']))}",
        ),
        (
            "Queue",
            f'<span data-queue="{int(doc["queue_length"])}">{int(doc["queue_length"])}'
            "</span> job(s) queued or running"
            + ("; a job is running" if doc.get("job_running") else ""),
        ),
        (
            "Engine",
            ("healthy" if engine.get("healthy") else "NOT healthy")
            + f" ({_e(engine.get('health', ''))}), heartbeat "
            f"{_ago(float(engine.get('heartbeat_age_seconds') or 0))} ago",
        ),
        ("vLLM plan", _plan_text(plan)),
        ("Hold", "none" if not hold else f"{_e(hold['holder'])} until {_e(_utc(hold['until']))}"),
        (
            "Decision",
            ("go" if doc["decision"]["go"] else "wait")
            + ": "
            + _e("; ".join(doc["decision"]["reasons"]) or "nothing to decide"),
        ),
    ]
    rows = "".join(f'<tr><th scope="row">{k}</th><td>{v}</td></tr>' for k, v in items)
    return (
        f'<section aria-labelledby="now-h"><h2 id="now-h">Now</h2><table>{rows}</table></section>'
    )


def _plan_text(plan: dict[str, Any]) -> str:
    if not plan:
        return "unknown"
    size = f", {plan['max_model_len']} tokens of context" if plan.get("max_model_len") else ""
    which = f"plan {int(plan.get('index', 0)) + 1} of {plan.get('plans', 1)}"
    text = f"{_e(plan.get('service', '?'))} ({which}{size})"
    if plan.get("degraded"):
        text += " <strong>degraded</strong>: " + _e(plan.get("reason") or "")
    return text


def _alerts_section(doc: dict[str, Any]) -> str:
    alerts = doc.get("alerts") or []
    body = (
        "<ul>"
        + "".join(
            f'<li data-alert="{_e(a["name"])}"><strong>{_e(a["name"])}</strong>: '
            f"{_e(a['message'])}</li>"
            for a in alerts
        )
        + "</ul>"
        if alerts
        else '<p data-alerts="0">No alerts.</p>'
    )
    return (
        f'<section aria-labelledby="alerts-h" class="{"alerting" if alerts else ""}">'
        f'<h2 id="alerts-h">Alerts ({len(alerts)})</h2>{body}</section>'
    )


def _swaps_section(doc: dict[str, Any]) -> str:
    rows = []
    for swap in doc.get("swaps") or []:
        phases = "<br>".join(
            _e(f"{p['phase']} {p['seconds']:.1f} s")
            + ("" if p["outcome"] == "ok" else _e(f" ({p['outcome']})"))
            for p in swap["phases"]
        )
        total = swap.get("total_seconds")
        outcome = "running" if swap.get("ok") is None else ("ok" if swap["ok"] else "failed")
        rows.append(
            f'<tr data-swap="{int(swap["id"])}"><td>{_e(_utc(swap["started"], "%m-%d %H:%M:%S"))}'
            f"</td><td>{_e(swap['direction'])}</td><td>{outcome}</td>"
            f'<td class="num">{"" if total is None else f"{total:.1f} s"}</td>'
            f"<td>{phases}</td></tr>"
        )
    body = (
        '<div class="scroll"><table><thead><tr><th scope="col">Started</th>'
        '<th scope="col">Direction</th>'
        '<th scope="col">Outcome</th><th scope="col" class="num">Took</th>'
        f'<th scope="col">Phases</th></tr></thead><tbody>{"".join(rows)}</tbody></table></div>'
        if rows
        else "<p>No swap yet.</p>"
    )
    return f'<section aria-labelledby="swaps-h"><h2 id="swaps-h">Last swaps</h2>{body}</section>'


def _history_section(doc: dict[str, Any], colours: dict[str, str]) -> str:
    history = doc.get("history")
    if history is None:
        return (
            '<section aria-labelledby="hist-h"><h2 id="hist-h">History</h2><p>The recorder\'s '
            "history is not mounted into the arbiter (arbiter_recorder_data_dir).</p></section>"
        )
    total = doc.get("card_total_bytes")
    charts = []
    note = (
        f'<p class="alerting">Cannot read the history: {_e(history["error"])}</p>'
        if history.get("error")
        else ""
    )
    busy_colours = {"render": PALETTE[0], "video": PALETTE[4]}
    for span, label, fmt in (("day", "the last day", "%H:%M"), ("month", "30 days", "%m-%d")):
        part = history[span]
        charts.append(
            line_chart(
                f"vram-{span}",
                f"VRAM by client, {label} (peak per {part['step_seconds'] // 60} min)",
                part["vram_bytes"],
                part["start"],
                part["end"],
                total,
                gib,
                fmt,
                colours,
            )
        )
        charts.append(
            line_chart(
                f"busy-{span}",
                f"Engines busy, {label}: render/compute and video (mean share)",
                {g: pts for g, pts in part["busy_share"].items()},
                part["start"],
                part["end"],
                1.0,
                pct,
                fmt,
                busy_colours,
            )
        )
    days = [d for d, _ in history["transcode_hours_per_day"]]
    charts.append(
        bar_chart(
            "transcode-days",
            "Transcode hours per day (" + (", ".join(history["transcode_clients"]) or "none") + ")",
            days,
            {"hours": [h for _, h in history["transcode_hours_per_day"]]},
            hours,
        )
    )
    daily = doc.get("daily") or {}
    charts.append(
        bar_chart(
            "swaps-jobs-days",
            "Swaps and jobs per day",
            days,
            {
                "swaps": [float(daily.get(d, {}).get("swaps", 0)) for d in days],
                "jobs": [float(daily.get(d, {}).get("jobs", 0)) for d in days],
            },
            count,
        )
    )
    scans = f"{history['scans']} scans read, the last at {_e(_utc(history['last_scan']))}" + (
        f", {history['skipped_lines']} unusable lines skipped" if history["skipped_lines"] else ""
    )
    return (
        '<section aria-labelledby="hist-h"><h2 id="hist-h">History</h2>'
        f'<p data-scans="{int(history["scans"])}" data-last-scan="{history["last_scan"] or 0}">'
        f"{scans}.</p>{note}"
        f'<div class="charts">{"".join(charts)}</div></section>'
    )


def render_main(doc: dict[str, Any]) -> str:
    """The live part of the page (what ``/status/main`` returns)."""
    history = doc.get("history") or {}
    names = {t["name"] for t in doc.get("tenants") or []}
    for span in ("day", "month"):
        names |= set((history.get(span) or {}).get("vram_bytes", {}))
    colours = _colours(sorted(names))  # one colour per client across the bar and the charts
    return (
        f'<p id="generated" data-generated="{doc["generated"]}">As of '
        f"{_e(_utc(doc['generated']))}.</p>"
        + _alerts_section(doc)
        + _now_section(doc)
        + '<section aria-labelledby="card-h"><h2 id="card-h">The card</h2>'
        + (
            tenants_bar(doc.get("tenants") or [], doc.get("card_total_bytes"), colours)
            if doc.get("card") is not None
            else "<p>No card data yet.</p>"
        )
        + "</section>"
        + _swaps_section(doc)
        + _history_section(doc, colours)
    )


def render_page(doc: dict[str, Any], title: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title>"
        '<link rel="stylesheet" href="/static/status.css">'
        '<link rel="icon" href="data:,">'
        '<script src="/static/status.js" defer></script></head><body>'
        f'<header><h1>{_e(title)}</h1><p id="live" role="status">Updates every few seconds.'
        "</p></header>"
        f"<main>{render_main(doc)}</main>"
        '<footer><p>The same data as JSON: <a href="/v1/overview">/v1/overview</a>; metrics: '
        '<a href="/metrics">/metrics</a>.</p></footer></body></html>'
    )
