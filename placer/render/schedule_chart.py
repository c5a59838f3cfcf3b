"""Pipeline schedule charts: device groups x time, one box per forward/backward of a micro-batch.

One layout of a simulated `Timeline` (placer.estimate.schedule), boxes and
texts at fixed positions, drawn three ways: an SVG written directly (no
graphviz needed), DOT with pinned positions that graphviz draws as PNG or PDF,
and a text chart for the terminal:

    1f1b: 2 stages, 4 micro-batches, bubble 20.0% (textbook (p-1)/(m+p-1) 20.0%)
    cuda:0 |F0F1  B0  F2B1  F3B2    B3  |
    cuda:1 |  F0B0  F1B1  F2B2  F3B3  |

Boxes are coloured by micro-batch (a forward light, its backward darker) and
labelled when the label fits; the legend names the colours either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from placer.diagnostics import Diagnostic, Loc, PlanError
from placer.estimate.schedule import Slot, Timeline

# one hue per micro-batch (cycling), in three shades: forward, backward / input grad, weight grad
_HUES = (("#c6dbef", "#6baed6", "#2171b5"), ("#fdd0a2", "#fd8d3c", "#d94801"),
         ("#c7e9c0", "#74c476", "#238b45"), ("#dadaeb", "#9e9ac8", "#6a51a3"),
         ("#fcbba1", "#fb6a4a", "#cb181d"), ("#d9d9d9", "#969696", "#525252"),
         ("#f6e8c3", "#dfc27d", "#a6611a"), ("#c7eae5", "#5ab4ac", "#01665e"))
_SHADE = {"F": 0, "B": 1, "I": 1, "W": 2}
IDLE = "#f3f3f3"
KINDS = (("F", "forward"), ("B", "backward"), ("I", "backward, input grad"), ("W", "backward, weight grad"))
FORMATS = ("svg", "png", "pdf", "txt")
_CHAR = 6.6  # px per character at font size 11 (Helvetica, a little generous)
_PREFIX = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))
_SUB = ((1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))


def fill(s: Slot) -> str:
    if s.kind == "idle":
        return IDLE
    return _HUES[(s.microbatch or 0) % len(_HUES)][_SHADE.get(s.kind, 1)]


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


def axis_caption(tl: Timeline) -> str:
    """What the time axis measures, in words."""
    if tl.unit == "flop":
        return "time, as FLOP each device computes (the spec gives no device speed)"
    if tl.unit == "s":
        return "time (seconds)"
    return "time, in forwards of one stage on one micro-batch"


def _tick_text(tl: Timeline, t: float, step: float) -> str:
    """A tick in plain units: `12 GFLOP`, `250 ms`, `3`."""
    if t == 0:
        return "0"
    if tl.unit == "flop":
        scale, prefix = next(((f, p) for f, p in _PREFIX if step >= f), (1.0, ""))
        return f"{_num(t / scale)} {prefix}FLOP"
    if tl.unit == "s":
        scale, prefix = next(((f, p) for f, p in _SUB if step >= f), (1e-9, "n"))
        return f"{_num(t / scale)} {prefix}s"
    return _num(t)


def _ticks(makespan: float, n: int = 8) -> list[float]:
    """Round tick values from 0 to makespan, at most about n of them."""
    if makespan <= 0:
        return [0.0]
    raw = makespan / max(1, n)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return [i * step for i in range(int(makespan / step + 1e-9) + 1)]


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


# ---- one layout, drawn as SVG or DOT ---------------------------------------------------------------

@dataclass(frozen=True)
class _Box:
    x: float
    y: float
    w: float
    h: float
    fill: str
    label: str = ""
    tip: str = ""


@dataclass(frozen=True)
class _Text:
    x: float
    y: float  # baseline
    text: str
    anchor: str = "start"  # start | middle | end
    size: int = 11


def _layout(tl: Timeline, width: int = 960, max_width: int = 2400) -> tuple[float, float, list]:
    """(width, height, boxes and texts), y downwards: the chart as positioned shapes."""
    names = [_lane_name(g) for g in tl.groups]
    left = 16 + _CHAR * max(len(n) for n in names)
    row, top = 30, 44
    busy = [s for lane in tl.slots for s in lane if s.kind != "idle"]
    shortest = min((s.end - s.start for s in busy), default=1.0) or 1.0
    widest = max((len(slot_label(tl, s)) for s in busy), default=1)
    # widen the chart (up to max_width) until the narrowest box holds its label
    plot = min(max(width - left - 16, (_CHAR * widest + 6) * tl.makespan / shortest), max_width - left - 16) \
        if tl.makespan else 0.0
    scale = plot / tl.makespan if tl.makespan else 0.0
    total_w = left + plot + 16
    items: list = [_Text(8, 20, title(tl), size=13)]
    for i, (name, lane) in enumerate(zip(names, tl.slots)):
        y = top + i * row
        items.append(_Text(left - 6, y + row / 2 + 4, name, "end"))
        for s in lane:
            x, w = left + s.start * scale, (s.end - s.start) * scale
            label = slot_label(tl, s)
            # the longest label that fits: `2F3`, else `F3`, else `3` (the colour tells the micro-batch)
            shown = next((t for t in (label, s.label, str(s.microbatch)) if t and _CHAR * len(t) + 4 <= w), "")
            tip = (f"{label or 'idle'}: {_tick_text(tl, s.start, s.end - s.start)} to "
                   f"{_tick_text(tl, s.end, s.end - s.start)}")
            items.append(_Box(x, y + 2, w, row - 4, fill(s), shown if s.kind != "idle" else "", tip))
    axis = top + row * len(names) + 4
    items.append(_Box(left, axis, plot, 1, "#444444"))
    n_ticks = min(12, max(2, int(plot / (_CHAR * 11))))  # room for `12.5 GFLOP` beside each other
    ticks = _ticks(tl.makespan, n_ticks)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    for t in ticks:
        items += [_Box(left + t * scale - 0.5, axis, 1, 5, "#444444"),
                  _Text(left + t * scale, axis + 17, _tick_text(tl, t, step), "middle")]
    items.append(_Text(left + plot, axis + 32, axis_caption(tl), "end"))
    # legend: shades name the kind, colours the micro-batch
    y, x = axis + 44, 8.0
    kinds = {s.kind for s in busy}
    for kind, what in KINDS:
        if kind in kinds:
            items += [_Box(x, y, 12, 12, _HUES[0][_SHADE[kind]]), _Text(x + 16, y + 10, f"{kind} {what}")]
            x += 30 + _CHAR * len(f"{kind} {what}")
    items += [_Box(x, y, 12, 12, IDLE), _Text(x + 16, y + 10, "idle (bubble)")]
    y, x = y + 20, 8.0
    items.append(_Text(x, y + 10, "micro-batch"))
    x += 12 + _CHAR * 11
    for mb in range(min(tl.microbatches, len(_HUES))):
        items += [_Box(x, y, 12, 12, _HUES[mb][1]), _Text(x + 16, y + 10, str(mb))]
        x += 22 + _CHAR * len(str(mb))
    if tl.microbatches > len(_HUES):
        items.append(_Text(x, y + 10, f"(colours repeat every {len(_HUES)})"))
        x += _CHAR * 26
    if _stages_per_group(tl) > 1:
        key = "labels: 2F0 = stage 2, forward, micro-batch 0"
        items.append(_Text(x + 12, y + 10, key))
        x += 12 + _CHAR * len(key)
    return max(total_w, x + 8), y + 24, items


def schedule_svg(tl: Timeline, width: int = 960) -> str:
    """The chart as a standalone SVG document (deterministic text)."""
    w, h, items = _layout(tl, width)
    w, h = math.ceil(w), math.ceil(h)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<title>{escape(title(tl))}</title>']
    for it in items:
        if isinstance(it, _Text):
            size = f' font-size="{it.size}"' if it.size != 11 else ""
            out.append(f'<text x="{it.x:.2f}" y="{it.y:.1f}" text-anchor="{it.anchor}"{size}>{escape(it.text)}</text>')
            continue
        tip = f"<title>{escape(it.tip)}</title>" if it.tip else ""
        stroke = ' stroke="#ffffff" stroke-width="1"' if it.h > 5 else ""
        out.append(f'<rect x="{it.x:.2f}" y="{it.y:.2f}" width="{it.w:.2f}" height="{it.h:.2f}" fill="{it.fill}"'
                   f'{stroke}>{tip}</rect>')
        if it.label:
            out.append(f'<text x="{it.x + it.w / 2:.2f}" y="{it.y + it.h / 2 + 4:.1f}" text-anchor="middle">'
                       f'{escape(it.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _dq(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def schedule_dot(tl: Timeline, width: int = 960) -> str:
    """The chart as DOT with every shape pinned (draw with `neato -n2`), for PNG and PDF."""
    w, h, items = _layout(tl, width)
    out = ["digraph schedule {",
           f'  graph [bb="0,0,{w:.0f},{h:.0f}", pad=0.1, bgcolor=white, tooltip={_dq(title(tl))}];',
           '  node [fontname="Helvetica", fontsize=11, fixedsize=true, penwidth=0, margin=0];']
    for k, it in enumerate(items):
        if isinstance(it, _Text):
            # a fixed-size text node: `\l` / `\r` justify the line inside it, so anchor start/end hold
            tw = _CHAR * len(it.text) * it.size / 11 + 4
            cx = {"start": it.x + tw / 2, "middle": it.x, "end": it.x - tw / 2}[it.anchor]
            end = {"start": "\\l", "end": "\\r"}.get(it.anchor, "")
            out.append(f'  n{k} [shape=plaintext, fontsize={it.size}, width={tw / 72:.3f}, height={14 / 72:.3f}, '
                       f'pos="{cx:.2f},{h - it.y + 4:.2f}!", label="{_dq(it.text)[1:-1]}{end}"];')
            continue
        out.append(f'  n{k} [shape=box, style=filled, fillcolor="{it.fill}", color=white, '
                   f'penwidth={1 if it.h > 5 else 0}, width={it.w / 72:.4f}, height={it.h / 72:.4f}, '
                   f'pos="{it.x + it.w / 2:.2f},{h - it.y - it.h / 2:.2f}!", label={_dq(it.label)}, '
                   f'tooltip={_dq(it.tip)}];')
    out.append("}")
    return "\n".join(out) + "\n"


def _columns(tl: Timeline, need, scale: float) -> dict[float, int]:
    """Time -> text column: proportional to time (`scale` columns per unit), stretched where an action needs
    room for its label
    (`need(slot)` characters). Every row shares the columns, so what runs together lines up."""
    times = sorted({t for lane in tl.slots for s in lane for t in (s.start, s.end)})
    col = {t: round(t * scale) for t in times}
    for t0, t1 in zip(times, times[1:]):  # no instant shorter than one column
        col[t1] = max(col[t1], col[t0] + 1)
    for s in sorted((s for lane in tl.slots for s in lane if s.kind != "idle"), key=lambda s: s.end):
        short = need(s) - (col[s.end] - col[s.start])
        if short > 0:  # push this end and everything after it right
            col = {t: c + short if t >= s.end else c for t, c in col.items()}
    return col


def schedule_text(tl: Timeline, max_width: int = 160) -> str:
    """The chart as text: one row per device group, actions in time order and lined up across rows, each
    as wide as its time or as its label needs, and a key."""
    names = [_lane_name(g) for g in tl.groups]
    pad = max(len(n) for n in names)
    busy = [s for lane in tl.slots for s in lane if s.kind != "idle"]
    sep = _stages_per_group(tl) > 1  # a space after each `0F1` label keeps neighbours apart
    room = max(1, max_width - pad - 3)
    shortest = min((s.end - s.start for s in busy), default=1.0) or 1.0
    # one label form for the whole chart: `2F3`, else `F3`, else `F`, the longest that fits max_width;
    # the shortest action a column wider than its label, the rest in proportion
    forms = (lambda s: slot_label(tl, s), lambda s: s.label, lambda s: s.kind)
    # (less in proportion, down to order alone, before a shorter form)
    for form in forms:
        widest = max((len(form(s)) for s in busy), default=1) + 1
        full = min(widest / shortest, room / tl.makespan) if tl.makespan else 1.0
        for scale in (full, full / 4, 0.0):
            col = _columns(tl, lambda s: len(form(s)) + sep, scale)
            if max(col.values(), default=0) <= room:
                break
        else:
            continue
        break
    else:  # more actions than columns: time alone decides, labels cut to what fits
        col = {t: round(t * room / tl.makespan) for lane in tl.slots for s in lane for t in (s.start, s.end)}
    lines = [title(tl)]
    for name, lane in zip(names, tl.slots):
        cells = [(form(s) if s.kind != "idle" else "")[:col[s.end] - col[s.start]].ljust(col[s.end] - col[s.start])
                 for s in lane]
        lines.append(f"{name.ljust(pad)} |{''.join(cells)}|")
    kinds = {s.kind for s in busy}
    key = ", ".join(f"{k} {w}" for k, w in KINDS if k in kinds)
    if form is not forms[2]:
        key += "; the digit after the letter is the micro-batch"
    if sep and form is forms[0]:
        key += ", the digit before it the stage"
    lines.append(f"{' ' * pad}  key: {key}; widths follow time, stretched to fit labels")
    return "\n".join(lines)


def write_schedule(tl: Timeline, path: str | Path) -> Path:
    """The chart written by suffix: .svg (drawn here), .png/.pdf (drawn by graphviz), .txt (text)."""
    from placer.render.dot import render, write_bytes

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise PlanError(Diagnostic("R005", f"cannot write a schedule chart as {path.suffix or 'a file without suffix'}",
                                   Loc(str(path)), hint="use a path ending in " + ", ".join("." + f for f in FORMATS)))
    data = (schedule_svg(tl).encode() if fmt == "svg" else schedule_text(tl).encode() + b"\n" if fmt == "txt"
            else render(schedule_dot(tl), fmt, engine="neato", pinned=True, path=path))
    return write_bytes(path, data)
