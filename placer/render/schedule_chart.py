"""Pipeline schedule charts: device groups x time, one box per forward/backward of a micro-batch.

Two forms of a simulated `Timeline` (placer.estimate.schedule): an SVG
written directly (rects and text, no plotting library) and a text chart for
the terminal:

    1f1b: 2 stages, 4 micro-batches, bubble 20.0% (textbook (p-1)/(m+p-1) 20.0%)
    cuda:0 |F0F1  B0  F2B1  F3B2    B3  |
    cuda:1 |  F0B0    F1B1  F2B2  F3B3  |
"""
from __future__ import annotations

import math
from xml.sax.saxutils import escape

from placer.estimate.schedule import Slot, Timeline

COLORS = {"F": "#6fa8dc", "B": "#93c47d", "I": "#b6d7a8", "W": "#f6b26b", "idle": "#f3f3f3"}
LEGEND = (("F", "forward"), ("B", "backward"), ("I", "backward (input grad)"), ("W", "backward (weight grad)"),
          ("idle", "idle (bubble)"))


def _lane_name(devices) -> str:
    return ",".join(devices)


def _stages_per_group(tl: Timeline) -> int:
    return len(tl.stage_groups) // max(1, len(tl.groups))


def slot_label(tl: Timeline, s: Slot) -> str:
    """`F3` (kind, micro-batch); `2F3` (stage first, as torch writes actions) when groups hold several stages."""
    if s.kind == "idle":
        return ""
    return f"{s.stage}{s.label}" if _stages_per_group(tl) > 1 else s.label


def title(tl: Timeline) -> str:
    v = _stages_per_group(tl)
    formula = "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)"
    return (f"{tl.schedule}: {len(tl.stage_groups)} stages on {len(tl.groups)} device groups, "
            f"{tl.microbatches} micro-batches, bubble {tl.bubble:.1%} (textbook {formula} {tl.textbook:.1%})")


def _ticks(makespan: float, n: int = 8) -> list[float]:
    """Round tick values from 0 to makespan."""
    if makespan <= 0:
        return [0.0]
    raw = makespan / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(makespan / step + 1e-9) + 1)]


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def schedule_svg(tl: Timeline, width: int = 960) -> str:
    """The chart as a standalone SVG document (deterministic text)."""
    names = [_lane_name(g) for g in tl.groups]
    left = 16 + 7 * max(len(n) for n in names)
    row, top = 30, 44
    scale = (width - left - 16) / tl.makespan if tl.makespan else 0.0
    height = top + row * len(names) + 64
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<title>{escape(title(tl))}</title>',
           f'<text x="8" y="20" font-size="13">{escape(title(tl))}</text>']
    for i, (name, lane) in enumerate(zip(names, tl.slots)):
        y = top + i * row
        out.append(f'<text x="{left - 6}" y="{y + row / 2 + 4:.1f}" text-anchor="end">{escape(name)}</text>')
        for s in lane:
            x, w = left + s.start * scale, (s.end - s.start) * scale
            label = slot_label(tl, s)
            tip = f"{label or 'idle'} {_num(s.start)}-{_num(s.end)} {tl.unit}"
            out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" fill="{COLORS[s.kind]}" '
                       f'stroke="#ffffff" stroke-width="1"><title>{escape(tip)}</title></rect>')
            if label and w >= 6.5 * len(label) + 2:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 4:.1f}" text-anchor="middle">'
                           f'{escape(label)}</text>')
    axis = top + row * len(names) + 4
    out.append(f'<line x1="{left}" y1="{axis}" x2="{left + tl.makespan * scale:.2f}" y2="{axis}" stroke="#444"/>')
    for t in _ticks(tl.makespan):
        x = left + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis}" x2="{x:.2f}" y2="{axis + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis + 16}" text-anchor="middle">{_num(t)}</text>')
    out.append(f'<text x="{left + tl.makespan * scale:.2f}" y="{axis + 30}" text-anchor="end">'
               f'time ({escape(tl.unit)})</text>')
    x = left
    used = {s.kind for lane in tl.slots for s in lane}
    for kind, what in LEGEND:
        if kind in used:
            out.append(f'<rect x="{x}" y="{axis + 40}" width="12" height="12" fill="{COLORS[kind]}"/>')
            out.append(f'<text x="{x + 16}" y="{axis + 50}">{escape(what)}</text>')
            x += 28 + 7 * len(what)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def schedule_text(tl: Timeline, max_width: int = 160) -> str:
    """The chart as text: one row per device group, each action as wide as its time."""
    names = [_lane_name(g) for g in tl.groups]
    pad = max(len(n) for n in names)
    busy = [s for lane in tl.slots for s in lane if s.kind != "idle"]
    shortest = min((s.end - s.start for s in busy), default=1.0) or 1.0
    widest = max((len(slot_label(tl, s)) for s in busy), default=1)
    sep = _stages_per_group(tl) > 1  # a space after each `0F1` label keeps neighbours apart
    widest += sep
    # every action wide enough for its label, unless the chart would pass max_width
    scale = min(widest / shortest, max(1, max_width - pad - 3) / tl.makespan) if tl.makespan else 1.0
    lines = [title(tl)]
    for name, lane in zip(names, tl.slots):
        cells = []
        for s in lane:
            n = round(s.end * scale) - round(s.start * scale)
            # the longest label that fits: `2F3`, else `F3`, else `F`
            room = n - 1 if sep and n > 1 else n
            text = next((t for t in (slot_label(tl, s), s.label, s.kind[:1]) if len(t) <= room), "")
            cells.append(text.ljust(n) if s.kind != "idle" else " " * n)
        lines.append(f"{name.ljust(pad)} |{''.join(cells)}|")
    return "\n".join(lines)
