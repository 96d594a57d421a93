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
import statistics
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
_BAR_H = 40
ALERT_SHORT = 120  # an alert's message longer than this is folded after its first words

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


def _swatch(colour: str, hollow: bool = False) -> str:
    shape = (
        f'<rect x="1" y="1" width="10" height="10" fill="#ffffff" stroke="{colour}" '
        'stroke-width="2" stroke-dasharray="3 2"/>'
        if hollow
        else f'<rect width="12" height="12" fill="{colour}"/>'
    )
    return (
        '<svg class="swatch" width="12" height="12" aria-hidden="true" focusable="false">'
        f"{shape}</svg>"
    )


def _legend(colours: dict[str, str]) -> str:
    items = "".join(f"<li>{_swatch(c)} {_e(n)}</li>" for n, c in colours.items())
    return f'<ul class="legend">{items}</ul>'


# --- the card's tenants: one stacked bar ------------------------------------------------------


def _bar_entries(
    tenants: list[dict[str, Any]], changes: list[dict[str, Any]], now: float
) -> list[dict[str, Any]]:
    """The scan's tenants, with what the arbiter started or stopped after the scan marked:
    a tenant started since takes its plan's memory (or none, when unknown) in place of what
    the scan saw of that name; one stopped since keeps the scan's figure, marked as leaving."""
    started = {n: c for c in changes if c["event"] == "started" for n in c["names"]}
    stopped = {n: c for c in changes if c["event"] == "stopped" for n in c["names"]}
    out: list[dict[str, Any]] = []
    for t in tenants:
        if t["name"] in started:
            continue
        entry = {**t, "note": None}
        change = stopped.get(t["name"])
        if change is not None and t.get("vram_bytes", 0) > 0:
            entry["note"] = f"stopped {_ago(now - change['at'])} ago, after this scan"
        out.append(entry)
    for change in changes:
        if change["event"] != "started":
            continue
        plan = change.get("plan_bytes")
        out.append(
            {
                "name": change["name"],
                "kind": "owner",
                "vram_bytes": int(plan or 0),
                "note": f"started {_ago(now - change['at'])} ago, not yet measured"
                + (f" (plan {gib(plan)})" if plan else ""),
            }
        )
    return out


