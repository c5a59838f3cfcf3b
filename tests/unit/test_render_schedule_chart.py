"""Schedule charts: the SVG parses and shows every slot; the text chart reads as expected."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from placer.estimate.schedule import simulate
from placer.render.schedule_chart import schedule_svg, schedule_text, title

SVG = "{http://www.w3.org/2000/svg}"


def test_text_chart_1f1b():
    tl = simulate("1f1b", [0, 1], 4, groups=[("cuda:0",), ("cuda:1",)])
    assert schedule_text(tl) == "\n".join([
        "1f1b: 2 stages on 2 device groups, 4 micro-batches, bubble 20.0% (textbook (p-1)/(m+p-1) 20.0%)",
        "cuda:0 |F0F1    B0  F2B1  F3B2    B3  |",
        "cuda:1 |  F0B0  F1B1  F2B2  F3B3      |"])


def test_text_chart_gpipe_with_a_data_group():
    tl = simulate("gpipe", [0, 1], 2, bwd=1.0, groups=[("cuda:0", "cuda:1"), ("cpu",)])
    assert schedule_text(tl).splitlines()[1:] == [
        "cuda:0,cuda:1 |F0F1    B0B1|",
        "cpu           |  F0F1B0B1  |"]


def test_text_chart_names_stages_when_groups_hold_several():
    tl = simulate("interleaved_1f1b", [0, 1, 0, 1], 2)
    rows = schedule_text(tl).splitlines()
    assert "(p-1)/(v*m+p-1)" in rows[0]
    assert rows[1].startswith("group0 |0F0 0F1 2F0 ")
    assert all(len(r) == len(rows[1]) for r in rows[1:])


def test_text_chart_stays_within_width():
    tl = simulate("1f1b", list(range(8)), 32)
    rows = schedule_text(tl, max_width=100).splitlines()[1:]
    assert all(len(r) <= 100 for r in rows) and all(r.endswith("|") for r in rows)


def test_svg_parses_and_draws_every_slot():
    tl = simulate("zbv_zero_bubble", [0, 1, 1, 0], 4, groups=[("cuda:0", "a<b&c"), ("cpu",)])
    root = ET.fromstring(schedule_svg(tl))
    assert root.tag == SVG + "svg"
    rects = root.findall(SVG + "rect")
    slots = sum(len(lane) for lane in tl.slots)
    kinds = {s.kind for lane in tl.slots for s in lane}
    assert len(rects) == slots + len(kinds)  # one per slot, one legend swatch per kind shown
    texts = [t.text for t in root.iter(SVG + "text")]
    assert title(tl) in texts and "cuda:0,a<b&c" in texts
    assert "bubble 4.0%" in title(tl) and "textbook (p-1)/(v*m+p-1) 11.1%" in title(tl)
    # rects sit inside the drawing, in time order per row
    width = float(root.get("width"))
    assert all(0 <= float(r.get("x")) and float(r.get("x")) + float(r.get("width")) <= width + 0.01 for r in rects)


def test_svg_is_deterministic():
    tl = simulate("1f1b", [0, 1, 2], 3, fwd=[1, 2, 1])
    assert schedule_svg(tl) == schedule_svg(simulate("1f1b", [0, 1, 2], 3, fwd=[1, 2, 1]))