def tenants_bar(
    tenants: list[dict[str, Any]],
    total: int | None,
    palette: dict[str, str] | None = None,
    changes: list[dict[str, Any]] | None = None,
    now: float = 0.0,
    key: str = "tenants",
    pdev: str | None = None,
) -> str:
    """The card's memory as one bar, with its tenants listed beside it; ``changes`` are the
    arbiter's starts and stops after the scan (``since_scan`` of the overview).  ``key``
    makes the chart's ids unique on a page of several bars, ``pdev`` names the card."""
    entries = _bar_entries(tenants, changes or [], now)
    held = [t for t in entries if t.get("vram_bytes", 0) > 0]
    used = sum(int(t["vram_bytes"]) for t in held)
    size = total if total and total >= used else used
    every = palette or _colours(sorted(t["name"] for t in entries))
    colours = {t["name"]: every.get(t["name"], PALETTE[0]) for t in entries}
    defs: list[str] = []
    parts: list[str] = []
    x = 0.0
    for t in held:
        width = _W * int(t["vram_bytes"]) / size if size else 0.0
        fill = colours[t["name"]]
        if t["note"]:  # not what the scan measured: striped
            pid = f"stripe-{len(defs)}" if key == "tenants" else f"{key}-stripe-{len(defs)}"
            defs.append(
                f'<pattern id="{pid}" width="10" height="10" patternUnits="userSpaceOnUse" '
                f'patternTransform="rotate(45)"><rect width="10" height="10" fill="#ffffff"/>'
                f'<rect width="5" height="10" fill="{fill}"/></pattern>'
            )
            fill = f"url(#{pid})"
        note = f", {t['note']}" if t["note"] else ""
        parts.append(
            f'<rect data-tenant="{_e(t["name"])}" x="{x:.2f}" y="0" width="{width:.2f}" '
            f'height="{_BAR_H}" fill="{fill}"><title>{_e(t["name"])} ({_e(t["kind"])}):'
            f" {gib(t['vram_bytes'])}{_e(note)}</title></rect>"
        )
        x += width
    # a tenant started since the scan whose plan's size is unknown is not in the bar
    unknown = any(t["note"] and not t.get("vram_bytes") for t in entries)
    free_word = "free at the scan" if unknown else "free"
    if size and x < _W:
        parts.append(
            f'<rect data-tenant="free" x="{x:.2f}" y="0" width="{_W - x:.2f}" '
            f'height="{_BAR_H}" fill="{FREE_COLOUR}"><title>{free_word}: {gib(size - used)}'
            "</title></rect>"
        )
    size_text = gib(total) if total else "unknown (the bar is what the clients hold)"
    planned = sum(
        int(t["vram_bytes"]) for t in held if t["note"] and t["note"].startswith("started")
    )
    held_text = (
        f"{gib(used - planned)} measured and {gib(planned)} planned,"
        if planned
        else f"{gib(used)} held"
    )
    desc = (
        "; ".join(
            f"{t['name']} ({t['kind']}) {gib(t['vram_bytes'])}"
            + (f", {t['note']}" if t["note"] else "")
            for t in held
        )
        or "nobody holds memory"
    )
    items = []
    for t in entries:
        memory = (
            gib(t.get("vram_bytes", 0))
            if not (t["note"] and t["note"].startswith("started"))
            else ""
        )
        note = f' <span class="note">{_e(t["note"])}</span>' if t["note"] else ""
        items.append(
            f'<li data-tenant="{_e(t["name"])}"{" data-pending" if t["note"] else ""}>'
            f"{_swatch(colours[t['name']], bool(t['note']))} <strong>{_e(t['name'])}</strong>"
            f' <span class="kind">{_e(t["kind"])}</span> <span class="num">{memory}</span>'
            f"{note}</li>"
        )
    if total and total >= used:
        items.append(
            f'<li data-tenant="free">{_swatch(FREE_COLOUR)} {free_word} '
            f'<span class="num">{gib(total - used)}</span></li>'
        )
    which = "The card's memory" if pdev is None else f"Card {pdev}'s memory"
    card_attr = "" if pdev is None else f' data-pdev="{_e(pdev)}"'
    return (
        f'<figure data-chart="tenants"{card_attr}>'
        f'<svg viewBox="0 0 {_W} {_BAR_H}" width="100%" role="img" aria-labelledby="{key}-t '
        f'{key}-d" preserveAspectRatio="none"><title id="{key}-t">{_e(which)} by '
        f'tenant</title><desc id="{key}-d">{_e(desc)}; card size {_e(size_text)}</desc>'
        f"{'<defs>' + ''.join(defs) + '</defs>' if defs else ''}{''.join(parts)}</svg>"
        f"<figcaption>{held_text} of {_e(size_text)}</figcaption>"
        '<ul class="tenants" aria-label="Tenants">'
        f"{''.join(items) or '<li>no client on the card</li>'}</ul></figure>"
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
        f'<details id="{_e(chart_id)}-numbers"><summary>The numbers</summary><table><thead><tr>'
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
        f'{_legend(colours)}<details id="{_e(chart_id)}-numbers"><summary>The numbers</summary>'
        "<table><thead><tr>"
        f'<th scope="col">Day</th>{head}</tr></thead><tbody>{rows}</tbody></table></details>'
        "</figure>"
    )


# --- the page ----------------------------------------------------------------------------------


def _when(stamp: float, now: float) -> str:
    """A past time for a person: the time of day when today (UTC), else the date too."""
    same_day = time.gmtime(stamp)[:3] == time.gmtime(now)[:3]
    return f"{_utc(stamp, '%H:%M:%S' if same_day else '%Y-%m-%d %H:%M')}, {_ago(now - stamp)} ago"


def _facts(doc: dict[str, Any]) -> str:
    """The mode, the held requests and the queue: the first questions, first."""
    now = float(doc["generated"])
    mode = _e(doc["mode"])
    phase = (
        f' <span class="phase">now {_e(doc["phase"])}</span>' if doc["mode"] == "swapping" else ""
    )
    proxy = doc.get("proxy")
    if proxy is None:
        held, held_text = "none", "no proxy configured"
    elif proxy.get("held") is None:
        held, held_text = "unknown", "unknown: " + _e(proxy.get("error") or "no answer")
    else:
        held = str(int(proxy["held"]))
        oldest = proxy.get("oldest_held_seconds")
        held_text = held + (
            f", the oldest for {_ago(float(oldest))}" if proxy["held"] and oldest else ""
        )
    queue = int(doc["queue_length"])
    running = ", one running" if doc.get("job_running") else ""
    items = [
        (
            "Mode",
            f'<strong class="mode mode-{mode}" data-mode="{mode}">{mode}</strong> since '
            f'<span data-since="{doc["since"]}">{_e(_when(float(doc["since"]), now))}</span>'
            f"{phase}",
        ),
        ("Held requests", f'<span data-held="{held}">{held_text}</span>'),
        ("Queued jobs", f'<span data-queue="{queue}">{queue}</span>{running}'),
    ]
    if doc.get("fleet_view_url"):  # the boxes behind one proxy: the proxy's view of them
        items.append(("Fleet", f'<a href="{_e(doc["fleet_view_url"])}" data-fleet>Fleet view</a>'))
    rows = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in items)
    return f'<dl class="facts" data-facts>{rows}</dl>'


def _card_changes(changes: list[dict[str, Any]], card: dict[str, Any]) -> list[dict[str, Any]]:
    """The starts and stops after the scan that touch one pool card: vLLM's on every one,
    ComfyUI's on its own card."""
    return [c for c in changes if c.get("role") == "llm" or card.get("image")]


def _cards_bars(doc: dict[str, Any], groups: list[dict[str, Any]], colours: dict[str, str]) -> str:
    """One bar per card, grouped by job: the LLM pool's cards together, then the transcode
    card, then the others; what the arbiter started or stopped after the scan on the pool's."""
    now = float(doc["generated"])
    changes = doc.get("since_scan") or []
    out = []
    n = 0
    for group in groups:
        bars = []
        for card in group["cards"]:
            pdev = str(card["pdev"])
            size = card.get("vram_total_bytes")
            image = " (ComfyUI's card)" if card.get("image") and group["job"] == "llm" else ""
            bars.append(
                f'<h4 class="pdev">{_e(pdev)}{_e(image)}</h4>'
                + tenants_bar(
                    card.get("tenants") or [],
                    size,
                    colours,
                    _card_changes(changes, card) if group["job"] == "llm" else [],
                    now,
                    key=f"card{n}",
                    pdev=pdev,
                )
            )
            n += 1
        job = _e(group["job"])
        out.append(
            f'<div class="job" data-job="{job}"><h3 id="job-{job}-h">{_e(group["heading"])}'
            f"</h3>{''.join(bars)}</div>"
        )
    return "".join(out)


def _card_section(doc: dict[str, Any], colours: dict[str, str]) -> str:
    now = float(doc["generated"])
    card = doc.get("card")
    groups = doc.get("cards") or []
    if card is None:
        body = "<p>No card data yet.</p>"
    else:
        age = now - float(card["scanned_at"])
        limit = doc.get("card_data_max_age_seconds")
        old = limit is not None and age > float(limit)
        body = (
            f'<p class="scan{" old" if old else ""}" data-card-age="{age:.0f}">Card data '
            f"scanned {_e(_when(float(card['scanned_at']), now))}"
            + (
                f" (older than the {float(limit or 0):g} s the arbiter weighs a swap on: it "
                "scans again before one)"
                if old
                else ""
            )
            + "</p>"
            + (
                _cards_bars(doc, groups, colours)
                if groups
                else tenants_bar(
                    doc.get("tenants") or [],
                    doc.get("card_total_bytes"),
                    colours,
                    doc.get("since_scan") or [],
                    now,
                )
            )
        )
    title = "The cards" if groups else "The card"
    return f'<section aria-labelledby="card-h"><h2 id="card-h">{title}</h2>{body}</section>'


def _arbiter_section(doc: dict[str, Any]) -> str:
    engine = doc["engine"]
    plan = doc.get("llm_plan") or {}
    hold = doc.get("hold")
    items = [
        (
            "Phase",
            f'<span data-phase="{_e(doc["phase"])}">{_e(doc["phase"])}</span> since '
            f"{_e(_utc(doc['phase_since']))}",
        ),
        (
            "Engine",
            ("healthy" if engine.get("healthy") else "NOT healthy")
            + f" ({_e(engine.get('health', ''))}), heartbeat "
            f"{_ago(float(engine.get('heartbeat_age_seconds') or 0))} ago",
        ),
        ("vLLM plan", _plan_text(plan)),
        (
            "Swap hold",
            "none" if not hold else f"{_e(hold['holder'])} until {_e(_utc(hold['until']))}",
        ),
        (
            "Decision",
            ("go" if doc["decision"]["go"] else "wait")
            + ": "
            + _e("; ".join(doc["decision"]["reasons"]) or "nothing to decide"),
        ),
    ]
    rows = "".join(f'<tr><th scope="row">{k}</th><td>{v}</td></tr>' for k, v in items)
    return (
        '<section aria-labelledby="arbiter-h"><h2 id="arbiter-h">The arbiter</h2>'
        f"<table>{rows}</table></section>"
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
    items = []
    for a in alerts:
        name, message = _e(a["name"]), str(a["message"])
        if len(message) <= ALERT_SHORT:
            items.append(f'<li data-alert="{name}"><strong>{name}</strong>: {_e(message)}</li>')
        else:  # a long one folds (a phone shows every alert's name on the first screen)
            short = message[: ALERT_SHORT - 20].rsplit(" ", 1)[0]
            items.append(
                f'<li data-alert="{name}"><details id="alert-{name}"><summary><strong>{name}'
                f"</strong>: {_e(short)} …</summary><p>{_e(message)}</p></details></li>"
            )
    body = f"<ul>{''.join(items)}</ul>" if alerts else "<p>No alerts.</p>"
    return (
        f'<section id="alerts" aria-labelledby="alerts-h" data-alerts="{len(alerts)}"'
        + (' class="alerting"' if alerts else "")
        + ">"
        + f'<h2 id="alerts-h">Alerts ({len(alerts)})</h2>{body}</section>'
    )


def _phases_text(swap: dict[str, Any]) -> list[str]:
    return [
        f"{p['phase']} {p['seconds']:.1f} s"
        + ("" if p["outcome"] == "ok" else f" ({p['outcome']})")
        for p in swap["phases"]
    ]


def _outcome(swap: dict[str, Any]) -> str:
    return "running" if swap.get("ok") is None else ("ok" if swap["ok"] else "failed")


def _swaps_section(doc: dict[str, Any]) -> str:
    """The last swap and its phases, today's count and median; the full table folded."""
    swaps = doc.get("swaps") or []
    now = float(doc["generated"])
    if not swaps:
        return (
            '<section aria-labelledby="swaps-h"><h2 id="swaps-h">Swaps</h2>'
            "<p>No swap yet.</p></section>"
        )
    last = swaps[0]
    total = last.get("total_seconds")
    took = f", took {total:.1f} s" if total is not None else ""
    phases = "".join(f"<li>{_e(p)}</li>" for p in _phases_text(last)) or "<li>none yet</li>"
    summary = (
        f'<p data-last-swap="{int(last["id"])}">The last: <strong>{_e(last["direction"])}'
        f"</strong>, {_outcome(last)}, started {_e(_when(float(last['started']), now))}{took}."
        f'</p><ol class="phases" aria-label="Its phases">{phases}</ol>'
    )
    today = doc.get("swaps_today") or {}
    times = [float(t) for t in today.get("took_seconds") or []]
    day = time.strftime("%Y-%m-%d", time.gmtime(now))
    n = int((doc.get("daily") or {}).get(day, {}).get("swaps", len(times)))
    median = statistics.median(times) if times else None
    summary += (
        f'<p data-swaps-today="{n}" data-swaps-median="'
        f'{"" if median is None else f"{median:.1f}"}">'
        + (
            "No swap today (UTC)."
            if not n
            else f"{n} swap{'s' if n != 1 else ''} today (UTC)"
            + (f", median took {median:.1f} s." if median is not None else ", none finished yet.")
        )
        + "</p>"
    )
    rows = []
    for swap in swaps:
        total = swap.get("total_seconds")
        rows.append(
            f'<tr data-swap="{int(swap["id"])}"><td>{_e(_utc(swap["started"], "%m-%d %H:%M:%S"))}'
            f"</td><td>{_e(swap['direction'])}</td><td>{_outcome(swap)}</td>"
            f'<td class="num">{"" if total is None else f"{total:.1f} s"}</td>'
            f"<td>{'<br>'.join(_e(p) for p in _phases_text(swap))}</td></tr>"
        )
    table = (
        f'<details id="swaps-all"><summary>The last {len(swaps)} swaps, each phase</summary>'
        '<div class="scroll"><table><thead><tr><th scope="col">Started (UTC)</th>'
        '<th scope="col">Direction</th><th scope="col">Outcome</th>'
        '<th scope="col" class="num">Took</th><th scope="col">Phases</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div></details>"
    )
    return (
        f'<section aria-labelledby="swaps-h"><h2 id="swaps-h">Swaps</h2>{summary}{table}</section>'
    )


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
    names |= {t["name"] for g in doc.get("cards") or [] for c in g["cards"] for t in c["tenants"]}
    for span in ("day", "month"):
        names |= set((history.get(span) or {}).get("vram_bytes", {}))
    names |= {c["name"] for c in doc.get("since_scan") or []}
    colours = _colours(sorted(names))  # one colour per client across the bar and the charts
    return (
        '<div class="first">'
        '<section class="now" aria-labelledby="now-h"><h2 id="now-h">Now</h2>'
        f'<p id="generated" data-generated="{doc["generated"]}">As of '
        f"{_e(_utc(doc['generated']))}.</p>{_facts(doc)}</section>"
        f"{_card_section(doc, colours)}{_alerts_section(doc)}</div>"
        + _swaps_section(doc)
        + _arbiter_section(doc)
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
